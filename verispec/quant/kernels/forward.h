// A whole decoder pass over GGUF-quantised weights in one call (module.cpp binds it as
// forward_layers): for every layer RMSNorm, q/k/v with bias, rotary, the KV cache write,
// attention over the cache (chains and token trees), the output projection, the SwiGLU MLP and
// the residual stream, all in float32 beside this path's integer products. Python calls it once
// a pass (runtime/native/gguf_model.py), where a PyTorch loop pays a dozen ops a layer.
//
// Batch invariance by construction: every value is computed by one thread from its own inputs
// in a fixed order, whatever the pass holds and however many threads run it.
//   - products: each activation row quantised alone (activations.h), multiplied in the panel
//     order (panels.h) or dot.h's; a row's outputs never depend on the other rows;
//   - norms, rotary, SwiGLU: per position (vector.h);
//   - attention: each query head of each position alone over exactly its own keys, 0..p for a
//     chain and slots 0..base-1 then its path for a tree node (the keys the chain to it holds),
//     scores, softmax and the weighted sum of values in key order.
// So a prompt pass and a verification pass give a position the same bits, and so do 1 and 2
// threads (tests/test_quant_forward.py).
//
// Threads: one OpenMP team for the whole pass; each phase splits its work (rows, 16-output
// units of the products, attention tasks) over the threads: a product's units statically, a
// thread that finishes its share early then taking what is left of the others'; a lone
// position's SwiGLU by blocks. Each phase ends at the team's own barrier, which spins briefly
// and then yields its core: on a busy machine a thread waiting for one the OS has not
// scheduled gives way to it instead of spinning out its time slice (OpenMP's barriers spin
// for long, and a pass has ~10 of them a layer).

#pragma once

#include "activations.h"
#include "rows.h"
#include "vector.h"

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>
#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <utility>
#include <limits>
#include <memory>
#include <vector>

namespace vq {

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps;  // the RMS norms'
};

// One weight of a projection, whose outputs follow the previous part's: panels of 16 rows
// ([N / 16, panel bytes], `pack`) or the file's rows ([N, row_bytes]), and a bias or none.
struct Part {
  torch::Tensor data;
  int64_t type;
  bool panels;
  int64_t out_features, in_features;  // N, K
  torch::Tensor bias;                 // [N] float32, or empty
  // read once here: a pass multiplies ~50,000 units of 16 outputs, and each tensor accessor
  // costs a few checks (~2% of a Qwen2.5-1.5B step when they were asked a unit)
  const uint8_t* bytes = nullptr;  // data's
  int64_t stride = 0;              // bytes of a panel, or of a row
  const float* bias_values = nullptr;
  PanelFn panel_kernel = nullptr;
  RowsFn rows_kernel = nullptr;

  Part(torch::Tensor data_, int64_t type_, bool panels_, int64_t n, int64_t k,
       torch::Tensor bias_)
      : data(std::move(data_)), type(type_), panels(panels_), out_features(n), in_features(k),
        bias(std::move(bias_)) {
    TORCH_CHECK(known_type(int(type)), "unsupported GGUF type ", type);
    TORCH_CHECK(data.dim() == 2 && data.scalar_type() == torch::kUInt8 && data.is_contiguous(),
                "weights: a contiguous uint8 tensor");
    if (panels) {
      TORCH_CHECK(panels_for(int(type)) != nullptr, "the ", path_name(),
                  " path has no panel kernel for type ", type);
      TORCH_CHECK(n % PANEL == 0 && data.size(0) == n / PANEL && k % panel_block_size(int(type)) == 0 &&
                  data.size(1) == panel_bytes(int(type), k), "panels: pack(weight)'s layout");
    } else {
      const Layout shape = layout(int(type));
      TORCH_CHECK(rows_for(int(type)) != nullptr && data.size(0) == n && k % shape.block_size == 0 &&
                  data.size(1) == k / shape.block_size * shape.block_bytes,
                  "weights: the file's rows [N, row_bytes]");
    }
    TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kFloat32 &&
                                      bias.numel() == n && bias.is_contiguous()),
                "bias: [out_features] float32");
    bytes = data.data_ptr<uint8_t>();
    stride = data.size(1);
    bias_values = bias.numel() ? bias.data_ptr<float>() : nullptr;
    if (panels)
      panel_kernel = panels_for(int(type));
    else
      rows_kernel = rows_for(int(type));
  }
};

using Projection = std::vector<Part>;  // parts side by side over the same input

inline int64_t out_features(const Projection& projection) {
  int64_t n = 0;
  for (const Part& part : projection) n += part.out_features;
  return n;
}

// 16 outputs of one part: the unit the threads share out in a product.
struct Unit {
  int32_t part;
  int32_t first;   // the part's output where the unit starts (a multiple of 16)
  int64_t column;  // the projection's output where it starts (first, after the earlier parts')
};

inline std::vector<Unit> units_of(const Projection& projection) {
  std::vector<Unit> units;
  int64_t column = 0;
  for (size_t p = 0; p < projection.size(); p++) {
    for (int64_t n = 0; n < projection[p].out_features; n += PANEL)
      units.push_back({int32_t(p), int32_t(n), column + n});
    column += projection[p].out_features;
  }
  return units;
}

