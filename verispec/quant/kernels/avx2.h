// The AVX2 kernel (AVX2 + FMA + F16C; e.g. Intel Haswell and later, AMD Zen): dot.h's order in
// registers. Per group of 8 blocks the weight codes are decoded once into 8 registers of 32
// bytes; then every activation row of the tile runs its products over them:
//     VPMADDUBSW (unsigned codes x int8 activations -> 16 pair sums in int16; no saturation:
//                 |63 * 127 * 2| < 2^15), VPMADDWD with ones or Q6_K's sub-scales (-> 8 lanes
//                 of int32), VCVTDQ2PS (exact: |lane| < 2^24), VFMADD by scale * d_x.
// Q8_0's signed codes go through the sign trick: |code| x (q_x with code's sign).

#pragma once

#include "dot.h"

#include <immintrin.h>

namespace vq {

inline float half_f16c(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// 16 bytes of nibbles -> 32 codes: the low nibbles (elements 0-15), then the high (16-31).
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// Q5_0 / Q5_1's 32 fifth bits (bit i for element i) -> 16 in the bytes whose bit is set.
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i takes the byte holding bit i
      _mm256_set1_epi32(int(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

// The codes of the group's 8 blocks (zeros past p.blocks), as group.h's block_codes.
template <int T>
inline void decode_codes(const uint8_t* row, int64_t g, int blocks, __m256i* codes) {
  const __m256i low4 = _mm256_set1_epi8(15);
  auto load = [](const uint8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  };
  if constexpr (T == Q4_K || T == Q5_K) {
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    const uint8_t* nibbles = p + (T == Q4_K ? 16 : 48);
    for (int pair = 0; pair < 4; pair++) {  // 32 bytes: sub-block 2 pair low, 2 pair + 1 high
      const __m256i v = load(nibbles + 32 * pair);
      codes[2 * pair] = _mm256_and_si256(v, low4);
      codes[2 * pair + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    }
    if constexpr (T == Q5_K) {  // bit j of byte i is the fifth bit of sub-block j's element i
      const __m256i high = load(p + 16), bit4 = _mm256_set1_epi8(16);
      codes[0] = _mm256_or_si256(codes[0], _mm256_and_si256(_mm256_slli_epi16(high, 4), bit4));
      codes[1] = _mm256_or_si256(codes[1], _mm256_and_si256(_mm256_slli_epi16(high, 3), bit4));
      codes[2] = _mm256_or_si256(codes[2], _mm256_and_si256(_mm256_slli_epi16(high, 2), bit4));
      codes[3] = _mm256_or_si256(codes[3], _mm256_and_si256(_mm256_slli_epi16(high, 1), bit4));
      codes[4] = _mm256_or_si256(codes[4], _mm256_and_si256(high, bit4));
      codes[5] = _mm256_or_si256(codes[5], _mm256_and_si256(_mm256_srli_epi16(high, 1), bit4));
      codes[6] = _mm256_or_si256(codes[6], _mm256_and_si256(_mm256_srli_epi16(high, 2), bit4));
      codes[7] = _mm256_or_si256(codes[7], _mm256_and_si256(_mm256_srli_epi16(high, 3), bit4));
    }
  } else if constexpr (T == Q6_K) {
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {  // block 4h + k: low nibbles from 64 h + 32 (k % 2) >> 4 (k / 2),
      const __m256i lo0 = load(p + 64 * h), lo1 = load(p + 64 * h + 32);  // 2 high bits >> 2k
      const __m256i hi = load(p + 128 + 32 * h);
      codes[4 * h] = _mm256_or_si256(
          _mm256_and_si256(lo0, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), bits45));
      codes[4 * h + 1] = _mm256_or_si256(
          _mm256_and_si256(lo1, low4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), bits45));
      codes[4 * h + 2] = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(lo0, 4), low4), _mm256_and_si256(hi, bits45));
      codes[4 * h + 3] = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(lo1, 4), low4),
          _mm256_and_si256(_mm256_srli_epi16(hi, 2), bits45));
    }
  } else {
    for (int j = 0; j < GROUP; j++) {
      if (j >= blocks) {
        codes[j] = _mm256_setzero_si256();
        continue;
      }
      const uint8_t* p = row + (g * GROUP + j) * Traits<T>::kBlockBytes;
      if constexpr (T == Q8_0) {
        codes[j] = load(p + 2);
      } else {
        constexpr int kNibbles = T == Q4_0 ? 2 : T == Q4_1 ? 4 : T == Q5_0 ? 6 : 8;
        codes[j] = nibbles16(p + kNibbles);
        if constexpr (T == Q5_0 || T == Q5_1)
          codes[j] = _mm256_or_si256(codes[j], fifth_bits(load_u32(p + (T == Q5_0 ? 2 : 4))));
      }
    }
  }
}

