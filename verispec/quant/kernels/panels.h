// Weights repacked into panels of 16 rows, and the order of a panel product: what lets a
// register hold the same output of 16 weight rows (one AVX-512 register, two AVX2 registers), so
// that a pass over several activation rows costs little more than a pass over one (avx512.h's
// PanelKernel, avx2.h's Avx2PanelKernel).
//
// The panel order. For output n and activation row r, over the row's 32-element blocks b:
//     I_b = sum over halves h of sub_h * sum_{i in h} (u_i - offset) * q_i      (an exact int32)
//     acc = fma(float(I_b), scale_b * d_x[b], acc)
//     mac = fma(min_b, s_x[b], mac)                        (types with an additive part only)
// then y = acc + mac. u is the weight's stored unsigned code, q the activation's int8 code (the
// same activations as dot.h's: d_x per 32, activations.h), s_x[b] = d_x[b] * float(sum_b q).
// scale_b and min_b are group.h's floats; sub_h is 1 but for Q6_K's int8 scale of 16 elements:
//     Q4_0: offset 8, scale d                                Q4_1: offset 0, scale d, min m
//     Q5_0: offset 16, scale d                               Q8_0: offset 128 (u = code + 128)
//     Q4_K, Q5_K: offset 0, scale d * sc_b, min -(dmin * m_b)
//     Q6_K: offset 32, scale d
// The integer part is exact whatever the grouping, so a kernel may split it over any number of
// accumulators; the float part is one chain per output in block order. Nothing depends on the
// other rows, the row count or the thread: a row's output is the same bits alone or among many.
// This is a different order from dot.h's, so packed products differ from the file-layout
// kernels' in the last bits; `reference` below computes it in plain C++ from the file's own
// blocks (the tests hold every path's kernel and the packing to it).
//
// A panel's bytes, per 256-element super-block (K-types) or 32-element block (the others):
//   Q4_0 (288 B):  d fp16[16 rows] | 4 x 64 B of nibbles
//   Q4_1 (320 B):  d fp16[16] | m fp16[16] | 4 x 64 B of nibbles
//   Q5_0 (352 B):  d fp16[16] | 4 x 64 B of nibbles | 64 B of fifth bits
//   Q8_0 (544 B):  d fp16[16] | 8 x 64 B of codes + 128, chunk c in register c
//   Q4_K (2368 B): d fp16[16] | dmin fp16[16] | sc u8[8 blocks][16] | m u8[8][16] |
//                  per block j: 4 x 64 B of nibbles
//   Q5_K (2880 B): Q4_K's, with 64 B of fifth bits after each block's nibbles
//   Q6_K (3360 B): d fp16[16] | sc int8[16 halves][16] | per block j: 4 x 64 B of nibbles,
//                  2 x 64 B of high bit pairs
// Nibble register c (0..3) of a block: byte 4 * row + i holds element 4c + i in its low nibble
// and element 16 + 4c + i in its high nibble, so register c gives chunks c and c + 4, each the
// 4 codes VPDPBUSD multiplies with 4 activation bytes, for all 16 rows (AVX2: rows 0-7 in the
// register's first 32 bytes, rows 8-15 in the next). Q6_K's high register k (0, 1): bits 2t,
// 2t + 1 of byte 4 * row + i are the top bits of element 16k + 4t + i. A fifth-bit register
// (Q5_0, Q5_K): bit c of byte 4 * row + i is the fifth bit of element 4c + i.

#pragma once

#include "activations.h"
#include "group.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace vq {

// How panel kernels fetch a panel's blocks ahead of the one they multiply, set once at load by
// CPU vendor (`set_prefetch`, quant_kernels.py):
//   - into L1, a few blocks ahead: always with several activation rows; with a lone row only
//     where `prefetch_lone_row` (on AMD Zen 4 the hardware prefetcher keeps pace with one row,
//     and software prefetches 8 blocks ahead cost ~7% of a Qwen2.5-1.5B step; on an Intel Xeon 4
//     ahead, the AVX-512 kernel's kLoneAhead, take 16% off it);
//   - into L2, `prefetch_far` blocks ahead (0: not), for every row count: the stream from
//     memory then keeps enough lines in flight. 16 ahead, on an Intel Xeon: the 1.5B's
//     one-token step a further -10%, two rows -23%, the 0.5B's step -13%, -25% on the AVX2
//     kernel; on an AMD EPYC Zen 4 (medians, alternated with none): the 1.5B's one-token step
//     -16 to -24%, 5 positions -13%, 9 -15%, the 0.5B's step -13%, SmolLM2's -7%.
inline bool& prefetch_lone_row() {
  static bool on = false;
  return on;
}
inline int64_t& prefetch_far() {
  static int64_t blocks = 0;
  return blocks;
}

// The `bytes` at p + offset into L2, where `prefetch_far` asks for it (p + offset may lie past
// the weight: a prefetch never faults).
inline void prefetch_far_block(const uint8_t* p, int64_t offset, int64_t bytes) {
  if (prefetch_far() > 0)
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + offset + line, 0, 2);
}