struct LayerWeights {
  torch::Tensor attn_norm, mlp_norm;  // [H] float32
  Projection qkv;                     // H -> (heads + 2 kv_heads) d, rotary order
  Projection out;                     // heads d -> H
  Projection gate_up;                 // H -> 2 I
  Projection down;                    // I -> H
};

// What a model's pass needs besides its rows, checked once at load. The final norm and the head
// are optional (an empty projection: the caller runs its head itself).
struct Decoder {
  Shape shape;
  std::vector<LayerWeights> layers;
  torch::Tensor cos, sin;  // [max_positions, d] float32 rotary tables (llama.py's rope_tables)
  torch::Tensor final_norm;  // [H] float32, or empty
  Projection head;           // H -> vocabulary, or none
  // each layer's four products' units (qkv, out, gate_up, down), and the head's
  std::vector<std::array<std::vector<Unit>, 4>> layer_units;
  std::vector<Unit> head_units;

  Decoder(Shape shape_, std::vector<LayerWeights> layers_, torch::Tensor cos_, torch::Tensor sin_,
          torch::Tensor final_norm_, Projection head_)
      : shape(shape_), layers(std::move(layers_)), cos(std::move(cos_)), sin(std::move(sin_)),
        final_norm(std::move(final_norm_)), head(std::move(head_)) {
    const int64_t h = shape.hidden, d = shape.head_dim, inter = shape.intermediate;
    TORCH_CHECK(h % LANES == 0 && inter % LANES == 0 && d % LANES == 0,
                "hidden, intermediate and head_dim must be multiples of 16");
    TORCH_CHECK(shape.kv_heads > 0 && shape.heads % shape.kv_heads == 0,
                "heads must be a multiple of kv_heads");
    for (const torch::Tensor* table : {&cos, &sin})
      TORCH_CHECK(table->scalar_type() == torch::kFloat32 && table->is_contiguous() &&
                  table->dim() == 2 && table->size(1) == d, "rotary tables: [positions, d]");
    const auto check = [](const Projection& projection, int64_t n, int64_t k, const char* name) {
      TORCH_CHECK(out_features(projection) == n, name, ": ", out_features(projection),
                  " outputs, the shape says ", n);
      for (const Part& part : projection)
        TORCH_CHECK(part.in_features == k, name, ": ", part.in_features, " inputs, the shape says ",
                    k);
    };
    if (!head.empty()) {
      TORCH_CHECK(final_norm.scalar_type() == torch::kFloat32 && final_norm.is_contiguous() &&
                  final_norm.numel() == h, "final norm: [hidden] float32");
      for (const Part& part : head)
        TORCH_CHECK(part.in_features == h, "head: ", part.in_features, " inputs, the shape says ",
                    h);
    }
    for (const LayerWeights& layer : layers) {
      for (const torch::Tensor* norm : {&layer.attn_norm, &layer.mlp_norm})
        TORCH_CHECK(norm->scalar_type() == torch::kFloat32 && norm->is_contiguous() &&
                    norm->numel() == h, "norm weights: [hidden] float32");
      check(layer.qkv, (shape.heads + 2 * shape.kv_heads) * d, h, "qkv");
      check(layer.out, h, shape.heads * d, "out");
      check(layer.gate_up, 2 * inter, h, "gate_up");
      check(layer.down, h, inter, "down");
      layer_units.push_back({units_of(layer.qkv), units_of(layer.out), units_of(layer.gate_up),
                             units_of(layer.down)});
    }
    head_units = units_of(head);
  }
};

// The rows of one pass (as the bfloat16 stack's): row r's new slots starts[r]..+lengths[r]-1 of
// its cache keys[r], values[r] [layers, kv_heads, capacity, d] float32. Trees (tree_bases
// empty: none): row r with tree_bases[r] >= 0 holds a tree from that slot on; new slot i (over
// the pass) attends over slots 0..base-1, then path_slots[path_offsets[i]..path_offsets[i+1])
// (its ancestors and itself), at position base - 1 + its depth; an empty path is a chain slot.
struct PassRows {
  std::vector<torch::Tensor> keys, values;
  std::vector<int64_t> starts, lengths;
  std::vector<int64_t> tree_bases, path_slots, path_offsets;
};

// One pass's activations quantised for products over K inputs (codes, scales and the sums the
// panel order reads), `rows` rows.
struct QuantisedRows {
  int64_t padded;
  std::vector<int8_t> codes;
  std::vector<float> scales, sums, s32;
  std::vector<int32_t> b16;

  QuantisedRows(int64_t rows, int64_t K)
      : padded(padded_length(K)), codes(rows * padded), scales(rows * padded / QK),
        sums(rows * padded / 16), s32(rows * padded / QK), b16(rows * padded / 16) {}
  Activations view() const { return {codes.data(), scales.data(), sums.data(), padded}; }
  PanelSums panel_sums_view() const { return {s32.data(), b16.data()}; }
  // row's blocks first..last-1 (all of them by default); x: the row's values from its first
  void quantise(const float* x, int64_t K, int64_t row, int64_t first = 0, int64_t last = -1) {
    quantize_row(x, K, padded, codes.data() + row * padded, scales.data() + row * (padded / QK),
                 sums.data() + row * (padded / 16), b16.data() + row * (padded / 16),
                 s32.data() + row * (padded / QK), first, last);
  }
};