// A group's float parameters (group.h's group_params, the same bits) in registers: the blocks'
// scales, the halves' additive parts, and Q6_K's sub-scales as VPMADDWD multipliers.
struct GroupVectors {
  __m256 scale;           // block j's scale in lane j
  __m256 min_lo, min_hi;  // halves 0-7, 8-15
  __m256i sub[GROUP];     // Q6_K: int16 sub-scale of block j's first half (low 128 bits), second
};

// Lanes 0-7 of v repeated pairwise: halves 2j and 2j + 1 share block j's additive part.
inline void pair_halves(__m256 v, __m256& lo, __m256& hi) {
  lo = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
  hi = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

// 8 fp16 values at p, p + stride, ... (one field of 8 consecutive blocks) as floats.
inline __m256 halves8(const uint8_t* p, int64_t stride) {
  return _mm256_cvtph_ps(_mm_setr_epi16(
      short(load_u16(p)), short(load_u16(p + stride)), short(load_u16(p + 2 * stride)),
      short(load_u16(p + 3 * stride)), short(load_u16(p + 4 * stride)),
      short(load_u16(p + 5 * stride)), short(load_u16(p + 6 * stride)),
      short(load_u16(p + 7 * stride))));
}

template <int T>
inline void group_vectors(const uint8_t* row, int64_t g, int64_t nblocks, GroupVectors& v) {
  if constexpr (T == Q4_K || T == Q5_K) {
    // sc_j and m_j as bytes: 0-3 from the low 6 bits of s[0-3] / s[4-7]; 4-7 from the nibbles
    // of s[8-11] and the top two bits of s[0-3] / s[4-7] (formats.h's k_scale_min)
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    const uint32_t a = load_u32(p + 4), b = load_u32(p + 8), c = load_u32(p + 12);
    const uint64_t scales = (a & 0x3f3f3f3fu) |
        uint64_t((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    const uint64_t mins = (b & 0x3f3f3f3fu) |
        uint64_t(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
    auto floats = [](uint64_t bytes) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(int64_t(bytes))));
    };
    v.scale = _mm256_mul_ps(_mm256_set1_ps(half_f16c(p)), floats(scales));
    const __m256 m = _mm256_mul_ps(_mm256_set1_ps(half_f16c(p + 2)), floats(mins));
    pair_halves(_mm256_xor_ps(m, _mm256_set1_ps(-0.0f)), v.min_lo, v.min_hi);
  } else if constexpr (T == Q6_K) {
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    const __m256 d = _mm256_set1_ps(half_f16c(p + 208));
    v.scale = d;
    const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192));
    const __m256 minus32 = _mm256_set1_ps(-32.0f);
    v.min_lo = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))),
                             minus32);
    v.min_hi = _mm256_mul_ps(
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)))),
        minus32);
    // block j's multipliers: int16 scale 2j in the low 128 bits, 2j + 1 in the high
    const __m256i s16 = _mm256_cvtepi8_epi16(s8);  // scales 0-7 low, 8-15 high
    const __m256i low = _mm256_permute2x128_si256(s16, s16, 0x00);
    const __m256i high = _mm256_permute2x128_si256(s16, s16, 0x11);
    for (int j = 0; j < GROUP; j++) {
      const int k = 4 * (j % 4);  // byte offset of scale 2j (within its 128-bit half)
      const __m256i pick = _mm256_setr_epi8(
          k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1, k, k + 1,
          k + 2, k + 3, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3, k + 2, k + 3,
          k + 2, k + 3, k + 2, k + 3);
      v.sub[j] = _mm256_shuffle_epi8(j < 4 ? low : high, pick);
    }
  } else {
    const int64_t left = nblocks - g * GROUP;
    if (left < GROUP) {  // a row's last, short group: the portable code, once a row
      GroupParams p;
      group_params<T>(row, g, nblocks, half_f16c, p);
      v.scale = _mm256_loadu_ps(p.scale);
      v.min_lo = _mm256_loadu_ps(p.min);
      v.min_hi = _mm256_loadu_ps(p.min + 8);
      return;
    }
    constexpr int64_t kBytes = Traits<T>::kBlockBytes;
    const uint8_t* p = row + g * GROUP * kBytes;
    v.scale = halves8(p, kBytes);
    if constexpr (T == Q4_0) pair_halves(_mm256_mul_ps(v.scale, _mm256_set1_ps(-8.0f)),
                                         v.min_lo, v.min_hi);
    if constexpr (T == Q5_0) pair_halves(_mm256_mul_ps(v.scale, _mm256_set1_ps(-16.0f)),
                                         v.min_lo, v.min_hi);
    if constexpr (T == Q4_1 || T == Q5_1) pair_halves(halves8(p + 2, kBytes), v.min_lo, v.min_hi);
  }
}

