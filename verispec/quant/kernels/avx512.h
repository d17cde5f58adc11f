// The AVX512-VNNI kernel (AVX-512 F/BW/VL and VNNI beside AVX2, FMA and F16C: AMD Zen 4 and
// later, Intel Ice Lake and later): dot.h's order, two blocks to a 512-bit register.
//
// A register holds blocks 2i (low half) and 2i + 1 (high half) of a group, so its low half
// plays dot.h's acc[0] and its high half acc[1], with the same FMAs in the same order. Per pair
// of blocks and activation row:
//     VPDPBUSD  (unsigned codes x int8 activations, four adjacent products into one int32 lane:
//                exactly dot.h's lane; no saturation, |4 * 63 * 127| < 2^31)
//     VCVTDQ2PS (exact: |lane| < 2^24); Q6_K: VMULPS by the lane's sub-scale, exact too
//                (|lane * sub| <= 4 * 63 * 127 * 128 < 2^24), so it is float(sub * lane)
//     VFMADD    by scale_j * d_x[j], the same product the AVX2 path forms.
// One instruction does what VPMADDUBSW + VPMADDWD do on AVX2, on twice the width: a row's
// share of a pass costs about a third of the AVX2 path's, which is what lets a verification
// pass over several positions stay close to one token's pass. Q8_0's signed codes go through
// the sign trick: |code| x (q_x negated where the code is negative).

#pragma once

#include "avx2.h"
#include "panels.h"

namespace vq {

// The codes of blocks 2i and 2i + 1 of group g in pairs[i] (i < 4; zeros past `blocks`), the
// codes group.h's block_codes gives.
template <int T>
inline void decode_pairs(const uint8_t* row, int64_t g, int blocks, __m512i* pairs) {
  const __m512i low4 = _mm512_set1_epi8(15);
  auto load32 = [](const uint8_t* p) {  // 32 bytes into both halves
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  if constexpr (T == Q4_K || T == Q5_K) {
    // 32 bytes of nibbles per pair: block 2i in the low nibbles, 2i + 1 in the high
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    const uint8_t* nibbles = p + (T == Q4_K ? 16 : 48);
    const __m512i high_half = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    for (int i = 0; i < 4; i++)
      pairs[i] = _mm512_and_si512(_mm512_srlv_epi64(load32(nibbles + 32 * i), high_half), low4);
    if constexpr (T == Q5_K) {  // bit j of byte e: block j's fifth bit of element e, to bit 4
      const __m512i fifth = load32(p + 16), bit4 = _mm512_set1_epi8(16);
      for (int i = 0; i < 4; i++) {
        const int lo = (4 - 2 * i) & 63, hi = (3 - 2 * i) & 63;  // rotations by 4 - j mod 64
        const __m512i turn = _mm512_set_epi64(hi, hi, hi, hi, lo, lo, lo, lo);
        pairs[i] = _mm512_or_si512(pairs[i],
                                   _mm512_and_si512(_mm512_rolv_epi64(fifth, turn), bit4));
      }
    }
  } else if constexpr (T == Q6_K) {
    // half h: blocks 4h + k take low nibbles from 64 h + 32 (k % 2) >> 4 (k / 2) and their
    // two high bits from 128 + 32 h >> 2k; pair 2h is k = 0, 1, pair 2h + 1 is k = 2, 3
    const uint8_t* p = row + g * Traits<T>::kBlockBytes;
    const __m512i bits45 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
    const __m512i down = _mm512_set_epi64(2, 2, 2, 2, 0, 0, 0, 0);
    for (int h = 0; h < 2; h++) {
      const __m512i lo = _mm512_loadu_si512(p + 64 * h), hi = load32(p + 128 + 32 * h);
      pairs[2 * h] = _mm512_or_si512(_mm512_and_si512(lo, low4),
                                     _mm512_and_si512(_mm512_sllv_epi64(hi, up), bits45));
      pairs[2 * h + 1] = _mm512_or_si512(
          _mm512_and_si512(_mm512_srli_epi64(lo, 4), low4),
          _mm512_and_si512(_mm512_srlv_epi64(hi, down), bits45));
    }
  } else {  // 32-element types: each block has its own header; AVX2's decoding, paired
    __m256i codes[GROUP];
    decode_codes<T>(row, g, blocks, codes);
    for (int i = 0; i < 4; i++)
      pairs[i] = _mm512_inserti64x4(_mm512_castsi256_si512(codes[2 * i]), codes[2 * i + 1], 1);
  }
}

inline __m512 join(__m256 low, __m256 high) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)),
                                             _mm256_castps_pd(high), 1));
}

