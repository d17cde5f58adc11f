// The order of a quantised row product, and the portable (plain C++) kernel that follows it.
//
// For activation row r and weight row n, over the row's 32-element blocks b in order:
//     lane l (0..7) of block b: L = sub * sum of code * q_x over elements 4l .. 4l+3 (exact int)
//     acc[b % 2][l] = fma(float(L), scale_b * d_x[b], acc[b % 2][l])
// and per group g of 8 blocks, for the 16 half blocks h (two sets of 8 lanes):
//     mins[h / 8][h % 8] = fma(min_h, s_x[16 g + h], mins[h / 8][h % 8])
// then y = hsum8(acc[0] + acc[1]) + hsum8(mins[0] + mins[1]), hsum8 as below. The eight lanes
// are those of an AVX2 register after VPMADDUBSW / VPMADDWD; two accumulators per lane set
// halve the chain of dependent FMAs one row waits on. Nothing here depends on the other rows,
// the row count or the thread: a row's output is the same bits alone or among 40 rows, and the
// same on the AVX2 and portable paths (the AVX2 kernel runs these very operations).

#pragma once

#include "activations.h"
#include "group.h"

#include <cmath>

namespace vq {

constexpr int64_t MAX_TILE = 16;  // activation rows that share one pass over a weight row

struct RowSums {  // one output's running sums (dot.h's order)
  float acc[2][8];
  float mins[2][8];
};

// ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)): an AVX2 register's halves added, then
// its quarters, then its last pair.
inline float hsum8(const float* v) {
  const float t0 = v[0] + v[4], t1 = v[1] + v[5], t2 = v[2] + v[6], t3 = v[3] + v[7];
  return (t0 + t2) + (t1 + t3);
}

template <int T>
inline float finish(const RowSums& s) {
  float lanes[8];
  for (int l = 0; l < 8; l++) lanes[l] = s.acc[0][l] + s.acc[1][l];
  float y = hsum8(lanes);
  if constexpr (Traits<T>::kMins) {
    for (int l = 0; l < 8; l++) lanes[l] = s.mins[0][l] + s.mins[1][l];
    y = y + hsum8(lanes);
  }
  return y;
}

struct PortableKernel {
  static constexpr const char* kName = "scalar";

  // out[t * ldy] = activation row (r0 + t) . weight row `row` for t < rows (<= MAX_TILE).
  template <int T>
  static void rows(const uint8_t* row, int64_t K, const Activations& x, int64_t r0, int64_t rows,
                   float* out, int64_t ldy) {
    const int64_t nblocks = K / QK, groups = (nblocks + GROUP - 1) / GROUP;
    RowSums sums[MAX_TILE] = {};
    for (int64_t g = 0; g < groups; g++) {
      // 1. decode the group once for all rows
      GroupParams p;
      group_params<T>(row, g, nblocks, load_half, p);
      uint8_t codes[GROUP][QK] = {};  // blocks past a row's end stay zero: they add 0 * 0
      for (int j = 0; j < p.blocks; j++) block_codes<T>(row, g, j, codes[j]);
      // 2. each row's products over it
      for (int64_t t = 0; t < rows; t++) {
        const int8_t* q = x.row_codes(r0 + t) + g * QK_K;
        const float* d = x.row_scales(r0 + t) + g * GROUP;
        RowSums& s = sums[t];
        for (int j = 0; j < GROUP; j++) {
          const float scale = p.scale[j] * d[j];
          for (int l = 0; l < 8; l++) {
            int lane = 0;
            for (int i = 4 * l; i < 4 * l + 4; i++) {
              const int w = Traits<T>::kSigned ? int(int8_t(codes[j][i])) : int(codes[j][i]);
              lane += w * int(q[QK * j + i]);
            }
            lane *= p.sub[j][l / 4];
            s.acc[j % 2][l] = std::fma(float(lane), scale, s.acc[j % 2][l]);
          }
        }
        if constexpr (Traits<T>::kMins) {
          const float* sx = x.row_sums(r0 + t) + g * 16;
          for (int l = 0; l < 8; l++) {
            s.mins[0][l] = std::fma(p.min[l], sx[l], s.mins[0][l]);
            s.mins[1][l] = std::fma(p.min[8 + l], sx[8 + l], s.mins[1][l]);
          }
        }
      }
    }
    for (int64_t t = 0; t < rows; t++) out[t * ldy] = finish<T>(sums[t]);
  }
};

}  // namespace vq