constexpr int64_t PANEL = 16;  // weight rows in a panel
// Activation rows a panel kernel takes at once: each count up to 8 is compiled on its own, its
// sums in registers; a prompt's rows go 8 at a time over a panel that stays in L1.
constexpr int64_t PANEL_TILE = 8;

// The types with a panel layout, in the order `panel_types()` lists them (module.cpp).
constexpr int kPanelTypes[] = {Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K};

constexpr int64_t panel_block_bytes(int type) {  // one (super-)block of one panel; 0: no layout
  switch (type) {
    case Q4_0: return 288;
    case Q4_1: return 320;
    case Q5_0: return 352;
    case Q8_0: return 544;
    case Q4_K: return 2368;
    case Q5_K: return 2880;
    case Q6_K: return 3360;
    default: return 0;
  }
}

inline bool has_panels(int type) { return panel_block_bytes(type) != 0; }

constexpr int64_t panel_block_size(int type) {
  return type == Q4_K || type == Q5_K || type == Q6_K ? QK_K : QK;
}

inline int64_t panel_bytes(int type, int64_t K) {  // one panel: 16 rows of K values
  return K / panel_block_size(type) * panel_block_bytes(type);
}

template <int T>
constexpr int kPanelOffset = T == Q4_0 ? 8 : T == Q5_0 ? 16 : T == Q8_0 ? 128 : T == Q6_K ? 32 : 0;
template <int T>
constexpr bool kPanelMins = T == Q4_1 || T == Q4_K || T == Q5_K;  // a min_b (mac above)

// The extra activation sums the panel order reads, for `rows` quantised rows.
struct PanelSums {
  const float* s32;      // [rows, padded / 32]: d_x * float(sum of the block's codes)
  const int32_t* b16;    // [rows, padded / 16]: sum of each 16 codes
};

inline void panel_sums(const Activations& x, int64_t row, float* s32, int32_t* b16) {
  const int8_t* q = x.row_codes(row);
  const float* d = x.row_scales(row);
  for (int64_t h = 0; h < x.padded / 16; h++) {
    int32_t sum = 0;
    for (int i = 0; i < 16; i++) sum += q[16 * h + i];
    b16[h] = sum;
  }
  for (int64_t b = 0; b < x.padded / QK; b++) s32[b] = d[b] * float(b16[2 * b] + b16[2 * b + 1]);
}

// Nibble registers (4 x 64 B) of one block's 32 codes for row r, as the layout above says.
inline void pack_nibbles(const uint8_t* codes, int64_t r, uint8_t* out) {
  for (int c = 0; c < 4; c++)
    for (int i = 0; i < 4; i++)
      out[64 * c + 4 * r + i] = uint8_t((codes[4 * c + i] & 15) | (codes[16 + 4 * c + i] & 15) << 4);
}

// The fifth-bit register (64 B) of one block's 32 five-bit codes for row r.
inline void pack_fifth_bits(const uint8_t* codes, int64_t r, uint8_t* out) {
  for (int i = 0; i < 4; i++) {
    int bits = 0;
    for (int c = 0; c < 8; c++) bits |= (codes[4 * c + i] >> 4) << c;
    out[4 * r + i] = uint8_t(bits);
  }
}

// Rows n0 .. n0 + 15 of a file-layout weight ([N, row_bytes]) into one panel (`out`).
template <int T>
inline void pack_panel(const uint8_t* weight, int64_t row_bytes, int64_t n0, int64_t K,
                       uint8_t* out) {
  if constexpr (!Traits<T>::kBlock256) {
    for (int64_t b = 0; b < K / QK; b++) {
      uint8_t* o = out + b * panel_block_bytes(T);
      for (int64_t r = 0; r < PANEL; r++) {
        const uint8_t* row = weight + (n0 + r) * row_bytes;
        const uint8_t* p = row + b * Traits<T>::kBlockBytes;
        std::memcpy(o + 2 * r, p, 2);                                    // d
        if constexpr (T == Q4_1) std::memcpy(o + 32 + 2 * r, p + 2, 2);  // m
        uint8_t codes[QK];
        block_codes<T>(row, b / GROUP, int(b % GROUP), codes);
        if constexpr (T == Q8_0) {
          for (int c = 0; c < 8; c++)
            for (int i = 0; i < 4; i++) o[32 + 64 * c + 4 * r + i] = uint8_t(codes[4 * c + i] ^ 0x80);
        } else {
          pack_nibbles(codes, r, o + (T == Q4_1 ? 64 : 32));
          if constexpr (T == Q5_0) pack_fifth_bits(codes, r, o + 288);
        }
      }
    }
    return;
  }
  constexpr bool kMinBytes = T == Q4_K || T == Q5_K;  // d, dmin, sc, m: Q4_K's header
  constexpr int64_t kHeader = kMinBytes ? 320 : 288;
  constexpr int64_t kPerBlock = T == Q4_K ? 256 : T == Q5_K ? 320 : 384;
  for (int64_t s = 0; s < K / QK_K; s++) {
    uint8_t* o = out + s * panel_block_bytes(T);
    for (int64_t r = 0; r < PANEL; r++) {
      const uint8_t* row = weight + (n0 + r) * row_bytes;
      const uint8_t* p = row + s * Traits<T>::kBlockBytes;
      uint8_t codes[GROUP][QK];
      for (int j = 0; j < GROUP; j++) block_codes<T>(row, s, j, codes[j]);
      if constexpr (kMinBytes) {
        std::memcpy(o + 2 * r, p, 2);           // d
        std::memcpy(o + 32 + 2 * r, p + 2, 2);  // dmin
        for (int j = 0; j < GROUP; j++) {
          int sc, m;
          k_scale_min(p + 4, j, sc, m);
          o[64 + 16 * j + r] = uint8_t(sc);
          o[192 + 16 * j + r] = uint8_t(m);
        }
      } else {
        std::memcpy(o + 2 * r, p + 208, 2);  // d
        for (int h = 0; h < 16; h++) o[32 + 16 * h + r] = p[192 + h];
      }
      for (int j = 0; j < GROUP; j++) {
        uint8_t* b = o + kHeader + j * kPerBlock;
        pack_nibbles(codes[j], r, b);
        if constexpr (T == Q5_K) pack_fifth_bits(codes[j], r, b + 256);
        if constexpr (T == Q6_K)
          for (int k = 0; k < 2; k++)
            for (int i = 0; i < 4; i++) {
              int bits = 0;
              for (int t = 0; t < 4; t++) bits |= (codes[j][16 * k + 4 * t + i] >> 4) << (2 * t);
              b[256 + 64 * k + 4 * r + i] = uint8_t(bits);
            }
      }
    }
  }
}

