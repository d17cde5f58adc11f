// A greedy draft's choices. `greedy_top`: over a row of logits, the first index of the largest
// and its softmax probability 1 / sum_j e^(x_j - max) (ChainCut, drafters/drafter.py, stops a
// chain on the product of these). In C++ because the row arrives from the pass with half its
// lines in the other core's cache: torch's argmax and logsumexp read it a line at a time and
// wake torch's thread pool, ~0.4 ms a 65,536-logit draft row on the 2-core Xeon, where this
// reads it once with prefetches and once from L2. `greedy_chain`: a lone row's whole chain,
// step after step, in one call (the Python between two passes costs ~0.5 ms: a pass sweeps
// the caches, and every torch op after it runs cold).

#pragma once

#include "dequantize.h"
#include "forward.h"
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

// Where a chain stops, as ChainCut decides it (its keep_prices and more_prices for this
// call's steps: the chain's tokens len(prior), len(prior) + 1, ..; empty: never on
// confidence). P_j = p_0 .. p_j, the product of the draft's probabilities of its chain so far
// (`prior`: the P's of tokens drafted before this call).
struct ChainPrices {
  std::vector<double> keep_a, keep_b, more_a, more_b;
  std::vector<double> prior;
};

struct Chain {
  std::vector<int64_t> tokens;
  std::vector<double> cumulative;  // P_j of each token kept
  int64_t passes = 0;              // steps run (the last one's token may have been dropped)
};

// A lone row's greedy chain: the first step feeds `unread` (the m >= 1 tokens of the history
// its cache lacks) at slots start .. start + m - 1 of the row's cache, step j > 0 the token
// step j - 1 chose at slot start + m - 1 + j (each position's features row left holding its
// last hidden state, as a pass leaves it); each step chooses the first largest logit of the
// head at its last position, mapped through head_ids where given ([W] int64: the draft
// head's token ids). The first step is the pass forward_rows would run over the same
// positions: a draft that lags by the last round's bonus token and its own last token (every
// fully accepted round) reads both in the chain's call. Up to `steps` steps;
// the embedding's rows are `hidden` wide, of a quantised type (the caller checks). With
// prices, this call's token j (P its cumulative probability, E 1 + the P's of the chain's
// tokens before it) is dropped and the chain ends unless P keep_a[j] > E keep_b[j], and it
// ends after that token unless P more_a[j] > (E + P) more_b[j]: ChainCut's keeps and goes_on,
// in its operation order.
inline Chain greedy_chain(const Decoder& decoder, const torch::Tensor& embedding,
                          int64_t embedding_type, const std::vector<int64_t>& unread,
                          torch::Tensor features, torch::Tensor keys, torch::Tensor values,
                          int64_t start, int64_t steps, torch::Tensor logits,
                          const torch::Tensor& head_ids, const ChainPrices& prices) {
  const int64_t hidden = decoder.shape.hidden, width = logits.size(1);
  const int64_t first = int64_t(unread.size());  // positions of the first step
  TORCH_CHECK(first >= 1, "a chain starts from at least one unread token");
  TORCH_CHECK(features.dim() == 2 && features.is_contiguous() &&
              features.scalar_type() == torch::kFloat32 && features.size(1) == hidden &&
              start >= 0 && start + first - 1 + steps <= features.size(0),
              "features: [capacity, hidden]");
  TORCH_CHECK(head_ids.numel() == 0 || (head_ids.scalar_type() == torch::kInt64 &&
                                        head_ids.is_contiguous() && head_ids.numel() == width),
              "head_ids: [W] int64, or empty");
  const bool cut = !prices.keep_a.empty();
  TORCH_CHECK(!cut || (int64_t(prices.keep_a.size()) >= steps &&
                       prices.keep_b.size() == prices.keep_a.size() &&
                       prices.more_a.size() == prices.keep_a.size() &&
                       prices.more_b.size() == prices.keep_a.size()),
              "prices for every step of the chain");
  double last = 1.0, before = 0.0;  // P_{j-1}, and P_0 + .. + P_{j-1}
  for (double p : prices.prior) {
    last = p;
    before += p;
  }
  Chain chain;
  std::vector<int64_t> fed = unread;  // the tokens a step feeds
  for (int64_t j = 0; j < steps; j++) {
    // 1. the tokens' embedding rows, one pass, the head's largest logit at the last
    const int64_t slot = j == 0 ? start : start + first - 1 + j, count = int64_t(fed.size());
    torch::Tensor x = features.narrow(0, slot, count);
    for (int64_t i = 0; i < count; i++) {
      TORCH_CHECK(fed[i] >= 0 && fed[i] < embedding.size(0), "token out of the embedding");
      dequantize_row(int(embedding_type),
                     embedding.data_ptr<uint8_t>() + fed[i] * embedding.size(1), hidden,
                     x.data_ptr<float>() + i * hidden);
    }
    const PassRows rows{{keys}, {values}, {slot}, {count}, {}, {}, {}};
    forward_layers(x, decoder, rows, torch::empty({0}), {}, {count - 1}, logits);
    chain.passes++;
    const auto [index, probability] = greedy_top(logits.data_ptr<float>(), width);
    const int64_t chosen = head_ids.numel() ? head_ids.data_ptr<int64_t>()[index] : index;
    // 2. the chain's confidence: drop the token, or keep it and maybe stop
    const double cumulative = double(probability) * last;
    if (cut && !(cumulative * prices.keep_a[j] > (1.0 + before) * prices.keep_b[j])) break;
    chain.tokens.push_back(chosen);
    chain.cumulative.push_back(cumulative);
    if (cut && !(cumulative * prices.more_a[j] > (1.0 + (before + cumulative)) * prices.more_b[j]))
      break;
    last = cumulative;
    before += cumulative;
    fed.assign(1, chosen);
  }
  return chain;
}

}  // namespace vq