// Activation rows a product takes through one weight unit before the next: a prompt chunk's
// rows in blocks whose codes stay in L2 while the thread's share of the weight streams past.
constexpr int64_t ROW_BLOCK = 32;

// out[r, column of the unit's outputs] for rows first..last-1 (out: [rows, ldy]).
inline void multiply_unit(const Projection& projection, const Unit& unit, const QuantisedRows& x,
                          int64_t first, int64_t last, float* out, int64_t ldy) {
  const Part& part = projection[unit.part];
  const int64_t column = unit.column;
  const int64_t K = part.in_features, count = std::min<int64_t>(PANEL, part.out_features - unit.first);
  const Activations acts = x.view();
  if (part.panels) {
    const PanelSums sums = x.panel_sums_view();
    const uint8_t* panel = part.bytes + unit.first / PANEL * part.stride;
    for (int64_t r0 = first; r0 < last; r0 += PANEL_TILE)
      part.panel_kernel(panel, K, acts, sums, r0, std::min<int64_t>(PANEL_TILE, last - r0),
                        out + r0 * ldy + column, ldy);
  } else {
    for (int64_t n = 0; n < count; n++)
      for (int64_t r0 = first; r0 < last; r0 += MAX_TILE)
        part.rows_kernel(part.bytes + (unit.first + n) * part.stride, K, acts, r0,
                         std::min<int64_t>(MAX_TILE, last - r0), out + r0 * ldy + column + n, ldy);
  }
  if (part.bias_values) {
    const float* bias = part.bias_values + unit.first;
    for (int64_t r = first; r < last; r++)
      for (int64_t n = 0; n < count; n++) out[r * ldy + column + n] += bias[n];
  }
}

// The threads of one pass: a thread's static share of a phase's work, and the barrier that
// ends a phase (spin with PAUSE for a few microseconds, then yield the core while waiting).
class Team {
 public:
  // Every thread of the team calls this first, with the team's size (all the same value).
  void join(int threads) { threads_.store(threads, std::memory_order_relaxed); }

  struct Member {
    Team& team;
    int64_t thread, threads;
    // items first..last-1 of `count`: this thread's static share
    std::pair<int64_t, int64_t> share(int64_t count) const {
      return {count * thread / threads, count * (thread + 1) / threads};
    }
    void wait() const { team.wait(); }
  };

  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) ==
        threads_.load(std::memory_order_relaxed) - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; spins++) {
      if (spins < 2048) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  std::atomic<int> threads_{1}, arrived_{0}, generation_{0};
};

// Units a thread takes at a time from another's share, and at least from its own: few enough
// that the last ones even out the threads' finish.
constexpr int64_t UNITS_PER_TAKE = 2;
// From its own share a thread takes an eighth of what is left (at least UNITS_PER_TAKE): a
// product's ~1,000 units on two threads cost ~70 atomic takes instead of ~500 (a Qwen2.5-1.5B
// step 2-5% less on a Zen 4), and what is left for the other thread to help with still shrinks
// to 2 units.
constexpr int64_t OWN_SHARE = 8;

// One thread's share of a product's units, which the other threads may help finish: its owner
// takes chunks from the front, a thread done with its own share takes them from the back (both
// ends in one word, so every unit is taken once). Which thread multiplies a unit never changes
// its outputs, only how long the phase waits for its slowest thread (on a shared VM one core is
// often a few percent slower than the other, and a static split waited out the difference).
class Share {
 public:
  void set(int64_t first, int64_t last) {
    ends_.store(uint64_t(first) << 32 | uint64_t(last), std::memory_order_relaxed);
  }
  // Units [first, last) from the back (up to `chunk`) or the front (up to the larger of `chunk`
  // and an OWN_SHARE-th of what is left); first == last when none is left.
  std::pair<int64_t, int64_t> take(int64_t chunk, bool from_back) {
    uint64_t ends = ends_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = int64_t(ends >> 32), back = int64_t(ends & 0xffffffffu);
      if (front >= back) return {0, 0};
      const int64_t first = from_back ? std::max(front, back - chunk) : front;
      const int64_t last =
          from_back ? back : std::min(back, front + std::max(chunk, (back - front) / OWN_SHARE));
      const uint64_t rest = from_back ? uint64_t(front) << 32 | uint64_t(first)
                                      : uint64_t(last) << 32 | uint64_t(back);
      if (ends_.compare_exchange_weak(ends, rest, std::memory_order_relaxed)) return {first, last};
    }
  }

 private:
  alignas(64) std::atomic<uint64_t> ends_{0};
};

