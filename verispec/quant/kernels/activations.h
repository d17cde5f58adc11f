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

// x[0 .. K) into codes[0 .. padded), scales[0 .. padded / 32), sums[0 .. padded / 16).
inline void quantize_row(const float* x, int64_t K, int64_t padded, int8_t* codes, float* scales,
                         float* sums) {
  for (int64_t b = 0; b < padded / QK; b++) {
    // 1. the block's largest magnitude, and its scale
    float amax = 0.0f;
    const int64_t first = b * QK, count = first >= K ? 0 : (K - first < QK ? K - first : QK);
    for (int64_t i = 0; i < count; i++) {
      const float a = std::fabs(x[first + i]);
      amax = (a > amax || a != a) ? a : amax;  // a NaN stays: the row's outputs turn NaN
    }
    const float d = amax / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    // 2. codes, and their sums per half block
    int half_sums[2] = {0, 0};
    for (int64_t i = 0; i < QK; i++) {
      float v = i < count ? std::nearbyint(x[first + i] * inverse) : 0.0f;
      v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : (v == v ? v : 0.0f));
      codes[first + i] = int8_t(v);
      half_sums[i / 16] += int(v);
    }
    scales[b] = d;
    sums[2 * b] = d * float(half_sums[0]);
    sums[2 * b + 1] = d * float(half_sums[1]);
  }
}

}  // namespace vq