struct Avx512Kernel {
  static constexpr const char* kName = "avx512";

  template <int T>
  static void rows(const uint8_t* row, int64_t K, const Activations& x, int64_t r0, int64_t rows,
                   float* out, int64_t ldy) {
    switch (rows) {  // a fixed count lets the compiler keep a tile's sums in registers
      case 1: return tile<T, 1>(row, K, x, r0, rows, out, ldy);
      case 2: return tile<T, 2>(row, K, x, r0, rows, out, ldy);
      case 3: return tile<T, 3>(row, K, x, r0, rows, out, ldy);
      case 4: return tile<T, 4>(row, K, x, r0, rows, out, ldy);
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
    __m512 acc[kTile], mins[kTile];
    for (int64_t t = 0; t < rows; t++) acc[t] = mins[t] = _mm512_setzero_ps();
    // lane l of pair i takes block 2i + l / 8's factor, and (Q6_K) half 4i + l / 4's sub-scale
    __m512i block_of[4], half_of[4];
    for (int i = 0; i < 4; i++) {
      block_of[i] = _mm512_set_epi32(2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                     2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i, 2 * i, 2 * i, 2 * i,
                                     2 * i, 2 * i, 2 * i, 2 * i);
      half_of[i] = _mm512_set_epi32(4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 3, 4 * i + 2,
                                    4 * i + 2, 4 * i + 2, 4 * i + 2, 4 * i + 1, 4 * i + 1,
                                    4 * i + 1, 4 * i + 1, 4 * i, 4 * i, 4 * i, 4 * i);
    }
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t g = 0; g < groups; g++) {
      // 1. decode the group once for all rows: codes, float parameters, sub-scales
      GroupVectors v;
      group_vectors<T>(row, g, nblocks, v);
      __m512i codes[4];
      decode_pairs<T>(row, g, int(nblocks - g * GROUP), codes);
      const __m512 group_mins = join(v.min_lo, v.min_hi);
      __m512 sub[4];
      if constexpr (Traits<T>::kSubScales) {
        const uint8_t* scales = row + g * Traits<T>::kBlockBytes + 192;
        const __m512 all = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))));
        for (int i = 0; i < 4; i++) sub[i] = _mm512_permutexvar_ps(half_of[i], all);
      }
      __mmask64 negative[4];
      if constexpr (Traits<T>::kSigned)
        for (int i = 0; i < 4; i++) {
          negative[i] = _mm512_movepi8_mask(codes[i]);
          codes[i] = _mm512_abs_epi8(codes[i]);
        }
      // 2. each row's products over it
      for (int64_t t = 0; t < rows; t++) {
        const int8_t* q = x.row_codes(r0 + t) + g * QK_K;
        const __m512 products = _mm512_castps256_ps512(_mm256_mul_ps(
            v.scale, _mm256_loadu_ps(x.row_scales(r0 + t) + g * GROUP)));  // scale_j * d_x[j]
        __m512 a = acc[t];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
          __m512i xq = _mm512_loadu_si512(q + 2 * QK * i);
          if constexpr (Traits<T>::kSigned) xq = _mm512_mask_sub_epi8(xq, negative[i], zero, xq);
          __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, codes[i], xq));
          if constexpr (Traits<T>::kSubScales) lanes = _mm512_mul_ps(lanes, sub[i]);
          a = _mm512_fmadd_ps(lanes, _mm512_permutexvar_ps(block_of[i], products), a);
        }
        acc[t] = a;
        if constexpr (Traits<T>::kMins)
          mins[t] = _mm512_fmadd_ps(group_mins, _mm512_loadu_ps(x.row_sums(r0 + t) + g * 16),
                                    mins[t]);
      }
    }
    for (int64_t t = 0; t < rows; t++) {
      RowSums s;  // acc[0] then acc[1]: the register's halves, in memory order
      _mm512_storeu_ps(&s.acc[0][0], acc[t]);
      _mm512_storeu_ps(&s.mins[0][0], mins[t]);
      out[t * ldy] = finish<T>(s);
    }
  }
};