// y [rows, N] = x . projection^T inside the pass's team: each thread its own share of the units
// (shares[me.thread], set to the static split before the phase), then what is left of the
// others' shares, then the barrier.
inline void product(const Team::Member& me, const Projection& projection,
                    const std::vector<Unit>& units, const QuantisedRows& x, int64_t rows,
                    float* y, Share* shares) {
  const int64_t ldy = out_features(projection);
  // UNITS_PER_TAKE units at a time through every block of rows: a prompt chunk's row blocks
  // each read those units' weights, which stay in L2 (a take of an eighth of a share would not)
  const auto multiply = [&](std::pair<int64_t, int64_t> taken) {
    for (int64_t u0 = taken.first; u0 < taken.second; u0 += UNITS_PER_TAKE)
      for (int64_t r0 = 0; r0 < rows; r0 += ROW_BLOCK)
        for (int64_t u = u0; u < std::min(taken.second, u0 + UNITS_PER_TAKE); u++)
          multiply_unit(projection, units[u], x, r0, std::min(rows, r0 + ROW_BLOCK), y, ldy);
  };
  for (int64_t other = 0; other < me.threads; other++) {
    Share& share = shares[(me.thread + other) % me.threads];
    for (auto taken = share.take(UNITS_PER_TAKE, other > 0); taken.first < taken.second;
         taken = share.take(UNITS_PER_TAKE, other > 0))
      multiply(taken);
  }
  me.wait();
}

struct Row {
  float* keys;  // this row's cache [layers, kv_heads, capacity, d]
  float* values;
  int64_t capacity, start, length, offset;  // new slots start..start+length-1 at x[offset..]
  int64_t tree_base;                        // -1, or the first slot of a token tree
};

// Query heads of one row and KV head that one task attends together: members first..last-1
// (at most MAX_QUERIES), member t * group + head in group.
struct AttentionTask {
  int64_t row, kv_head, first, last;
};

// One query head of a pass over its `count` keys: key j at slot j below `base`, at
// path[j - base] from there on (a tree node's path to the root).
struct Query {
  const float* q;  // [d]
  float* out;      // [d]; the weighted sum of values gathers here before it is divided
  int64_t count, base;
  const int64_t* path;
  int64_t slot(int64_t j) const { return j < base ? j : path[j - base]; }
};

// Query heads attended together: the query heads of a KV head (and, in a pass over several
// positions, those of the next positions) read the same keys and values, so each block of keys
// (LANES of them, for the scores) and of values (VALUE_BLOCK) is read from memory once and used
// from L1 by every query of the task, instead of streaming the whole cache once a query head
// (at 2,048 tokens a 1.5B model's cache is 117 MB a pass).
constexpr int64_t MAX_QUERIES = 64;
constexpr int64_t VALUE_BLOCK = 32;

// q . k lane by lane over CHUNKS chunks of 16 (lane l: q_l k_l + q_{l+16} k_{l+16} + ..., a
// product rounded, then added, in chunk order).
template <int CHUNKS>
inline Floats key_dot(const Floats* query, const float* k) {
  Floats sum = query[0] * load_lanes(k);
  for (int c = 1; c < CHUNKS; c++) sum = sum + query[c] * load_lanes(k + c * LANES);
  return sum;
}

// scores[j] = (q . k_j) * scale for keys j0 .. j0 + 15 of `query` (those it has), each key's
// lanes summed in lane_sum's order, and their maximum folded into `top` in key order.
template <int CHUNKS>
inline void score_block(const Query& query, const float* keys, int64_t j0, float scale,
                        float* scores, float& top) {
  constexpr int64_t d = CHUNKS * LANES;
  const int64_t here = std::min<int64_t>(LANES, query.count - j0);
#if defined(__AVX2__) && !defined(__AVX512F__)
  // AVX2: each key's lanes summed on 256-bit halves in registers, in lane_sum's order
  __m256 low[CHUNKS], high[CHUNKS];
  for (int c = 0; c < CHUNKS; c++) {
    low[c] = _mm256_loadu_ps(query.q + c * LANES);
    high[c] = _mm256_loadu_ps(query.q + c * LANES + 8);
  }
  for (int64_t j = j0; j < j0 + here; j++) {
    const float* k = keys + query.slot(j) * d;
    __m256 sum_low = _mm256_mul_ps(low[0], _mm256_loadu_ps(k));
    __m256 sum_high = _mm256_mul_ps(high[0], _mm256_loadu_ps(k + 8));
    for (int c = 1; c < CHUNKS; c++) {
      sum_low = _mm256_add_ps(sum_low, _mm256_mul_ps(low[c], _mm256_loadu_ps(k + c * LANES)));
      sum_high =
          _mm256_add_ps(sum_high, _mm256_mul_ps(high[c], _mm256_loadu_ps(k + c * LANES + 8)));
    }
    const __m256 s8 = _mm256_add_ps(sum_low, sum_high);  // lane l + 8
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    scores[j] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1))) * scale;
    top = scores[j] > top ? scores[j] : top;
  }
#else
  Floats q[CHUNKS];
  for (int c = 0; c < CHUNKS; c++) q[c] = load_lanes(query.q + c * LANES);
  Floats parts[LANES];
  for (int64_t t = 0; t < LANES; t++)
    parts[t] = t < here ? key_dot<CHUNKS>(q, keys + query.slot(j0 + t) * d) : Floats{};
  store_lanes(scores + j0, lane_sums16(parts) * scale);
  for (int64_t t = 0; t < here; t++) top = scores[j0 + t] > top ? scores[j0 + t] : top;
#endif
}

