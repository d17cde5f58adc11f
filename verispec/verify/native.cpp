// Sampled verification of draft chains on the CPU: token-wise rejection sampling and block
// verification (Sun et al. 2025), one row at a time, every pass over the vocabulary fused into
// one loop with no [V] temporaries. The procedures, their uniforms and their decisions are
// verify/chains.py's `token_wise` and `block` (the reference, and the path on other devices); read
// those first. What this file adds:
//   - block verification computes h_i lazily, from the last position down, and stops at the
//     first coin that comes up: tau is the last position whose coin came up, so the coins
//     below it do not matter and their Z_i (a pass over the vocabulary each) are never needed;
//     a Z_i is skipped too where a bound decides the coin (`block`), and Z_tau's chunk sums
//     serve the draw of the next token;
//   - the next token is drawn from the unnormalised residual by a two-level inverse CDF: a
//     float64 sum per chunk of CHUNK tokens (LANES partial sums combined in a fixed tree, the
//     same bits on every instruction set), then a scan inside the one chunk that holds the
//     uniform's mass. A token's cumulative mass is therefore summed in this order, not
//     torch.cumsum's; the two draws can differ only where a uniform falls within rounding
//     (~1e-16 of the mass) of a boundary.
// Built without -ffp-contract (no fused multiply-adds), so each product is rounded as in
// PyTorch; the function clones for AVX-512 and AVX2 only widen the lanes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t LANES = 16;    // float64 partial sums per chunk
constexpr int64_t CHUNK = 1024;  // tokens per chunk of the two-level cumulative sum

// max(0, value) in float32, NaN to 0: a row of NaN (NaN logits make the whole row NaN) has no
// positive total and is refused; a draft row of NaN leaves no residual, and the target is drawn
// from, as in verify/chains.py.
inline float positive(float value) { return value > 0.0f ? value : 0.0f; }

// The excess of the target over the draft at one position: q is a row of draft
// probabilities, or a point mass on `excluded` (-1: none, then q = 0: the plain target).
struct Excess {
  const float* target;
  const float* draft;  // nullptr: a point mass on `excluded`
  float scale;
  int64_t excluded;

  float operator()(int64_t x) const {
    if (draft != nullptr) return positive(scale * target[x] - draft[x]);
    return x == excluded ? 0.0f : positive(scale * target[x]);
  }
};

// Eight floats and eight doubles: GCC's vector extensions, one register on AVX-512 (the
// doubles) or AVX2 (the floats), two or four SSE registers otherwise.
typedef float Floats __attribute__((vector_size(32)));
typedef double Doubles __attribute__((vector_size(64)));

__attribute__((always_inline)) inline Floats load(const float* at) {
  Floats values;
  std::memcpy(&values, at, sizeof values);
  return values;
}

__attribute__((always_inline)) inline Doubles widened_positive(Floats value) {
  const Floats zero = {};
  return __builtin_convertvector(value > zero ? value : zero, Doubles);
}

// Sum of the excess over [begin, end) in LANES float64 partial sums (token x into lane
// (x - begin) % LANES), combined in a fixed tree. The two loops differ only in q.
__attribute__((target_clones("avx512f", "avx2", "default")))
double chunk_sum(const Excess& excess, int64_t begin, int64_t end) {
  static_assert(LANES == 2 * sizeof(Floats) / sizeof(float), "two vectors of lanes");
  const float* target = excess.target + begin;
  const float* draft = excess.draft ? excess.draft + begin : nullptr;
  const Floats scale = Floats{} + excess.scale;
  const int64_t count = end - begin, whole = count / LANES * LANES;
  Doubles low = {}, high = {};  // lanes 0..7, 8..15
  if (draft != nullptr) {
    for (int64_t x = 0; x < whole; x += LANES) {
      low += widened_positive(scale * load(target + x) - load(draft + x));
      high += widened_positive(scale * load(target + x + 8) - load(draft + x + 8));
    }
  } else {
    for (int64_t x = 0; x < whole; x += LANES) {
      low += widened_positive(scale * load(target + x));
      high += widened_positive(scale * load(target + x + 8));
    }
  }
  double lane[LANES];
  std::memcpy(lane, &low, sizeof low);
  std::memcpy(lane + 8, &high, sizeof high);
  if (excess.draft == nullptr && excess.excluded >= begin && excess.excluded < begin + whole) {
    // the point mass's token, summed above, leaves its lane: subtracting it back would round,
    // so that lane is summed again without it
    const int64_t j = (excess.excluded - begin) % LANES;
    lane[j] = 0.0;
    for (int64_t x = j; x < whole; x += LANES) lane[j] += static_cast<double>(excess(begin + x));
  }
  for (int64_t x = whole; x < count; ++x) lane[x - whole] += static_cast<double>(excess(begin + x));
  for (int64_t width = LANES / 2; width > 0; width /= 2) {
    for (int64_t j = 0; j < width; ++j) lane[j] += lane[j + width];
  }
  return lane[0];
}

