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
    const int64_t nblocks = K / QK, groups = (nblocks + GROUP - 1) / GROUP;
    __m256 acc0[MAX_TILE], acc1[MAX_TILE], min0[MAX_TILE], min1[MAX_TILE];
    for (int64_t t = 0; t < rows; t++)
      acc0[t] = acc1[t] = min0[t] = min1[t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < groups; g++) {
      // 1. decode the group once for all rows
      GroupParams p;
      group_params<T>(row, g, nblocks, half_f16c, p);
      __m256i codes[GROUP], magnitudes[GROUP], subs[GROUP];
      decode_codes<T>(row, g, p.blocks, codes);
      for (int j = 0; j < GROUP; j++) {
        if constexpr (Traits<T>::kSigned) magnitudes[j] = _mm256_abs_epi8(codes[j]);
        if constexpr (Traits<T>::kSubScales)
          subs[j] = _mm256_set_m128i(_mm_set1_epi16(p.sub[j][1]), _mm_set1_epi16(p.sub[j][0]));
        else
          subs[j] = ones;
      }
      const __m256 scale = _mm256_loadu_ps(p.scale);
      const __m256 min_lo = _mm256_loadu_ps(p.min), min_hi = _mm256_loadu_ps(p.min + 8);
      // 2. each row's products over it
      for (int64_t t = 0; t < rows; t++) {
        const int8_t* q = x.row_codes(r0 + t) + g * QK_K;
        const __m256 scales = _mm256_mul_ps(scale, _mm256_loadu_ps(x.row_scales(r0 + t) + g * GROUP));
        __m256 a0 = acc0[t], a1 = acc1[t];
#pragma GCC unroll 8
        for (int j = 0; j < GROUP; j++) {
          const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + QK * j));
          const __m256i pairs =
              Traits<T>::kSigned
                  ? _mm256_maddubs_epi16(magnitudes[j], _mm256_sign_epi8(xq, codes[j]))
                  : _mm256_maddubs_epi16(codes[j], xq);
          const __m256 lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, subs[j]));
          const __m256 s = _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(j));
          if (j % 2 == 0)
            a0 = _mm256_fmadd_ps(lanes, s, a0);
          else
            a1 = _mm256_fmadd_ps(lanes, s, a1);
        }
        acc0[t] = a0;
        acc1[t] = a1;
        if constexpr (Traits<T>::kMins) {
          const float* sx = x.row_sums(r0 + t) + g * 16;
          min0[t] = _mm256_fmadd_ps(min_lo, _mm256_loadu_ps(sx), min0[t]);
          min1[t] = _mm256_fmadd_ps(min_hi, _mm256_loadu_ps(sx + 8), min1[t]);
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