// The softmax's weights in place, e^(s - top), zero past the last key (scores padded to a
// multiple of 16), and their sum, lane by lane, then lane_sum.
inline float softmax_weights(float* scores, int64_t count, float top) {
  const int64_t padded = (count + LANES - 1) / LANES * LANES;
  for (int64_t j = count; j < padded; j++) scores[j] = 0.0f;
  Floats total = Floats{};
  for (int64_t j = 0; j < padded; j += LANES) {
    Floats w = exp_lanes(load_lanes(scores + j) - top);
    if (j + LANES > count)
      for (int64_t l = count - j; l < LANES; l++) w[l] = 0.0f;
    store_lanes(scores + j, w);
    total = total + w;
  }
  return lane_sum(total);
}

// query.out [d] += sum over keys j0 .. j1 - 1 in order of w_j * v_j, chunk by chunk (a
// product, then an addition), starting from zero when j0 is 0.
template <int CHUNKS>
inline void add_values(const Query& query, const float* values, int64_t j0, int64_t j1,
                       const float* weights) {
  constexpr int64_t d = CHUNKS * LANES;
  float* out = query.out;
#if defined(__AVX2__) && !defined(__AVX512F__)
  // On AVX2 a 64-byte `Floats` is two registers, and GCC keeps an array of them in memory, so
  // every key paid a store and a reload per chunk; the same operations on 256-bit halves held
  // in registers give the same bits.
  __m256 low[CHUNKS], high[CHUNKS];
  for (int c = 0; c < CHUNKS; c++) {
    low[c] = j0 ? _mm256_loadu_ps(out + c * LANES) : _mm256_setzero_ps();
    high[c] = j0 ? _mm256_loadu_ps(out + c * LANES + 8) : _mm256_setzero_ps();
  }
  for (int64_t j = j0; j < j1; j++) {
    const float* v = values + query.slot(j) * d;
    const __m256 w = _mm256_set1_ps(weights[j]);
    for (int c = 0; c < CHUNKS; c++) {
      low[c] = _mm256_add_ps(low[c], _mm256_mul_ps(w, _mm256_loadu_ps(v + c * LANES)));
      high[c] = _mm256_add_ps(high[c], _mm256_mul_ps(w, _mm256_loadu_ps(v + c * LANES + 8)));
    }
  }
  for (int c = 0; c < CHUNKS; c++) {
    _mm256_storeu_ps(out + c * LANES, low[c]);
    _mm256_storeu_ps(out + c * LANES + 8, high[c]);
  }
#else
  Floats acc[CHUNKS];
  for (int c = 0; c < CHUNKS; c++) acc[c] = j0 ? load_lanes(out + c * LANES) : Floats{};
  for (int64_t j = j0; j < j1; j++) {
    const float* v = values + query.slot(j) * d;
    const Floats w = splat(weights[j]);
    for (int c = 0; c < CHUNKS; c++) acc[c] = acc[c] + w * load_lanes(v + c * LANES);
  }
  for (int c = 0; c < CHUNKS; c++) store_lanes(out + c * LANES, acc[c]);
#endif
}

// m <= MAX_QUERIES query heads over one KV head's keys and values: out [d] = softmax(q . k_j *
// scale) . v_j, each query alone and in key order (the bits do not depend on which queries
// share a call). scores: m rows of `stride` floats (each query's keys, padded to 16). CHUNKS =
// d / 16, a constant, so that a query and its sums stay in registers.
template <int CHUNKS>
inline void attend_queries(const Query* queries, int64_t m, const float* keys,
                           const float* values, float scale, float* scores, int64_t stride) {
  int64_t longest = 0;
  float top[MAX_QUERIES], sum[MAX_QUERIES];
  for (int64_t i = 0; i < m; i++) {
    longest = std::max(longest, queries[i].count);
    top[i] = -std::numeric_limits<float>::infinity();
  }
  // 1. scores, a block of 16 keys for every query in turn, and each query's maximum
  for (int64_t j0 = 0; j0 < longest; j0 += LANES)
    for (int64_t i = 0; i < m; i++)
      if (queries[i].count > j0)
        score_block<CHUNKS>(queries[i], keys, j0, scale, scores + i * stride, top[i]);
  // 2. each query's weights and their sum
  for (int64_t i = 0; i < m; i++)
    sum[i] = softmax_weights(scores + i * stride, queries[i].count, top[i]);
  // 3. the weighted sums of values in key order, a block of values for every query in turn
  for (int64_t j0 = 0; j0 < longest; j0 += VALUE_BLOCK)
    for (int64_t i = 0; i < m; i++)
      if (queries[i].count > j0)
        add_values<CHUNKS>(queries[i], values, j0,
                           std::min(j0 + VALUE_BLOCK, queries[i].count), scores + i * stride);
  for (int64_t i = 0; i < m; i++) {
    const Floats total = splat(sum[i]);
    for (int c = 0; c < CHUNKS; c++)
      store_lanes(queries[i].out + c * LANES, load_lanes(queries[i].out + c * LANES) / total);
  }
}

using AttendFn = void (*)(const Query*, int64_t, const float*, const float*, float, float*,
                          int64_t);

template <size_t... C>
constexpr std::array<AttendFn, sizeof...(C)> attend_table(std::index_sequence<C...>) {
  return {&attend_queries<int(C) + 1>...};
}

