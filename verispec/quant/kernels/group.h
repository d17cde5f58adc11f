// A weight row read as groups of 8 blocks of 32 (one K-type super-block, or 8 consecutive
// blocks of a 32-element type, fewer at the row's end): what every kernel path decodes before
// its integer products. A weight in block j of a group is
//     scale[j] * sub[j][half] * code + min[2 * j + half]        (half = element / 16)
// with integer codes (unsigned, or int8 for Q8_0) and integer sub-scales (Q6_K's int8 scales,
// else 1), so a row's sum over a block is scale[j] * d_x * (integer dot) plus, per half,
// min * s_x (activations.h): the integer part exact, the float part in one fixed order
// (dot.h). Q4_0's value d * (q - 8) reads as scale d, min -8 d, and so on for every type.
//
// The float parameters are computed here once for both paths (the AVX2 path passes F16C's
// conversion as `half`, the portable path formats.h's), so both paths use the same bits.

#pragma once

#include "formats.h"

namespace vq {

template <int T>
struct Traits {
  static constexpr bool kBlock256 = T == Q4_K || T == Q5_K || T == Q6_K;
  static constexpr bool kSigned = T == Q8_0;   // codes are int8 (else unsigned, < 64)
  static constexpr bool kMins = T != Q8_0;     // an additive part per half block
  static constexpr bool kSubScales = T == Q6_K;
  static constexpr int64_t kBlockBytes =
      T == Q4_0 ? 18 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : T == Q8_0 ? 34
      : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
};

struct GroupParams {
  int blocks;          // 32-element blocks in this group (8, fewer only at a row's end)
  float scale[8];      // 0 past `blocks`
  float min[16];       // per 16-element half; 0 past `blocks`
  int16_t sub[8][2];   // per half; 1 unless Q6_K
};

// Group g of a row of `nblocks` 32-element blocks.
template <int T, typename Half>
inline void group_params(const uint8_t* row, int64_t g, int64_t nblocks, Half half,
                         GroupParams& out) {
  for (int j = 0; j < 8; j++) {
    out.scale[j] = 0.0f;
    out.min[2 * j] = out.min[2 * j + 1] = 0.0f;
    out.sub[j][0] = out.sub[j][1] = 1;
  }
  if constexpr (Traits<T>::kBlock256) {
    out.blocks = 8;
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    if constexpr (T == Q6_K) {
      const float d = half(p + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      for (int j = 0; j < 8; j++) {
        out.scale[j] = d;
        for (int h = 0; h < 2; h++) {
          out.sub[j][h] = scales[2 * j + h];
          out.min[2 * j + h] = (d * float(scales[2 * j + h])) * -32.0f;
        }
      }
    } else {
      const float d = half(p), dmin = half(p + 2);
      for (int j = 0; j < 8; j++) {
        int scale, min;
        k_scale_min(p + 4, j, scale, min);
        out.scale[j] = d * float(scale);
        out.min[2 * j] = out.min[2 * j + 1] = -(dmin * float(min));
      }
    }
  } else {
    const int64_t left = nblocks - g * GROUP;
    out.blocks = int(left < GROUP ? left : GROUP);
    for (int j = 0; j < out.blocks; j++) {
      const uint8_t* p = row + (g * GROUP + j) * Traits<T>::kBlockBytes;
      const float d = half(p);
      out.scale[j] = d;
      float min = 0.0f;
      if constexpr (T == Q4_0) min = d * -8.0f;
      if constexpr (T == Q5_0) min = d * -16.0f;
      if constexpr (T == Q4_1 || T == Q5_1) min = half(p + 2);
      out.min[2 * j] = out.min[2 * j + 1] = min;
    }
  }
}

// The codes of block j of group g, in element order, in plain C++ (the portable path; the
// AVX2 path decodes the same codes in registers).
template <int T>
inline void block_codes(const uint8_t* row, int64_t g, int j, uint8_t* q) {
  if constexpr (Traits<T>::kBlock256) {
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    if constexpr (T == Q6_K) {
      const int h = j / 4, k = j % 4;
      const uint8_t* lo = p + 64 * h + 32 * (k % 2);
      const uint8_t* hi = p + 128 + 32 * h;
      for (int i = 0; i < 32; i++)
        q[i] = uint8_t(((lo[i] >> (4 * (k / 2))) & 15) | ((hi[i] >> (2 * k)) & 3) << 4);
    } else {
      const uint8_t* nibbles = p + (T == Q4_K ? 16 : 48) + 32 * (j / 2);
      for (int i = 0; i < 32; i++) {
        int v = (nibbles[i] >> (4 * (j % 2))) & 15;
        if constexpr (T == Q5_K) v |= ((p[16 + i] >> j) & 1) << 4;
        q[i] = uint8_t(v);
      }
    }
  } else {
    const uint8_t* p = row + (g * GROUP + j) * Traits<T>::kBlockBytes;
    if constexpr (T == Q8_0) {
      for (int i = 0; i < 32; i++) q[i] = p[2 + i];
    } else {
      constexpr int kHigh = T == Q5_0 ? 2 : 4;  // where Q5's fifth bits sit
      constexpr int kNibbles = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
      const uint32_t high = (T == Q5_0 || T == Q5_1) ? load_u32(p + kHigh) : 0;
      for (int i = 0; i < 32; i++) {
        const int v = (p[kNibbles + i % 16] >> (4 * (i / 16))) & 15;
        q[i] = uint8_t(v | int((high >> i) & 1) << 4);
      }
    }
  }
}

}  // namespace vq