// Sum over the vocabulary: the chunks' sums in order. `sums` receives each chunk's sum.
double total_mass(const Excess& excess, int64_t vocab, std::vector<double>& sums) {
  const int64_t chunks = (vocab + CHUNK - 1) / CHUNK;
  sums.resize(chunks);
  double total = 0.0;
  for (int64_t c = 0; c < chunks; ++c) {
    sums[c] = chunk_sum(excess, c * CHUNK, std::min(vocab, (c + 1) * CHUNK));
    total += sums[c];
  }
  return total;
}

// The first token whose cumulative mass exceeds uniform * total (uniform in [0, 1)), or -1
// when the row has no positive mass (zeros, NaN); `sums` holds the excess's chunk sums.
int64_t pick_summed(const Excess& excess, int64_t vocab, double uniform,
                    const std::vector<double>& sums) {
  double total = 0.0;  // as total_mass summed it
  for (const double sum : sums) total += sum;
  if (!(total > 0.0)) return -1;
  // below total even where rounding would make uniform * total reach it (sampling._pick)
  const double goal = std::min(uniform * total, std::nextafter(total, 0.0));
  double before = 0.0;  // the chunks before c, summed as total was
  for (int64_t c = 0; c < static_cast<int64_t>(sums.size()); ++c) {
    if (before + sums[c] > goal) {
      // 1. Scan the chunk; the crossing is at a token of positive mass.
      const int64_t end = std::min(vocab, (c + 1) * CHUNK);
      double cumulative = before;
      int64_t last_positive = -1;
      for (int64_t x = c * CHUNK; x < end; ++x) {
        const double mass = excess(x);
        if (mass > 0.0) last_positive = x;
        cumulative += mass;
        if (cumulative > goal) return x;
      }
      // 2. The chunk's sequential sum rounded below its lane sum: its last token with mass.
      return last_positive;
    }
    before += sums[c];
  }
  return -1;  // unreachable: before reaches total > goal at the last chunk
}

int64_t pick(const Excess& excess, int64_t vocab, double uniform, std::vector<double>& sums) {
  total_mass(excess, vocab, sums);
  return pick_summed(excess, vocab, uniform, sums);
}

// Whether any token has positive excess mass (the sum is then positive).
bool any_positive(const Excess& excess, int64_t vocab) {
  for (int64_t x = 0; x < vocab; ++x) {
    if (excess(x) > 0.0f) return true;
  }
  return false;
}

// One row's view of the batch: its draft tokens, coins and the rows of its distributions.
struct Row {
  int64_t vocab, num_draft;
  const int64_t* tokens;  // [num_draft]
  const float* coins;     // [num_draft]
  const float* target;    // base of the target rows
  const int64_t* target_at;  // [num_draft + 1]: p(. | x_<=i) is target + target_at[i] * vocab
  const float* draft;     // base of the draft rows, or nullptr (point masses on the tokens)
  const int64_t* draft_at;   // [num_draft]

  const float* p(int64_t i) const { return target + target_at[i] * vocab; }
  const float* q(int64_t i) const { return draft ? draft + draft_at[i] * vocab : nullptr; }
  float p_at_draft(int64_t i) const { return p(i)[tokens[i]]; }
  float q_at_draft(int64_t i) const { return draft ? q(i)[tokens[i]] : 1.0f; }
  // max(0, scale p(. | x_<=i) - q(. | x_<=i)): q is the draft row, or a point mass on x_i+1
  Excess excess(int64_t i, float scale) const {
    return {p(i), q(i), scale, draft ? -1 : tokens[i]};
  }
  Excess bonus() const { return {p(num_draft), nullptr, 1.0f, -1}; }
};

// The next token after `accepted` tokens: from the residual max(0, scale p - q) at a stop
// before the row's last token (the plain target if that has no mass), from p after it.
// summed: `sums` already holds that residual's chunk sums (block verification's Z_tau).
int64_t next_token(const Row& row, int64_t accepted, float scale, double uniform,
                   std::vector<double>& sums, bool summed) {
  if (accepted == row.num_draft) return pick(row.bonus(), row.vocab, uniform, sums);
  const Excess excess = row.excess(accepted, scale);
  const int64_t token = summed ? pick_summed(excess, row.vocab, uniform, sums)
                               : pick(excess, row.vocab, uniform, sums);
  return token >= 0 ? token : pick(Excess{row.p(accepted), nullptr, scale, -1}, row.vocab,
                                   uniform, sums);
}

// Token-wise: x_i is kept while coin_i * q(x_i) < p(x_i).
int64_t token_wise(const Row& row) {
  int64_t accepted = 0;
  while (accepted < row.num_draft &&
         row.coins[accepted] * row.q_at_draft(accepted) < row.p_at_draft(accepted)) {
    ++accepted;
  }
  return accepted;
}