constexpr int64_t MAX_HEAD_DIM = 256;

// attend_queries for head_dim d (a multiple of 16 up to MAX_HEAD_DIM), else nullptr.
inline AttendFn attend_for(int64_t d) {
  static constexpr auto table = attend_table(std::make_index_sequence<MAX_HEAD_DIM / LANES>{});
  return d % LANES == 0 && d >= LANES && d <= MAX_HEAD_DIM ? table[d / LANES - 1] : nullptr;
}

// Query heads a task attends together, of a row's `members` for one KV head: all of them (the
// cache then read once), split where the pass's `row_heads` (rows x KV heads) do not spread
// evenly over the threads and each part keeps at least MIN_SPLIT queries. Every task streams
// its KV head's whole cache, so a split reads it once a part: worth it for the balance where
// each key feeds several queries (a verification pass), not for a lone position's few query
// heads, whose pass at a long context is bound by reading the cache (SmolLM2's 3 KV heads on
// 2 threads: a one-token pass after 6,144 tokens 19.3 -> 13.5 ms unsplit).
constexpr int64_t MIN_SPLIT = 4;

inline int64_t task_size(int64_t members, int64_t row_heads, int64_t threads) {
  int64_t splits = row_heads % threads == 0 ? 1 : (2 * threads + row_heads - 1) / row_heads;
  if (members < splits * MIN_SPLIT) splits = 1;
  return std::max<int64_t>(1, std::min(MAX_QUERIES, (members + splits - 1) / splits));
}

