// Activations quantised for the integer products, one row at a time (so a row's codes never
// depend on the other rows of the pass: the root of batch invariance), in blocks of 32 as
// llama.cpp's Q8_0 activations: d = max|x| / 127, q = round(x / d) (ties to even) in int8.
// Beside them, per 16 elements, s = d * sum(q): weights with an additive part (Q4_1's m,
// Q4_K's -dmin * m, the -8 of Q4_0's codes) contribute that part times s.
//
// Rows are padded with zeros to a multiple of 256 elements, so every kernel reads whole
// 8-block groups (a zero block adds exactly zero to a row's sums).

#pragma once

#include "formats.h"
#include "vector.h"

#include <cmath>

namespace vq {

inline int64_t padded_length(int64_t K) { return (K + QK_K - 1) / QK_K * QK_K; }

struct Activations {  // views of one pass's quantised rows; the caller owns the storage
  const int8_t* codes;   // [rows, padded]
  const float* scales;   // [rows, padded / 32]: d of each block
  const float* sums;     // [rows, padded / 16]: d * sum(q) of each 16 elements
  int64_t padded;        // elements per row, K rounded up to 256

  const int8_t* row_codes(int64_t r) const { return codes + r * padded; }
  const float* row_scales(int64_t r) const { return scales + r * (padded / QK); }
  const float* row_sums(int64_t r) const { return sums + r * (padded / 16); }
};

// One block of `count` (<= 32) values, element by element: its codes (zeros past count), the
// sums of its two halves' codes, and its scale d. The definition the 16-lane version keeps.
inline float quantize_block_scalar(const float* x, int64_t count, int8_t* codes,
                                   int32_t half_sums[2]) {
  // 1. the block's largest magnitude, and its scale
  float amax = 0.0f;
  for (int64_t i = 0; i < count; i++) {
    const float a = std::fabs(x[i]);
    amax = (a > amax || a != a) ? a : amax;  // a NaN stays: the row's outputs turn NaN
  }
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  // 2. codes, and their sums per half block
  half_sums[0] = half_sums[1] = 0;
  for (int64_t i = 0; i < QK; i++) {
    float v = i < count ? std::nearbyint(x[i] * inverse) : 0.0f;
    v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : (v == v ? v : 0.0f));
    codes[i] = int8_t(v);
    half_sums[i / 16] += int32_t(v);
  }
  return d;
}

// A whole block (32 values) in two 16-lane vectors, the same bits as quantize_block_scalar:
// the largest magnitude is the same in any order (a NaN wins either way: of a block's several
// NaNs another one's payload may be kept, and the row's outputs are NaN all the same), and
// x / d rounds half to even through the 1.5 * 2^23 shifter as nearbyint does in the default
// rounding mode (exact for |v| < 2^22, and |x / d| <= 127 here unless 1 / d overflows, where
// both give +-inf or NaN, which the clamp turns into +-127 or 0).
inline float quantize_block_lanes(const float* x, int8_t* codes, int32_t half_sums[2]) {
  typedef int8_t Bytes __attribute__((vector_size(16)));
  const auto magnitude = [](Floats v) {
    Ints bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits = bits & 0x7fffffff;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  };
  // 1. the block's largest magnitude, and its scale
  const Floats low = load_lanes(x), high = load_lanes(x + LANES);
  const Floats a = magnitude(low), b = magnitude(high);
  // folded by halves in registers (fold_lanes): a maximum is exact in any order, and a NaN
  // anywhere wins every step it meets
  const auto larger = [](Floats u, Floats v) { return (u > v || u != u) ? u : v; };
  const float amax = fold_lanes(larger(a, b), larger);  // >= 0 (magnitudes), or NaN
  const float d = amax / 127.0f;
  const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
  // 2. codes, and their sums per half block
  const Floats shifter = splat(12582912.0f);
  for (int half = 0; half < 2; half++) {
    Floats v = ((half ? high : low) * inverse + shifter) - shifter;
    v = v > 127.0f ? splat(127.0f) : (v < -127.0f ? splat(-127.0f) : (v == v ? v : splat(0.0f)));
    const Ints q = __builtin_convertvector(v, Ints);
    const Bytes bytes = __builtin_convertvector(q, Bytes);
    std::memcpy(codes + LANES * half, &bytes, sizeof bytes);
    half_sums[half] = fold_lanes(q, [](Ints x, Ints y) { return x + y; });  // exact in any order
  }
  return d;
}

// x[0 .. K) into codes[0 .. padded), scales[0 .. padded / 32), sums[0 .. padded / 16); with
// b16 and s32, panels.h's panel_sums too (the same values, from the same pass). Each block is
// quantised alone, so blocks first_block..last_block-1 (all of them by default) may be done
// apart, by another thread, with the same bits.
inline void quantize_row(const float* x, int64_t K, int64_t padded, int8_t* codes, float* scales,
                         float* sums, int32_t* b16 = nullptr, float* s32 = nullptr,
                         int64_t first_block = 0, int64_t last_block = -1) {
  if (last_block < 0) last_block = padded / QK;
  for (int64_t b = first_block; b < last_block; b++) {
    const int64_t first = b * QK, count = first >= K ? 0 : (K - first < QK ? K - first : QK);
    int32_t half_sums[2] = {0, 0};
    float d = 0.0f;  // a block past K (the padding): zero codes, scale and sums, as the scalar
                     // definition gives them, without its element loop
    if (count == QK)
      d = quantize_block_lanes(x + first, codes + first, half_sums);
    else if (count > 0)
      d = quantize_block_scalar(x + first, count, codes + first, half_sums);
    else
      std::memset(codes + first, 0, QK);
    scales[b] = d;
    sums[2 * b] = d * float(half_sums[0]);
    sums[2 * b + 1] = d * float(half_sums[1]);
    if (b16 != nullptr) {
      b16[2 * b] = half_sums[0];
      b16[2 * b + 1] = half_sums[1];
      s32[b] = d * float(half_sums[0] + half_sums[1]);
    }
  }
}

}  // namespace vq
