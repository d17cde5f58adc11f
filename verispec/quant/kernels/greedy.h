// A greedy draft step's choice and how sure the draft is of it: over a row of logits, the first
// index of the largest and its softmax probability 1 / sum_j e^(x_j - max) (ChainCut in
// drafters/model.py stops a chain on the product of these). In C++ because the row arrives
// from the pass with half its lines in the other core's cache: torch's argmax and logsumexp
// read it a line at a time and wake torch's thread pool, ~0.4 ms a 65,536-logit draft row on
// the 2-core Xeon, where this reads it once with prefetches and once from L2.

#pragma once

#include "vector.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>

namespace vq {

// (index, probability) over x[0 .. n): a NaN anywhere gives the first NaN's index and a NaN
// probability, as torch's argmax and max do; n == 0 gives (-1, NaN).
inline std::pair<int64_t, float> greedy_top(const float* x, int64_t n) {
  constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
  if (n == 0) return {-1, kNaN};
  // 1. the largest value, 16 lanes at a time, and whether any value is NaN
  const int64_t whole = n / LANES * LANES;
  Floats largest = splat(-std::numeric_limits<float>::infinity());
  Ints nan = Ints{};
  for (int64_t i = 0; i < whole; i += LANES) {
    __builtin_prefetch(x + i + 32 * LANES);
    const Floats v = load_lanes(x + i);
    nan = nan | (v != v);
    largest = v > largest ? v : largest;
  }
  float top = lane_max(largest);
  bool any_nan = false;
  for (int l = 0; l < LANES; l++) any_nan = any_nan || nan[l] != 0;
  for (int64_t i = whole; i < n; i++) {
    any_nan = any_nan || x[i] != x[i];
    top = x[i] > top ? x[i] : top;
  }
  if (any_nan) {
    for (int64_t i = 0; i < n; i++)
      if (x[i] != x[i]) return {i, kNaN};
  }
  // 2. its first index
  int64_t index = 0;
  while (x[index] != top) index++;
  // 3. sum_j e^(x_j - max), lane by lane then folded (every term <= 1, the top's exactly 1)
  Floats total = Floats{};
  for (int64_t i = 0; i < whole; i += LANES) total = total + exp_lanes(load_lanes(x + i) - top);
  float sum = lane_sum(total);
  for (int64_t i = whole; i < n; i++) sum += std::exp(x[i] - top);
  return {index, 1.0f / sum};
}

}  // namespace vq