// The panel order (panels.h) on 16 outputs at once: VPDPBUSD multiplies a register of 16 rows'
// codes by 4 activation bytes broadcast from memory, so each int32 lane is one output's sum and
// the float work (one conversion, one product, one or two FMAs per block) is shared by 16
// outputs. Per block and activation row: 8 VPDPBUSD (two integer accumulators), 1 add, 1
// conversion, 1 multiply, 1 or 2 FMAs; the codes are decoded once for all rows of the tile.
struct PanelKernel {
  // out[t * ldy + 0 .. 15] for activation rows r0 + t, t < rows <= PANEL_TILE (module.cpp; any
  // count up to MAX_TILE works, those past PANEL_TILE with their sums in memory).
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

  // Blocks fetched ahead of the one multiplied: 8 with several rows; 4 for a lone row, whose
  // blocks go by faster (on an Intel Xeon 8 ahead left a one-token step of Qwen2.5-1.5B as slow
  // as no prefetch, 56.5 ms, where 3-4 ahead took 47.5 ms; with 4 and 9 rows 4-64 measure alike).
  static constexpr int64_t kAhead = 8, kLoneAhead = 4;

  // One block's codes and factors for 16 rows, decoded once for every activation row.
  struct Block {
    __m512i chunk[8];        // chunk c: the codes of elements 4c .. 4c + 3 (u8, 16 rows)
    __m512 scale, minimum;   // scale_b, min_b per row
    __m512i sub_lo, sub_hi;  // Q6_K: the halves' int32 sub-scales
  };