// h_i = Z_i / (Z_i + 1 - p_i), 0 where Z_i = 0 (verify.chains.block).
double stop_chance(double mass, double weight) {
  return mass > 0.0 ? mass / std::max(mass + 1.0 - weight, 1e-300) : 0.0;
}

// Block verification: tau, with weight[i] = p_i = min(1, p_{i-1} p(x_i) / q(x_i)); summed is
// set where `sums` holds Z_tau's chunk sums, the residual the next token is drawn from.
int64_t block(const Row& row, std::vector<double>& weight, std::vector<double>& sums,
              bool& summed) {
  summed = false;
  const int64_t k = row.num_draft;
  // 1. p_0 .. p_K (verify.chains._carried).
  weight.assign(k + 1, 1.0);
  for (int64_t i = 1; i <= k; ++i) {
    const double carried = weight[i - 1] * static_cast<double>(row.p_at_draft(i - 1));
    const double draft = static_cast<double>(row.q_at_draft(i - 1));
    const double kept = carried >= draft ? 1.0 : carried / std::max(draft, 1e-300);
    weight[i] = carried > 0.0 ? kept : 0.0;
  }
  // 2. The coins from the last position down: h_K = p_K, h_i = Z_i / (Z_i + 1 - p_i). Z_i,
  //    a pass over the vocabulary, is computed only where the coin is not decided without
  //    it: Z_i <= p_i sum_x p(x) = p_i, so h_i <= p_i and a coin at or above p_i stays down
  //    (with a margin of 1e-4 for a float32 target row summing to a little over 1, so that
  //    the decisions stay the reference's); at p_i = 1, h_i is 1 wherever any token has
  //    excess mass, and the first such token settles it.
  for (int64_t i = k; i >= 1; --i) {
    const double coin = static_cast<double>(row.coins[i - 1]);
    double chance = weight[k];
    bool full = false;  // Z_i's chunk sums are in `sums`
    if (i < k) {
      if (row.draft == nullptr) {
        chance = stop_chance(weight[i] * (1.0 - static_cast<double>(row.p_at_draft(i))),
                             weight[i]);
      } else if (weight[i] == 1.0) {
        chance = any_positive(row.excess(i, 1.0f), row.vocab) ? 1.0 : 0.0;
      } else if (coin >= weight[i] * (1.0 + 1e-4)) {
        continue;
      } else {
        const Excess excess = row.excess(i, static_cast<float>(weight[i]));
        chance = stop_chance(total_mass(excess, row.vocab, sums), weight[i]);
        full = true;
      }
    }
    if (coin < chance) {
      summed = full;
      return i;
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// Verify `rows` chains of a group padded to `width` draft slots. method 0: token-wise, 1: block
// (a group of width <= 1 runs token-wise: verify.chains.procedure sends such rows there).
// Row b's slots: tokens, coins,
// draft_at [b * width, ...), target_at [b * (width + 1), ...), num_draft[b] of them real.
// Writes row b's accepted prefix and next token into out_tokens [b * (width + 1), ...) (the
// rest -1), num_accepted[b], and ok[b]: false where the distribution the next token is drawn
// from has no positive mass (zeros or NaN). Returns 0, or 1 + the first row with a draft token
// outside [0, vocab) (nothing written for it or after it).
int64_t verify_chains(int64_t method, int64_t rows, int64_t width, int64_t vocab,
                      const int64_t* tokens, const int64_t* num_draft, const float* coins,
                      const double* next_uniform, const float* target,
                      const int64_t* target_at, const float* draft, const int64_t* draft_at,
                      int64_t* out_tokens, int64_t* num_accepted, bool* ok) {
  std::vector<double> sums, weight;
  for (int64_t b = 0; b < rows; ++b) {
    const Row row{vocab, num_draft[b], tokens + b * width, coins + b * width, target,
                  target_at + b * (width + 1), draft,
                  draft != nullptr ? draft_at + b * width : nullptr};
    for (int64_t i = 0; i < row.num_draft; ++i) {
      if (row.tokens[i] < 0 || row.tokens[i] >= vocab) return 1 + b;
    }
    const bool by_block = method == 1 && width > 1;
    bool summed = false;
    const int64_t accepted = by_block ? block(row, weight, sums, summed) : token_wise(row);
    const float scale = by_block ? static_cast<float>(weight[accepted]) : 1.0f;
    const int64_t next = next_token(row, accepted, scale, next_uniform[b], sums, summed);
    int64_t* out = out_tokens + b * (width + 1);
    std::copy(row.tokens, row.tokens + accepted, out);
    out[accepted] = std::max<int64_t>(next, 0);
    std::fill(out + accepted + 1, out + width + 1, -1);
    num_accepted[b] = accepted;
    ok[b] = next >= 0;
  }
  return 0;
}

}  // extern "C"
