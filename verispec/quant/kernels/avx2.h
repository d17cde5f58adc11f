// The AVX2 kernel (AVX2 + FMA + F16C; e.g. Intel Haswell and later, AMD Zen): dot.h's order in
// registers. Per group of 8 blocks the weight codes are decoded once into 8 registers of 32
// bytes; then every activation row of the tile runs its products over them:
//     VPMADDUBSW (unsigned codes x int8 activations -> 16 pair sums in int16; no saturation:
//                 |63 * 127 * 2| < 2^15), VPMADDWD with ones or Q6_K's sub-scales (-> 8 lanes
//                 of int32), VCVTDQ2PS (exact: |lane| < 2^24), VFMADD by scale * d_x.
// Q8_0's signed codes go through the sign trick: |code| x (q_x with code's sign).
//
// Below it, Avx2PanelKernel: the panel order (panels.h) on weights packed by 16 rows.

#pragma once

#include "dot.h"
#include "panels.h"

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

// The panel order (panels.h) on AVX2: a panel's 16 outputs as two halves of 8 rows, each one
// register of 8 int32 / float lanes, so that the float work of a block (one conversion, one
// product, one or two FMAs) is shared by 8 outputs. A half's codes are decoded once per block
// for all activation rows of the tile; per row and chunk c (4 elements), VPMADDUBSW multiplies
// the 8 rows' 4 unsigned codes by 4 activation bytes broadcast to every lane, into pairs of
// int16 sums. Those sums add up in int16 as far as they cannot saturate, |code| * 127 * 2 per
// chunk: 8 chunks of 4-bit codes (8 * 15 * 254 = 30480 < 2^15), 4 of 5-bit (31496), 2 of 6-bit
// (32004); then one VPMADDWD (with ones, or Q6_K's sub-scales) per such sum makes each lane an
// exact int32. Q8_0's codes (u - 128) are signed, through the sign trick as the row kernel's:
// |code| x (activation with the code's sign), 2 * 128 * 127 < 2^15 for one chunk.
struct Avx2PanelKernel {
  // out[t * ldy + 0 .. 15] for activation rows r0 + t, t < rows <= MAX_TILE (as PanelKernel).
  template <int T>
  static void rows(const uint8_t* panel, int64_t K, const Activations& x, const PanelSums& sums,
                   int64_t r0, int64_t rows, float* out, int64_t ldy) {
    switch (rows) {  // a fixed count lets the compiler keep a tile's sums in registers
      case 1: return tile<T, 1>(panel, K, x, sums, r0, rows, out, ldy);
      case 2: return tile<T, 2>(panel, K, x, sums, r0, rows, out, ldy);
      case 3: return tile<T, 3>(panel, K, x, sums, r0, rows, out, ldy);
      case 4: return tile<T, 4>(panel, K, x, sums, r0, rows, out, ldy);
      case 5: return tile<T, 5>(panel, K, x, sums, r0, rows, out, ldy);
      case 6: return tile<T, 6>(panel, K, x, sums, r0, rows, out, ldy);
      case 7: return tile<T, 7>(panel, K, x, sums, r0, rows, out, ldy);
      case 8: return tile<T, 8>(panel, K, x, sums, r0, rows, out, ldy);
      default: return tile<T, 0>(panel, K, x, sums, r0, rows, out, ldy);
    }
  }

  static constexpr int64_t kAhead = 8;  // blocks fetched ahead of the one multiplied

  // One block's codes and factors for half h of the panel (rows 8h .. 8h + 7).
  struct Half {
    __m256i chunk[8];        // chunk c: codes of elements 4c .. 4c + 3 (Q8_0: |code|)
    __m256i sign[8];         // Q8_0: the signed codes, whose signs the activations take
    __m256 scale, minimum;   // scale_b, min_b per row
    __m256i sub_lo, sub_hi;  // Q6_K: a row's sub-scale in both int16 of its lane
    __m256i subs;            // Q6_K: (sub_lo, sub_hi) as the two int16 of a row's lane
  };