inline void store_sums(__m256 acc0, __m256 acc1, __m256 min0, __m256 min1, RowSums& s) {
  _mm256_storeu_ps(s.acc[0], acc0);
  _mm256_storeu_ps(s.acc[1], acc1);
  _mm256_storeu_ps(s.mins[0], min0);
  _mm256_storeu_ps(s.mins[1], min1);
}

struct Avx2Kernel {
  static constexpr const char* kName = "avx2";

  template <int T>
  static void rows(const uint8_t* row, int64_t K, const Activations& x, int64_t r0, int64_t rows,
                   float* out, int64_t ldy) {
    switch (rows) {  // a fixed count lets the compiler keep a tile's sums in registers
      case 1: return tile<T, 1>(row, K, x, r0, rows, out, ldy);
      case 2: return tile<T, 2>(row, K, x, r0, rows, out, ldy);
      default: return tile<T, 0>(row, K, x, r0, rows, out, ldy);
    }
  }

  // kRows: the tile's row count when fixed at compile time, 0 when `rows` says.
  template <int T, int kRows>
  static void tile(const uint8_t* row, int64_t K, const Activations& x, int64_t r0,
                   int64_t rows, float* out, int64_t ldy) {
    if constexpr (kRows > 0) rows = kRows;
    constexpr int kTile = kRows > 0 ? kRows : MAX_TILE;
    const int64_t nblocks = K / QK, groups = (nblocks + GROUP - 1) / GROUP;
    __m256 acc0[kTile], acc1[kTile], min0[kTile], min1[kTile];
    for (int64_t t = 0; t < rows; t++)
      acc0[t] = acc1[t] = min0[t] = min1[t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
      // 1. decode the group once for all rows
      GroupVectors v;
      group_vectors<T>(row, g, nblocks, v);
      __m256i codes[GROUP], magnitudes[GROUP];
      decode_codes<T>(row, g, int(nblocks - g * GROUP), codes);
      if constexpr (Traits<T>::kSigned)
        for (int j = 0; j < GROUP; j++) magnitudes[j] = _mm256_abs_epi8(codes[j]);
      // 2. each row's products over it
      for (int64_t t = 0; t < rows; t++) {
        const int8_t* q = x.row_codes(r0 + t) + g * QK_K;
        // scale_j * d_x[j] for the 8 blocks; each half duplicated into both 128-bit lanes so
        // that block j's factor is one in-lane shuffle away
        const __m256 products = _mm256_mul_ps(v.scale,
                                              _mm256_loadu_ps(x.row_scales(r0 + t) + g * GROUP));
        const __m256 first4 = _mm256_permute2f128_ps(products, products, 0x00);
        const __m256 last4 = _mm256_permute2f128_ps(products, products, 0x11);
        __m256 a0 = acc0[t], a1 = acc1[t];
#pragma GCC unroll 8
        for (int j = 0; j < GROUP; j++) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + QK * j));
          const __m256i pairs =
              Traits<T>::kSigned
                  ? _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(xq, codes[j]))
                  : _mm256_maddubs_epi16(codes[j], xq);
          const __m256 lanes = _mm256_cvtepi32_ps(
              _mm256_madd_epi16(pairs, Traits<T>::kSubScales ? v.sub[j] : ones));
          const __m256 half = j < 4 ? first4 : last4;
          const __m256 s = j % 4 == 0 ? _mm256_permute_ps(half, 0x00)
                           : j % 4 == 1 ? _mm256_permute_ps(half, 0x55)
                           : j % 4 == 2 ? _mm256_permute_ps(half, 0xaa)
                                        : _mm256_permute_ps(half, 0xff);
          if (j % 2 == 0)
            a0 = _mm256_fmadd_ps(lanes, s, a0);
          else
            a1 = _mm256_fmadd_ps(lanes, s, a1);
        }
        acc0[t] = a0;
        acc1[t] = a1;
        if constexpr (Traits<T>::kMins) {
          const float* sx = x.row_sums(r0 + t) + g * 16;
          min0[t] = _mm256_fmadd_ps(v.min_lo, _mm256_loadu_ps(sx), min0[t]);
          min1[t] = _mm256_fmadd_ps(v.min_hi, _mm256_loadu_ps(sx + 8), min1[t]);
        }
      }
    }
    for (int64_t t = 0; t < rows; t++) {
      RowSums s;
      store_sums(acc0[t], acc1[t], min0[t], min1[t], s);
      out[t * ldy] = finish<T>(s);
    }
  }
};

}  // namespace vq