  template <int T>
  static void decode(const uint8_t* panel, int64_t b, Block& k) {
    const __m512i low4 = _mm512_set1_epi8(15);
    auto bytes16 = [](const uint8_t* p) {
      return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    };
    auto halves16 = [](const uint8_t* p) {  // 16 fp16 as floats
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    };
    auto nibbles = [&](const uint8_t* p) {  // 4 registers -> chunks c and c + 4
      for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512(p + 64 * c);
        k.chunk[c] = _mm512_and_si512(v, low4);
        k.chunk[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
    };
    auto fifth_bits = [&](const uint8_t* p) {  // a fifth-bit register into the chunks' bit 4
      const __m512i fifth = _mm512_loadu_si512(p), bit4 = _mm512_set1_epi8(16);
      const __m512i moved[8] = {  // bit c of each byte to bit 4
          _mm512_slli_epi16(fifth, 4), _mm512_slli_epi16(fifth, 3), _mm512_slli_epi16(fifth, 2),
          _mm512_slli_epi16(fifth, 1), fifth, _mm512_srli_epi16(fifth, 1),
          _mm512_srli_epi16(fifth, 2), _mm512_srli_epi16(fifth, 3)};
      for (int c = 0; c < 8; c++)
        k.chunk[c] = _mm512_or_si512(k.chunk[c], _mm512_and_si512(moved[c], bit4));
    };
    const int64_t j = b % GROUP;
    const uint8_t* o = panel + b / (panel_block_size(T) / QK) * panel_block_bytes(T);
    k.scale = halves16(o);
    if constexpr (T == Q4_0) {
      nibbles(o + 32);
    } else if constexpr (T == Q4_1) {
      nibbles(o + 64);
      k.minimum = halves16(o + 32);
    } else if constexpr (T == Q4_K || T == Q5_K) {
      const uint8_t* p = o + 320 + (T == Q4_K ? 256 : 320) * j;
      nibbles(p);
      if constexpr (T == Q5_K) fifth_bits(p + 256);
      k.scale = _mm512_mul_ps(
          k.scale, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(o + 64 + 16 * j))));
      const __m512 m = _mm512_mul_ps(
          halves16(o + 32), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes16(o + 192 + 16 * j))));
      k.minimum = _mm512_castsi512_ps(  // -(dmin * m), the sign flipped as group.h's
          _mm512_xor_si512(_mm512_castps_si512(m), _mm512_set1_epi32(INT32_MIN)));
    } else if constexpr (T == Q6_K) {
      const uint8_t* p = o + 288 + 384 * j;
      nibbles(p);
      const __m512i bits45 = _mm512_set1_epi8(0x30);
      for (int h = 0; h < 2; h++) {  // the top bits of chunk 4h + t sit at 2t in register h
        const __m512i high = _mm512_loadu_si512(p + 256 + 64 * h);
        const __m512i top[4] = {_mm512_slli_epi16(high, 4), _mm512_slli_epi16(high, 2), high,
                                _mm512_srli_epi16(high, 2)};
        for (int t = 0; t < 4; t++)
          k.chunk[4 * h + t] =
              _mm512_or_si512(k.chunk[4 * h + t], _mm512_and_si512(top[t], bits45));
      }
      k.sub_lo = _mm512_cvtepi8_epi32(bytes16(o + 32 + 16 * (2 * j)));
      k.sub_hi = _mm512_cvtepi8_epi32(bytes16(o + 32 + 16 * (2 * j + 1)));
    } else if constexpr (T == Q5_0) {
      nibbles(o + 32);
      fifth_bits(o + 288);
    } else {  // Q8_0
      for (int c = 0; c < 8; c++) k.chunk[c] = _mm512_loadu_si512(o + 32 + 64 * c);
    }
  }

  template <int T, int kRows>
  static void tile(const uint8_t* panel, int64_t K, const Activations& x, const PanelSums& sums,
                   int64_t r0, int64_t rows, float* out, int64_t ldy) {
    if constexpr (kRows > 0) rows = kRows;
    constexpr int kTile = kRows > 0 ? kRows : MAX_TILE;
    constexpr bool kMins = kPanelMins<T>;
    const int64_t nblocks = K / QK, blocks_per_row = x.padded / QK;
    __m512 acc[kTile], mac[kTile];
    for (int64_t t = 0; t < rows; t++) acc[t] = mac[t] = _mm512_setzero_ps();
    // a block's share of the panel's bytes, to fetch ahead: with several rows a block's
    // products outlast the hardware prefetcher's reach, and every block would wait on memory
    constexpr int64_t kBlockShare = panel_block_bytes(T) * QK / panel_block_size(T);
    const int64_t near = rows > 1 ? kAhead : kLoneAhead, far = prefetch_far();
    for (int64_t b = 0; b < nblocks; b++) {
      const char* ahead = reinterpret_cast<const char*>(panel) + (b + near) * kBlockShare;
      // (a lone row may keep pace with the hardware prefetcher: prefetch_lone_row, panels.h)
      if (rows > 1 || prefetch_lone_row())
        for (int64_t line = 0; line < kBlockShare; line += 64)
          _mm_prefetch(ahead + line, _MM_HINT_T0);
      prefetch_far_block(panel, (b + far) * kBlockShare, kBlockShare);
      // 1. the block's codes and factors, once for all rows
      Block k;
      decode<T>(panel, b, k);
      // 2. each row's products over it; integer sums start at -offset * (sum of the codes q)
      for (int64_t t = 0; t < rows; t++) {
        const int64_t r = r0 + t;
        const int8_t* q = x.row_codes(r) + QK * b;
        auto at = [q](int c) {  // activation bytes 4c .. 4c + 3, in every lane
          int32_t v;
          std::memcpy(&v, q + 4 * c, 4);
          return _mm512_set1_epi32(v);
        };
        // chunks first .. first + 3 (one half of the block) from `start`; two such chains
        // halve the run of dependent VPDPBUSDs, and integer sums are exact in any grouping
        auto half = [&](int32_t start, int first) {
          __m512i sum = _mm512_set1_epi32(start);
          for (int c = first; c < first + 4; c++)
            sum = _mm512_dpbusd_epi32(sum, k.chunk[c], at(c));
          return sum;
        };
        const int32_t* b16 = sums.b16 + r * (x.padded / 16) + 2 * b;
        __m512i integer;
        if constexpr (T == Q6_K) {  // each half has its sub-scale
          integer = _mm512_add_epi32(_mm512_mullo_epi32(half(-32 * b16[0], 0), k.sub_lo),
                                     _mm512_mullo_epi32(half(-32 * b16[1], 4), k.sub_hi));
        } else {
          integer = _mm512_add_epi32(half(-kPanelOffset<T> * (b16[0] + b16[1]), 0), half(0, 4));
        }
        const __m512 factor = _mm512_mul_ps(k.scale, _mm512_set1_ps(x.row_scales(r)[b]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(integer), factor, acc[t]);
        if constexpr (kMins)
          mac[t] = _mm512_fmadd_ps(k.minimum, _mm512_set1_ps(sums.s32[r * blocks_per_row + b]),
                                   mac[t]);
      }
    }
    for (int64_t t = 0; t < rows; t++)
      _mm512_storeu_ps(out + t * ldy, kMins ? _mm512_add_ps(acc[t], mac[t]) : acc[t]);
  }
};

}  // namespace vq