// The decoder layers over every row's new positions: x [N, H] float32 is updated in place, each
// row's keys and values at its new slots are written into its cache, and taps
// [N, len(tap_layers), H] gets the hidden state after the first tap_layers[j] layers. With
// `wanted` (positions of x, where the decoder has a head), logits [len(wanted), vocabulary]
// gets their final norm and head in the same pass: no second team and no round trip through
// Python for a pass's last step.
inline void forward_layers(torch::Tensor x, const Decoder& decoder, const PassRows& pass,
                           torch::Tensor taps, const std::vector<int64_t>& tap_layers,
                           const std::vector<int64_t>& wanted, torch::Tensor logits) {
  const Shape& shape = decoder.shape;
  const int64_t n = x.size(0), h = shape.hidden, d = shape.head_dim, inter = shape.intermediate;
  const int64_t q_width = shape.heads * d, kv_width = shape.kv_heads * d;
  const int64_t qkv_width = q_width + 2 * kv_width, group = shape.heads / shape.kv_heads;
  const int64_t num_layers = int64_t(decoder.layers.size());
  const AttendFn attend = attend_for(d);
  TORCH_CHECK(attend != nullptr, "head_dim must be a multiple of 16 up to ", MAX_HEAD_DIM);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32 &&
              x.size(1) == h, "x: [N, hidden] float32");
  const size_t num_rows = pass.starts.size();
  TORCH_CHECK(pass.keys.size() == num_rows && pass.values.size() == num_rows &&
              pass.lengths.size() == num_rows, "one cache, start and length a row");
  const int64_t num_taps = int64_t(tap_layers.size());
  TORCH_CHECK(num_taps == 0 || (taps.dim() == 3 && taps.is_contiguous() &&
                                taps.scalar_type() == torch::kFloat32 && taps.size(0) == n &&
                                taps.size(1) == num_taps && taps.size(2) == h),
              "taps must be [N, len(tap_layers), H] float32");
  const bool trees = !pass.tree_bases.empty();
  TORCH_CHECK(!trees || (pass.tree_bases.size() == num_rows &&
                         int64_t(pass.path_offsets.size()) == n + 1), "tree arguments' sizes");
  const auto path_length = [&](int64_t i) {
    return trees ? pass.path_offsets[i + 1] - pass.path_offsets[i] : int64_t(0);
  };
  // 1. The rows, and each new slot's position; everything checked before the threads start.
  std::vector<Row> rows;
  std::vector<int64_t> positions, row_of;  // [N]
  int64_t offset = 0, longest = 0;
  for (size_t r = 0; r < num_rows; r++) {
    const torch::Tensor &keys = pass.keys[r], &values = pass.values[r];
    TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() &&
                keys.scalar_type() == torch::kFloat32 && values.sizes() == keys.sizes() &&
                values.scalar_type() == torch::kFloat32 && keys.size(0) == num_layers &&
                keys.size(1) == shape.kv_heads && keys.size(3) == d,
                "caches: [layers, kv_heads, capacity, d] float32");
    const int64_t base = trees ? pass.tree_bases[r] : -1;
    TORCH_CHECK(pass.lengths[r] >= 0 && pass.starts[r] >= 0 &&
                pass.starts[r] + pass.lengths[r] <= keys.size(2), "cache too short");
    TORCH_CHECK(base < 0 || (base >= 1 && base <= pass.starts[r] + pass.lengths[r]),
                "bad tree row");
    rows.push_back({keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(2),
                    pass.starts[r], pass.lengths[r], offset, base});
    for (int64_t t = 0; t < pass.lengths[r]; t++) {
      const int64_t i = offset + t, depth = path_length(i);
      TORCH_CHECK(depth == 0 || base >= 0, "a path in a row without a tree");
      for (int64_t j = 0; j < depth; j++) {
        const int64_t slot = pass.path_slots[pass.path_offsets[i] + j];
        TORCH_CHECK(slot >= base && slot < pass.starts[r] + pass.lengths[r],
                    "path slot out of the tree");
      }
      const int64_t position = depth ? base - 1 + depth : pass.starts[r] + t;
      TORCH_CHECK(position < decoder.cos.size(0), "position past the rotary tables");
      TORCH_CHECK(depth || base < 0 || pass.starts[r] + t < base,
                  "a tree slot without its path");
      positions.push_back(position);
      row_of.push_back(int64_t(r));
      longest = std::max(longest, position + 1);
    }
    offset += pass.lengths[r];
  }
  TORCH_CHECK(offset == n, "rows hold ", offset, " positions, x ", n);
  const int64_t num_wanted = int64_t(wanted.size());
  if (num_wanted) {
    TORCH_CHECK(!decoder.head.empty(), "logits wanted from a decoder without a head");
    TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                logits.scalar_type() == torch::kFloat32 && logits.size(0) == num_wanted &&
                logits.size(1) == out_features(decoder.head),
                "logits must be [len(wanted), vocabulary] float32");
    for (int64_t i : wanted) TORCH_CHECK(i >= 0 && i < n, "wanted position out of the pass");
  }
  if (n == 0) return;

  // 2. Attention tasks: the query heads of one row and KV head (task_size).
  const int64_t num_threads = std::max(1, at::get_num_threads());
  int64_t row_heads = 0, largest_task = 0;  // rows x KV heads, and the largest task
  for (const Row& row : rows) row_heads += row.length > 0 ? shape.kv_heads : 0;
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < rows.size(); r++) {
    const int64_t members = rows[r].length * group;
    const int64_t size = task_size(members, row_heads, num_threads);
    largest_task = std::max(largest_task, std::min(size, members));
    for (int64_t kv_head = 0; kv_head < shape.kv_heads; kv_head++)
      for (int64_t first = 0; first < members; first += size)
        tasks.push_back({int64_t(r), kv_head, first, std::min(members, first + size)});
  }

  // 3. Buffers of the pass.
  float* hidden = x.data_ptr<float>();
  std::vector<float> normed(n * h), qkv(n * qkv_width), attended(n * q_width), y(n * h),
      gate_up(n * 2 * inter), act(n * inter);
  QuantisedRows by_hidden(n, h), by_heads(n, q_width), by_inter(n, inter);
  QuantisedRows by_final(num_wanted, h);  // the wanted positions' final norm, for the head
  std::vector<float> final_normed(num_wanted * h);
  const float* cos = decoder.cos.data_ptr<float>();
  const float* sin = decoder.sin.data_ptr<float>();
  const float scale = 1.0f / std::sqrt(float(d));
  const float eps = shape.eps;
  float* tap_out = num_taps ? taps.data_ptr<float>() : nullptr;
  const int64_t* path_slots = pass.path_slots.data();
  const int64_t scratch_size = (longest + LANES - 1) / LANES * LANES;
  // the residual of the previous layer's MLP, and the taps after it
  const auto finish_layer = [&](int64_t i, int64_t done) {
    float* row = hidden + i * h;
    for (int64_t k = 0; k < h; k += LANES) store_lanes(row + k, load_lanes(row + k) + load_lanes(&y[i * h + k]));
    for (int64_t j = 0; j < num_taps; j++)
      if (tap_layers[j] == done) std::memcpy(tap_out + (i * num_taps + j) * h, row, h * 4);
  };

  Team team;
  // every product's shares, one a thread (the layers' four products, then the head's)
  const int64_t num_products = num_layers * 4 + 1;
  std::vector<Share> shares(num_products * std::max(1, at::get_num_threads()));
  const auto product_units = [&](int64_t p) -> const std::vector<Unit>& {
    return p < num_layers * 4 ? decoder.layer_units[p / 4][p % 4] : decoder.head_units;
  };
  // attention tasks are taken in turn (rows attend over caches of different lengths): one
  // counter a layer
  std::vector<std::atomic<int64_t>> next_task(num_layers);
  for (auto& counter : next_task) counter.store(0);