  template <int T>
  __attribute__((always_inline)) static void decode(const uint8_t* panel, int64_t b, int h,
                                                    Half& k) {
    const __m256i low4 = _mm256_set1_epi8(15);
    auto load = [h](const uint8_t* p) {  // this half's 32 bytes of a 64-byte register
      return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
    };
    auto halves8 = [h](const uint8_t* p) {  // this half's 8 fp16 as floats
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
    };
    auto bytes8 = [h](const uint8_t* p) {  // this half's 8 bytes as int32 (zero-extended)
      return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
    };
    auto nibbles = [&](const uint8_t* p) {  // 4 registers -> chunks c and c + 4
      for (int c = 0; c < 4; c++) {
        const __m256i v = load(p + 64 * c);
        k.chunk[c] = _mm256_and_si256(v, low4);
        k.chunk[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      }
    };
    auto fifth_bits = [&](const uint8_t* p) {  // a fifth-bit register into the chunks' bit 4
      const __m256i fifth = load(p), bit4 = _mm256_set1_epi8(16);
      const __m256i moved[8] = {  // bit c of each byte to bit 4
          _mm256_slli_epi16(fifth, 4), _mm256_slli_epi16(fifth, 3), _mm256_slli_epi16(fifth, 2),
          _mm256_slli_epi16(fifth, 1), fifth, _mm256_srli_epi16(fifth, 1),
          _mm256_srli_epi16(fifth, 2), _mm256_srli_epi16(fifth, 3)};
      for (int c = 0; c < 8; c++)
        k.chunk[c] = _mm256_or_si256(k.chunk[c], _mm256_and_si256(moved[c], bit4));
    };
    const int64_t j = b % GROUP;
    const uint8_t* o = panel + b / (panel_block_size(T) / QK) * panel_block_bytes(T);
    k.scale = halves8(o);
    if constexpr (T == Q4_0) {
      nibbles(o + 32);
    } else if constexpr (T == Q4_1) {
      nibbles(o + 64);
      k.minimum = halves8(o + 32);
    } else if constexpr (T == Q4_K || T == Q5_K) {
      const uint8_t* p = o + 320 + (T == Q4_K ? 256 : 320) * j;
      nibbles(p);
      if constexpr (T == Q5_K) fifth_bits(p + 256);
      k.scale = _mm256_mul_ps(k.scale, _mm256_cvtepi32_ps(bytes8(o + 64 + 16 * j)));
      const __m256 m =
          _mm256_mul_ps(halves8(o + 32), _mm256_cvtepi32_ps(bytes8(o + 192 + 16 * j)));
      k.minimum = _mm256_xor_ps(m, _mm256_set1_ps(-0.0f));  // -(dmin * m), as group.h's
    } else if constexpr (T == Q6_K) {
      const uint8_t* p = o + 288 + 384 * j;
      nibbles(p);
      const __m256i bits45 = _mm256_set1_epi8(0x30);
      for (int half = 0; half < 2; half++) {  // the top bits of chunk 4 half + t sit at 2t
        const __m256i high = load(p + 256 + 64 * half);
        const __m256i top[4] = {_mm256_slli_epi16(high, 4), _mm256_slli_epi16(high, 2), high,
                                _mm256_srli_epi16(high, 2)};
        for (int t = 0; t < 4; t++)
          k.chunk[4 * half + t] =
              _mm256_or_si256(k.chunk[4 * half + t], _mm256_and_si256(top[t], bits45));
      }
      auto sub32 = [h](const uint8_t* p) {  // this half's 8 int8 sub-scales as int32
        return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * h)));
      };
      const __m256i lo = sub32(o + 32 + 16 * (2 * j)), hi = sub32(o + 32 + 16 * (2 * j + 1));
      const __m256i low16 = _mm256_set1_epi32(0xffff);
      k.sub_lo = _mm256_or_si256(_mm256_and_si256(lo, low16), _mm256_slli_epi32(lo, 16));
      k.sub_hi = _mm256_or_si256(_mm256_and_si256(hi, low16), _mm256_slli_epi32(hi, 16));
      k.subs = _mm256_or_si256(_mm256_and_si256(lo, low16), _mm256_slli_epi32(hi, 16));
    } else if constexpr (T == Q5_0) {
      nibbles(o + 32);
      fifth_bits(o + 288);
    } else {  // Q8_0: u - 128 is the code
      for (int c = 0; c < 8; c++) {
        k.sign[c] = _mm256_xor_si256(load(o + 32 + 64 * c), _mm256_set1_epi8(-128));
        k.chunk[c] = _mm256_abs_epi8(k.sign[c]);
      }
    }
  }

  // I_b (panels.h) of one block for the 8 weight rows of half k and one activation row: q the
  // activation row's 32 codes of the block, b16 their two sums of 16.
  template <int T>
  __attribute__((always_inline)) static __m256i integer(const Half& k, const int8_t* q,
                                                        const int32_t* b16) {
    const __m256i ones = _mm256_set1_epi16(1);
    auto products = [&](int c) {  // chunk c times activation bytes 4c .. 4c + 3: int16 pairs
      int32_t v;
      std::memcpy(&v, q + 4 * c, 4);
      const __m256i xq = _mm256_set1_epi32(v);
      if constexpr (T == Q8_0)
        return _mm256_maddubs_epi16(k.chunk[c], _mm256_sign_epi8(xq, k.sign[c]));
      return _mm256_maddubs_epi16(k.chunk[c], xq);
    };
    if constexpr (T == Q8_0) {  // one chunk per int16 sum
      __m256i sum[2] = {_mm256_madd_epi16(products(0), ones),
                        _mm256_madd_epi16(products(1), ones)};
      for (int c = 2; c < 8; c++)
        sum[c % 2] = _mm256_add_epi32(sum[c % 2], _mm256_madd_epi16(products(c), ones));
      return _mm256_add_epi32(sum[0], sum[1]);
    } else if constexpr (T == Q6_K) {  // two chunks per int16 sum, each half its sub-scale
      auto pair = [&](int c, __m256i sub) {
        return _mm256_madd_epi16(_mm256_add_epi16(products(c), products(c + 1)), sub);
      };
      const __m256i first = _mm256_add_epi32(pair(0, k.sub_lo), pair(2, k.sub_lo));
      const __m256i second = _mm256_add_epi32(pair(4, k.sub_hi), pair(6, k.sub_hi));
      // the offset's part, 32 * (sub_lo * b16[0] + sub_hi * b16[1]), by one VPMADDWD: both
      // activation sums fit an int16 (|b16| <= 16 * 127)
      const int32_t b16_pair = int32_t((uint32_t(b16[0]) & 0xffff) | uint32_t(b16[1]) << 16);
      const __m256i offset =
          _mm256_slli_epi32(_mm256_madd_epi16(k.subs, _mm256_set1_epi32(b16_pair)), 5);
      return _mm256_sub_epi32(_mm256_add_epi32(first, second), offset);
    } else {
      constexpr int kPerSum = T == Q5_0 || T == Q5_K ? 4 : 8;  // chunks one int16 sum holds
      __m256i lanes = _mm256_set1_epi32(-kPanelOffset<T> * (b16[0] + b16[1]));
      for (int first = 0; first < 8; first += kPerSum) {
        __m256i pairs[4];
        for (int i = 0; i < kPerSum / 2; i++)
          pairs[i] = _mm256_add_epi16(products(first + i), products(first + kPerSum / 2 + i));
        for (int n = kPerSum / 4; n > 0; n /= 2)
          for (int i = 0; i < n; i++) pairs[i] = _mm256_add_epi16(pairs[i], pairs[i + n]);
        lanes = _mm256_add_epi32(lanes, _mm256_madd_epi16(pairs[0], ones));
      }
      return lanes;
    }
  }

  template <int T, int kRows>
  static void tile(const uint8_t* panel, int64_t K, const Activations& x, const PanelSums& sums,
                   int64_t r0, int64_t rows, float* out, int64_t ldy) {
    if constexpr (kRows > 0) rows = kRows;
    constexpr int kTile = kRows > 0 ? kRows : MAX_TILE;
    constexpr bool kMins = kPanelMins<T>;
    const int64_t nblocks = K / QK, blocks_per_row = x.padded / QK;
    const int64_t halves_per_row = x.padded / 16;
    __m256 acc[kTile][2], mac[kTile][2];
    for (int64_t t = 0; t < rows; t++)
      acc[t][0] = acc[t][1] = mac[t][0] = mac[t][1] = _mm256_setzero_ps();
    constexpr int64_t kBlockShare = panel_block_bytes(T) * QK / panel_block_size(T);
    const int64_t far = prefetch_far();
    for (int64_t b = 0; b < nblocks; b++) {
      const char* ahead = reinterpret_cast<const char*>(panel) + (b + kAhead) * kBlockShare;
      for (int64_t line = 0; line < kBlockShare; line += 64)
        _mm_prefetch(ahead + line, _MM_HINT_T0);
      prefetch_far_block(panel, (b + far) * kBlockShare, kBlockShare);
      for (int h = 0; h < 2; h++) {
        // 1. half h's codes and factors, once for all rows
        Half k;
        decode<T>(panel, b, h, k);
        // 2. each row's products over it
        for (int64_t t = 0; t < rows; t++) {
          const int64_t r = r0 + t;
          const __m256i lanes =
              integer<T>(k, x.row_codes(r) + QK * b, sums.b16 + r * halves_per_row + 2 * b);
          const __m256 factor = _mm256_mul_ps(k.scale, _mm256_set1_ps(x.row_scales(r)[b]));
          acc[t][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), factor, acc[t][h]);
          if constexpr (kMins)
            mac[t][h] = _mm256_fmadd_ps(
                k.minimum, _mm256_set1_ps(sums.s32[r * blocks_per_row + b]), mac[t][h]);
        }
      }
    }
    for (int64_t t = 0; t < rows; t++)
      for (int h = 0; h < 2; h++)
        _mm256_storeu_ps(out + t * ldy + 8 * h,
                         kMins ? _mm256_add_ps(acc[t][h], mac[t][h]) : acc[t][h]);
  }
};

}  // namespace vq