// The panel order in plain C++, from the file's own blocks: out[t * ldy] for activation rows
// r0 + t (t < rows) and the file-layout weight row `row`.
// Built without auto-vectorisation: GCC 12 turns its signed-by-signed byte products into
// VPDPBUSD (unsigned by signed) where AVX512-VNNI is on, and the reference must stay plain C++.
template <int T>
__attribute__((optimize("no-tree-vectorize")))
inline void reference(const uint8_t* row, int64_t K, const Activations& x, const PanelSums& sums,
                      int64_t r0, int64_t rows, float* out, int64_t ldy) {
  const int64_t nblocks = K / QK;
  for (int64_t t = 0; t < rows; t++) {
    const int8_t* q = x.row_codes(r0 + t);
    const float* d = x.row_scales(r0 + t);
    const float* s32 = sums.s32 + (r0 + t) * (x.padded / QK);
    float acc = 0.0f, mac = 0.0f;
    for (int64_t g = 0; g < (nblocks + GROUP - 1) / GROUP; g++) {
      GroupParams p;
      group_params<T>(row, g, nblocks, load_half, p);
      for (int j = 0; j < p.blocks; j++) {
        const int64_t b = g * GROUP + j;
        uint8_t codes[QK];
        block_codes<T>(row, g, j, codes);
        int32_t integer = 0;
        for (int h = 0; h < 2; h++) {
          int32_t half = 0;
          for (int i = 16 * h; i < 16 * h + 16; i++) {  // u - offset: Q8_0's int8 code
            const int w = T == Q8_0 ? int(int8_t(codes[i])) : int(codes[i]) - kPanelOffset<T>;
            half += w * q[QK * b + i];
          }
          integer += int32_t(p.sub[j][h]) * half;
        }
        acc = std::fma(float(integer), p.scale[j] * d[b], acc);
        if constexpr (kPanelMins<T>) mac = std::fma(p.min[2 * j], s32[b], mac);
      }
    }
    out[t * ldy] = kPanelMins<T> ? acc + mac : acc;
  }
}

// Calls body(std::integral_constant<int, T>{}) for the panel type T == type (has_panels).
template <class Body>
inline void with_panel_type(int type, Body&& body) {
  switch (type) {
    case Q4_0: return body(std::integral_constant<int, Q4_0>{});
    case Q4_1: return body(std::integral_constant<int, Q4_1>{});
    case Q5_0: return body(std::integral_constant<int, Q5_0>{});
    case Q8_0: return body(std::integral_constant<int, Q8_0>{});
    case Q4_K: return body(std::integral_constant<int, Q4_K>{});
    case Q5_K: return body(std::integral_constant<int, Q5_K>{});
    case Q6_K: return body(std::integral_constant<int, Q6_K>{});
  }
}

// pack_panel and reference for a type known at run time (module.cpp's bindings).
inline void pack_panel_of(int type, const uint8_t* weight, int64_t row_bytes, int64_t n0,
                          int64_t K, uint8_t* out) {
  with_panel_type(type, [&](auto t) {
    pack_panel<decltype(t)::value>(weight, row_bytes, n0, K, out);
  });
}

inline void reference_of(int type, const uint8_t* row, int64_t K, const Activations& x,
                         const PanelSums& sums, int64_t r0, int64_t rows, float* out,
                         int64_t ldy) {
  with_panel_type(type, [&](auto t) {
    reference<decltype(t)::value>(row, K, x, sums, r0, rows, out, ldy);
  });
}

}  // namespace vq