#pragma omp parallel num_threads(num_threads)
  {
    // the team OpenMP gave (one thread where the pass is called inside another team)
    team.join(omp_get_num_threads());
    const Team::Member me{team, omp_get_thread_num(), omp_get_num_threads()};
    Share* const share = shares.data();  // product p's: share + p * me.threads
    for (int64_t p = 0; p < num_products; p++) {
      const auto [first, last] = me.share(int64_t(product_units(p).size()));
      share[p * me.threads + me.thread].set(first, last);
    }
    me.wait();
    // a task's queries' scores (each written before it is read)
    const std::unique_ptr<float[]> scores(new float[largest_task * scratch_size]);
    const auto [i0, i1] = me.share(n);  // this thread's positions in the per-position phases
    for (int64_t layer = 0; layer < num_layers; layer++) {
      const LayerWeights& w = decoder.layers[layer];
      const float* attn_norm = w.attn_norm.data_ptr<float>();
      const float* mlp_norm = w.mlp_norm.data_ptr<float>();
      // 1. The previous layer's residual, the attention norm, activations quantised.
      for (int64_t i = i0; i < i1; i++) {
        if (layer > 0) finish_layer(i, layer);
        rms_norm_row(hidden + i * h, h, attn_norm, eps, &normed[i * h]);
        by_hidden.quantise(&normed[i * h], h, i);
      }
      me.wait();
      // 2. Fused q/k/v (rotary order, bias added).
      product(me, w.qkv, decoder.layer_units[layer][0], by_hidden, n, qkv.data(),
              share + (layer * 4) * me.threads);
      // 3. Rotary on q and k; keys and values into each row's cache.
      for (int64_t i = i0; i < i1; i++) {
        float* at = &qkv[i * qkv_width];
        rotate_heads(at, shape.heads + shape.kv_heads, d, cos + positions[i] * d,
                     sin + positions[i] * d);
        const Row& row = rows[row_of[i]];
        const int64_t slot = row.start + (i - row.offset);
        for (int64_t g = 0; g < shape.kv_heads; g++) {
          const int64_t to = ((layer * shape.kv_heads + g) * row.capacity + slot) * d;
          std::memcpy(row.keys + to, at + q_width + g * d, d * 4);
          std::memcpy(row.values + to, at + q_width + kv_width + g * d, d * 4);
        }
      }
      me.wait();
      // 4. Attention, each query head over exactly its own keys.
      for (int64_t task = next_task[layer]++; task < int64_t(tasks.size());
           task = next_task[layer]++) {
        const AttentionTask& a = tasks[task];
        const Row& row = rows[a.row];
        const int64_t at = (layer * shape.kv_heads + a.kv_head) * row.capacity * d;
        Query queries[MAX_QUERIES];
        for (int64_t member = a.first; member < a.last; member++) {
          const int64_t i = row.offset + member / group;
          const int64_t head = a.kv_head * group + member % group;
          const int64_t depth = path_length(i);
          queries[member - a.first] = {
              &qkv[i * qkv_width + head * d], &attended[i * q_width + head * d],
              positions[i] + 1, depth ? row.tree_base : std::numeric_limits<int64_t>::max(),
              depth ? path_slots + pass.path_offsets[i] : nullptr};
        }
        attend(queries, a.last - a.first, row.keys + at, row.values + at, scale, scores.get(),
               scratch_size);
      }
      me.wait();
      for (int64_t i = i0; i < i1; i++) by_heads.quantise(&attended[i * q_width], q_width, i);
      me.wait();
      // 5. Output projection onto the residual stream; the MLP norm.
      product(me, w.out, decoder.layer_units[layer][1], by_heads, n, y.data(),
              share + (layer * 4 + 1) * me.threads);
      for (int64_t i = i0; i < i1; i++) {
        float* row = hidden + i * h;
        for (int64_t k = 0; k < h; k += LANES) store_lanes(row + k, load_lanes(row + k) + load_lanes(&y[i * h + k]));
        rms_norm_row(row, h, mlp_norm, eps, &normed[i * h]);
        by_hidden.quantise(&normed[i * h], h, i);
      }
      me.wait();
      // 6. SwiGLU MLP; its residual joins at the next layer's step 1.
      product(me, w.gate_up, decoder.layer_units[layer][2], by_hidden, n, gate_up.data(),
              share + (layer * 4 + 2) * me.threads);
      // (with fewer positions than threads, each position's blocks are split over the threads)
      const int64_t slices = n < me.threads ? me.threads : 1, blocks = by_inter.padded / QK;
      const auto [s0, s1] = me.share(n * slices);
      for (int64_t item = s0; item < s1; item++) {
        const int64_t i = item / slices, slice = item % slices;
        const int64_t b0 = blocks * slice / slices, b1 = blocks * (slice + 1) / slices;
        const int64_t e0 = std::min(inter, b0 * QK), e1 = std::min(inter, b1 * QK);
        swiglu_row(&gate_up[i * 2 * inter + e0], &gate_up[i * 2 * inter + inter + e0], e1 - e0,
                   &act[i * inter + e0]);
        by_inter.quantise(&act[i * inter], inter, i, b0, b1);
      }
      me.wait();
      product(me, w.down, decoder.layer_units[layer][3], by_inter, n, y.data(),
              share + (layer * 4 + 3) * me.threads);
    }
    for (int64_t i = i0; i < i1; i++) finish_layer(i, num_layers);
    // 7. The wanted positions' final norm and head.
    if (num_wanted) {
      me.wait();
      const auto [w0, w1] = me.share(num_wanted);
      const float* final_norm = decoder.final_norm.data_ptr<float>();
      for (int64_t j = w0; j < w1; j++) {
        rms_norm_row(hidden + wanted[j] * h, h, final_norm, eps, &final_normed[j * h]);
        by_final.quantise(&final_normed[j * h], h, j);
      }
      me.wait();
      product(me, decoder.head, decoder.head_units, by_final, num_wanted, logits.data_ptr<float>(),
              share + num_layers * 4 * me.threads);
    }
  }
}

}  // namespace vq
