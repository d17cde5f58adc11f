// verispec's CPU kernels: a bfloat16 decoder forward for Llama-family models on CPUs with AMX
// (Sapphire Rapids and later) or, without AMX, with AVX512-BF16 (AMD Zen 4 and later, Cooper
// Lake): the same packed weights, products on AMX tiles or with VDPBF16PS.
//
// Why: for a small model on a few cores, an eager PyTorch decode step is mostly per-op overhead
// (~20 small ops a layer, each oneDNN call with a fixed cost); here a whole pass is one call,
// and a step runs close to the bound of reading the weights once.
//
// Batch invariance by construction: every output element is computed by one thread in an order
// that depends only on its own inputs, never on how many positions or rows the pass holds.
//   - linear: AMX tiles of up to 16 rows, or AVX-512 registers of up to 7; a row's dot products
//     run over K in the same order whatever the other rows are (rows do not interact);
//   - attention in short passes (decode, verification): each query over exactly its own keys
//     0..p; no score depends on another query (AMX tiles, or the same VDPBF16PS sums whether
//     a block of keys is transposed for many queries or not), its softmax and weighted sum run
//     in key order (attend_group on AMX, attend_queries without);
//   - norms, rotary, SwiGLU: elementwise or per row.
// So a position's logits are the same bits in a pass of 1, K+1 or many positions and rows
// (tests/test_kernels.py checks it), and speculative greedy equals plain greedy. Prompt passes
// (more than `short_pass` positions) attend with torch's fused causal kernel, whose rounding
// depends on their length; they run in passes of their own (runtime/native/native_runner.py).
//
// Rounding mirrors transformers' bfloat16 modules: every op's output is rounded to bfloat16,
// accumulations run in fp32.
//
// The parts (one translation unit): kernels/common.h (bf16 helpers, the ISA switch),
// kernels/linear.h (linear layers), kernels/attention.h (attention in short passes),
// kernels/elementwise.h (norms, rotary, SwiGLU); here the whole forward, packing and the
// Python bindings.

#include "kernels/attention.h"
#include "kernels/common.h"
#include "kernels/elementwise.h"
#include "kernels/linear.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <type_traits>
#include <vector>

namespace {

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps;  // the RMS norms'
};

// One linear layer as the kernels hold it, packed once at load (`pack`).
struct PackedLinear {
  torch::Tensor tiles;   // [ceil(N/32), K/2, 32, 2] bfloat16 or int8
  torch::Tensor scales;  // [N] fp32 for int8 tiles, else empty
  torch::Tensor bias;    // [N] fp32, or empty
  int64_t out_features;  // N

  PackedLinear(torch::Tensor tiles_, torch::Tensor scales_, torch::Tensor bias_, int64_t n)
      : tiles(std::move(tiles_)), scales(std::move(scales_)), bias(std::move(bias_)),
        out_features(n) {
    TORCH_CHECK(tiles.dim() == 4 && tiles.is_contiguous(), "tiles: pack(weight)'s layout");
    TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == n &&
                                      bias.is_contiguous()), "bias: [out_features] fp32");
    weight();  // checks the dtype and the scales
  }
  int64_t in_features() const { return tiles.size(1) * 2; }
  Weight weight() const { return weight_of(tiles, bias, scales, out_features); }
};

// One decoder layer's weights (runtime.native.llama.LayerWeights, packed).
struct LayerWeights {
  torch::Tensor attn_norm, mlp_norm;  // [H] bfloat16
  PackedLinear qkv;                   // H -> (heads + 2 kv_heads) d
  PackedLinear out;                   // heads d -> H
  PackedLinear gate_up;               // H -> 2 I
  PackedLinear down;                  // I -> H
};

// What a model's forward needs besides the rows of a pass, built once at load and checked
// against each other then (a wrong layout fails here, not as garbage in the middle of a pass).
struct Decoder {
  Shape shape;
  std::vector<LayerWeights> layers;
  torch::Tensor cos, sin;  // [max_positions, d] bfloat16 rotary tables
  int64_t short_pass;      // passes up to this many positions per row attend batch-invariantly

  Decoder(Shape shape_, std::vector<LayerWeights> layers_, torch::Tensor cos_,
          torch::Tensor sin_, int64_t short_pass_)
      : shape(shape_), layers(std::move(layers_)), cos(std::move(cos_)), sin(std::move(sin_)),
        short_pass(short_pass_) {
    const int64_t h = shape.hidden, d = shape.head_dim, inter = shape.intermediate;
    TORCH_CHECK(d <= MAX_HEAD_DIM && d % 2 == 0, "head_dim must be even and at most ",
                MAX_HEAD_DIM);
    TORCH_CHECK(shape.heads % shape.kv_heads == 0, "heads must be a multiple of kv_heads");
    TORCH_CHECK(short_pass >= 1, "short_pass must be at least 1");
    for (const torch::Tensor* table : {&cos, &sin})
      TORCH_CHECK(table->scalar_type() == at::kBFloat16 && table->is_contiguous() &&
                  table->dim() == 2 && table->size(1) == d, "rotary tables: [positions, d]");
    const auto check = [](const PackedLinear& linear, int64_t n, int64_t k, const char* name) {
      TORCH_CHECK(linear.out_features == n && linear.in_features() == k, name, ": ",
                  linear.in_features(), " -> ", linear.out_features, ", the shape says ", k,
                  " -> ", n);
    };
    for (const LayerWeights& layer : layers) {
      for (const torch::Tensor* norm : {&layer.attn_norm, &layer.mlp_norm})
        TORCH_CHECK(norm->scalar_type() == at::kBFloat16 && norm->is_contiguous() &&
                    norm->numel() == h, "norm weights: [hidden] bfloat16");
      check(layer.qkv, (shape.heads + 2 * shape.kv_heads) * d, h, "qkv");
      check(layer.out, h, shape.heads * d, "out");
      check(layer.gate_up, 2 * inter, h, "gate_up");
      check(layer.down, h, inter, "down");
    }
  }
};

// The rows of one pass: row r's new positions starts[r]..starts[r]+lengths[r]-1 into its cache
// keys[r], values[r] [layers, kv_heads, capacity, d]. Token trees (tree_bases empty: none):
// row r with tree_bases[r] >= 0 holds a tree from that slot on, and new slot i (over the whole
// pass) attends over slots 0..base-1 and then path_slots[path_offsets[i]..path_offsets[i+1]-1]
// (its ancestors and itself), at position base - 1 + its depth; an empty path is an ordinary
// slot.
struct PassRows {
  std::vector<torch::Tensor> keys, values;
  std::vector<int64_t> starts, lengths;
  std::vector<int64_t> tree_bases, path_slots, path_offsets;
};

struct QueryGroup {  // queries first..last-1 (t * group + head in group) of one row's KV head
  int64_t row, kv_head, first, last;
};

// body(task, scratch) for every task in [0, n). balance: the threads take the next task as they
// finish one, for a batch, whose rows attend over caches of different lengths (a static split
// can leave one thread all the long rows while the others wait). Otherwise (one sequence) each
// thread takes a contiguous share, so the query heads of one KV head share a core and read its
// keys once. Which thread runs a task does not change its result.
template <typename Scratch, typename Body>
void parallel_tasks(int64_t n, bool balance, const Body& body) {
  if (!balance) {
    at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
      Scratch scratch;
      for (int64_t task = first; task < last; task++) body(task, scratch);
    });
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t task = next++; task < n; task = next++) body(task, scratch);
  });
}

struct GroupScratch {
  std::vector<float> scores;
  std::vector<bf16> weights;
  std::vector<Query> queries;
  std::vector<bf16> tails;  // tree nodes' staged keys and values
};

struct Row {
  bf16* keys;    // this row's cache [layers, kv_heads, capacity, d]
  bf16* values;
  int64_t capacity, start, length, offset;  // new slots start..start+length-1 at x[offset..]
  int64_t tree_base;  // -1, or the first slot of a token tree (llama.py: TreeLinks)
};

// A tree node's keys (or values) of one KV head, laid out as the chain to it holds them: rows
// from..from+rows-1 of [slots 0..base-1, then its path's slots], zero past the path.
void stage_path(const bf16* cache, int64_t base, const int64_t* path, int64_t path_length,
                int64_t from, int64_t rows, int64_t d, bf16* out) {
  std::memset(out, 0, rows * d * 2);
  for (int64_t j = from; j < std::min(from + rows, base + path_length); j++) {
    const int64_t slot = j < base ? j : path[j - base];
    std::memcpy(out + (j - from) * d, cache + slot * d, d * 2);
  }
}

// A prompt pass's attention (queries offset..offset+length-1 of qkv [N, width]) with torch's
// fused causal kernel, into attended [N, heads d]: O(T^2) work, which one query at a time would
// do slowly; its rounding depends on T, which is why prompts run in passes of their own.
void attend_prompt(const Row& row, size_t layer, const Shape& shape, const bf16* qkv,
                   int64_t qkv_width, bf16* attended) {
  const int64_t d = shape.head_dim, t = row.length, end = row.start + row.length;
  const auto options = torch::TensorOptions().dtype(at::kBFloat16);
  auto q = torch::from_blob(const_cast<bf16*>(qkv) + row.offset * qkv_width,
                            {1, shape.heads, t, d}, {0, d, qkv_width, 1}, options);
  const int64_t layer_at = int64_t(layer) * shape.kv_heads * row.capacity * d;
  const std::vector<int64_t> kv_sizes{1, shape.kv_heads, end, d};
  const std::vector<int64_t> kv_strides{0, row.capacity * d, d, 1};
  const int64_t group = shape.heads / shape.kv_heads;
  auto keys = torch::from_blob(row.keys + layer_at, kv_sizes, kv_strides, options)
                  .repeat_interleave(group, 1);
  auto values = torch::from_blob(row.values + layer_at, kv_sizes, kv_strides, options)
                    .repeat_interleave(group, 1);
  std::optional<at::Tensor> mask;
  if (row.start > 0)
    mask = torch::ones({t, end}, torch::TensorOptions().dtype(at::kBool)).tril(row.start);
  auto out = at::scaled_dot_product_attention(q.contiguous(), keys, values, mask, 0.0,
                                              row.start == 0);  // [1, heads, T, d]
  auto into = torch::from_blob(attended + row.offset * shape.heads * d, {1, shape.heads, t, d},
                               {0, d, shape.heads * d, 1}, options);
  into.copy_(out);
}

// The decoder layers over every row's new positions; x [N, H] is updated in place, each row's
// keys and values at its new positions are written into its cache, and taps
// [N, len(tap_layers), H] gets the hidden state after the first tap_layers[j] layers.
void forward_layers(torch::Tensor x, const Decoder& decoder, const PassRows& pass,
                    torch::Tensor taps, const std::vector<int64_t>& tap_layers) {
  const Shape& shape = decoder.shape;
  const int64_t short_pass = decoder.short_pass;
  const std::vector<torch::Tensor>&keys = pass.keys, &values = pass.values;
  const std::vector<int64_t>&starts = pass.starts, &lengths = pass.lengths;
  const std::vector<int64_t>&tree_bases = pass.tree_bases, &path_slots = pass.path_slots,
                            &path_offsets = pass.path_offsets;
  const int64_t n = x.size(0), h = shape.hidden, d = shape.head_dim;
  const int64_t q_width = shape.heads * d, kv_width = shape.kv_heads * d;
  const int64_t qkv_width = q_width + 2 * kv_width;
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) == h,
              "x: [N, hidden] bfloat16");
  TORCH_CHECK(keys.size() == starts.size() && values.size() == starts.size() &&
              lengths.size() == starts.size(), "one cache, start and length a row");
  const int64_t num_taps = int64_t(tap_layers.size());
  TORCH_CHECK(num_taps == 0 || (taps.is_contiguous() && taps.scalar_type() == at::kBFloat16 &&
                                taps.size(0) == x.size(0) && taps.size(1) == num_taps &&
                                taps.size(2) == h), "taps must be [N, len(tap_layers), H]");

  const bool trees = !tree_bases.empty();
  TORCH_CHECK(!trees || (tree_bases.size() == starts.size() &&
                         int64_t(path_offsets.size()) == n + 1), "tree arguments' sizes");
  const auto path_length = [&](int64_t i) {
    return trees ? path_offsets[i + 1] - path_offsets[i] : int64_t(0);
  };
  std::vector<Row> rows;
  std::vector<int64_t> positions;  // [N]: each new slot's position in its sequence
  int64_t offset = 0;
  for (size_t r = 0; r < starts.size(); r++) {
    TORCH_CHECK(keys[r].is_contiguous() && values[r].is_contiguous() &&
                keys[r].scalar_type() == at::kBFloat16 && values[r].sizes() == keys[r].sizes() &&
                keys[r].dim() == 4 && keys[r].size(0) == int64_t(decoder.layers.size()) &&
                keys[r].size(1) == shape.kv_heads && keys[r].size(3) == d,
                "caches: [layers, kv_heads, capacity, d] bfloat16");
    const int64_t base = trees ? tree_bases[r] : -1;
    rows.push_back({reinterpret_cast<bf16*>(keys[r].data_ptr()),
                    reinterpret_cast<bf16*>(values[r].data_ptr()), keys[r].size(2), starts[r],
                    lengths[r], offset, base});
    TORCH_CHECK(starts[r] + lengths[r] <= keys[r].size(2), "cache too short");
    TORCH_CHECK(base < 0 || (base >= 1 && lengths[r] <= short_pass), "bad tree row");
    for (int64_t t = 0; t < lengths[r]; t++) {
      const int64_t i = offset + t, depth = path_length(offset + t);
      TORCH_CHECK(depth == 0 || base >= 0, "a path in a row without a tree");
      for (int64_t j = 0; j < depth; j++) {
        const int64_t slot = path_slots[path_offsets[i] + j];
        TORCH_CHECK(slot >= base && slot < starts[r] + lengths[r], "path slot out of the tree");
      }
      positions.push_back(depth ? base - 1 + depth : starts[r] + t);
    }
    offset += lengths[r];
  }
  TORCH_CHECK(offset == n, "rows hold ", offset, " positions, x ", n);

  auto options = x.options();
  bf16* hidden = reinterpret_cast<bf16*>(x.data_ptr());
  auto normed_t = torch::empty({n, h}, options);
  auto qkv_t = torch::empty({n, qkv_width}, options);
  auto attended_t = torch::empty({n, q_width}, options);
  auto gate_up_t = torch::empty({n, 2 * shape.intermediate}, options);
  auto act_t = torch::empty({n, shape.intermediate}, options);
  bf16* normed = reinterpret_cast<bf16*>(normed_t.data_ptr());
  bf16* qkv = reinterpret_cast<bf16*>(qkv_t.data_ptr());
  bf16* attended = reinterpret_cast<bf16*>(attended_t.data_ptr());
  bf16* gate_up = reinterpret_cast<bf16*>(gate_up_t.data_ptr());
  bf16* act = reinterpret_cast<bf16*>(act_t.data_ptr());
  const bf16* cos_table = reinterpret_cast<const bf16*>(decoder.cos.data_ptr());
  const bf16* sin_table = reinterpret_cast<const bf16*>(decoder.sin.data_ptr());
  const float scale = 1.0f / std::sqrt(float(d));
  // The same queries by KV head, in groups of up to 16 (member = t * group + head in group).
  const int64_t group = shape.heads / shape.kv_heads;
  std::vector<QueryGroup> groups;
  for (size_t r = 0; r < rows.size(); r++) {
    if (rows[r].length > short_pass) continue;
    const int64_t members = rows[r].length * group;
    // One query head per task for a lone decode row (work for both threads), else up to 16:
    // AMX tiles of 16, or on AVX-512 (any size) as even as they go.
    const int64_t tasks = (members + TILE_M - 1) / TILE_M;
    const int64_t size = rows.size() == 1 && rows[r].length == 1 ? 1
                         : use_amx && d % TILE_K == 0 ? TILE_M : (members + tasks - 1) / tasks;
    for (int64_t kv_head = 0; kv_head < shape.kv_heads; kv_head++)
      for (int64_t first = 0; first < members; first += size)
        groups.push_back({int64_t(r), kv_head, first, std::min(members, first + size)});
  }
  // A batch's costliest tasks first (queries x keys), so the threads finish together.
  const bool balance = rows.size() > 1;
  const auto cost = [&](const QueryGroup& g) {
    return (g.last - g.first) * (rows[g.row].start + rows[g.row].length);
  };
  if (balance)
    std::stable_sort(groups.begin(), groups.end(),
                     [&](const QueryGroup& a, const QueryGroup& b) { return cost(a) > cost(b); });

  for (size_t layer = 0; layer < decoder.layers.size(); layer++) {
    const LayerWeights& w = decoder.layers[layer];
    const bf16* attn_norm = reinterpret_cast<const bf16*>(w.attn_norm.data_ptr());
    const bf16* mlp_norm = reinterpret_cast<const bf16*>(w.mlp_norm.data_ptr());
    // 1. Norm, fused q/k/v, rotary on q and k.
    rms_norm(hidden, n, h, attn_norm, shape.eps, normed);
    linear_into(normed, n, w.qkv.weight(), qkv, nullptr);
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; i++)
        rotate(qkv + i * qkv_width, shape.heads + shape.kv_heads, d,
               cos_table + positions[i] * d, sin_table + positions[i] * d);
    });
    // 2. Keys and values into each row's cache.
    for (const Row& row : rows) {
      for (int64_t t = 0; t < row.length; t++) {
        const bf16* src = qkv + (row.offset + t) * qkv_width + q_width;
        for (int64_t g = 0; g < shape.kv_heads; g++) {
          const int64_t at = ((int64_t(layer) * shape.kv_heads + g) * row.capacity +
                              row.start + t) * d;
          std::memcpy(row.keys + at, src + g * d, d * 2);
          std::memcpy(row.values + at, src + kv_width + g * d, d * 2);
        }
      }
    }
    // 3. Attention. Short passes (decode, verification): tasks of queries that share a KV head,
    // each over exactly its own keys. Prompt passes: torch's fused causal kernel, row by row.
    const bool amx = use_amx && d % TILE_K == 0;
    const auto attend_task = [&](int64_t task, GroupScratch& s) {
      const QueryGroup& g = groups[task];
      const Row& row = rows[g.row];
      const int64_t base = (int64_t(layer) * shape.kv_heads + g.kv_head) * row.capacity * d;
      // A tree's nodes read their keys from the 32-key block holding slot base on in their
      // own staged copies (one per node, shared by its query heads).
      const int64_t tail_start = row.tree_base < 0 ? INT64_MAX : row.tree_base / 32 * 32;
      const int64_t tail_rows = row.tree_base < 0 ? 0
          : (row.start + row.length - tail_start + 31) / 32 * 32;
      const int64_t nodes = (g.last - 1) / group - g.first / group + 1;
      if (tail_rows) s.tails.resize(2 * nodes * tail_rows * d);
      s.queries.clear();
      for (int64_t member = g.first; member < g.last; member++) {
        const int64_t t = member / group, head = g.kv_head * group + member % group;
        const int64_t i = row.offset + t;
        Query query{qkv + i * qkv_width + head * d, positions[i] + 1,
                    attended + i * q_width + head * d};
        if (path_length(i)) {
          bf16* tail = s.tails.data() + 2 * (t - g.first / group) * tail_rows * d;
          if (member % group == 0 || member == g.first) {
            const int64_t* path = path_slots.data() + path_offsets[i];
            stage_path(row.keys + base, row.tree_base, path, path_length(i), tail_start,
                       tail_rows, d, tail);
            stage_path(row.values + base, row.tree_base, path, path_length(i), tail_start,
                       tail_rows, d, tail + tail_rows * d);
          }
          query.tail_keys = tail, query.tail_values = tail + tail_rows * d;
          query.tail_rows = tail_rows;
        }
        s.queries.push_back(query);
      }
      if (amx)
        attend_group(s.queries.data(), int64_t(s.queries.size()), row.keys + base,
                     row.values + base, row.capacity, d, scale, s.scores, s.weights,
                     tail_start);
      else
        attend_queries(s.queries.data(), int64_t(s.queries.size()), row.keys + base,
                       row.values + base, d, scale, s.scores, s.weights, tail_start);
    };
    parallel_tasks<GroupScratch>(int64_t(groups.size()), balance, attend_task);
    for (const Row& row : rows)
      if (row.length > short_pass) attend_prompt(row, layer, shape, qkv, qkv_width, attended);
    // 4. Output projection onto the residual stream.
    linear_into(attended, n, w.out.weight(), hidden, hidden);
    // 5. SwiGLU MLP onto the residual stream.
    rms_norm(hidden, n, h, mlp_norm, shape.eps, normed);
    linear_into(normed, n, w.gate_up.weight(), gate_up, nullptr);
    const int64_t inter = shape.intermediate;
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; i++)
        swiglu(gate_up + i * 2 * inter, inter, act + i * inter);
    });
    linear_into(act, n, w.down.weight(), hidden, hidden);
    // 6. Keep the hidden state where a tap asks for it.
    for (int64_t j = 0; j < num_taps; j++) {
      if (tap_layers[j] != int64_t(layer) + 1) continue;
      bf16* out = reinterpret_cast<bf16*>(taps.data_ptr());
      for (int64_t i = 0; i < n; i++)
        std::memcpy(out + (i * num_taps + j) * h, hidden + i * h, h * 2);
    }
  }
}

// [N, K] bfloat16 or int8 -> [ceil(N/32), K/2, 32, 2], zero rows padding N.
torch::Tensor pack(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 ||
                                    weight.scalar_type() == at::kChar));
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(k % TILE_K == 0, "in_features must be a multiple of ", TILE_K);
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  auto padded = torch::zeros({blocks * BLOCK, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({blocks, BLOCK, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed,
                     const torch::Tensor& bias, const torch::Tensor& scales, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16);
  auto input = x.contiguous();
  TORCH_CHECK(input.size(1) == packed.size(1) * 2, "in_features mismatch");
  auto y = torch::empty({input.size(0), n}, input.options());
  linear_into(reinterpret_cast<const bf16*>(input.data_ptr()), input.size(0),
              weight_of(packed, bias, scales, n), reinterpret_cast<bf16*>(y.data_ptr()),
              nullptr);
  return y;
}

// The AVX512-BF16 path's attention alone (tests): queries [M, d] over keys and values [C, d]
// bfloat16, query m over keys 0..counts[m]-1; together: all M in one call (as the queries of a
// KV head in a pass), else one call a query (as a lone decode step's). -> (out [M, d] bfloat16,
// the softmax's numerators exp(score - max) [M, C] fp32, zero past a query's keys: where a
// different order of the score sums shows, which the bf16 outputs mostly round away).
std::vector<torch::Tensor> attend(const torch::Tensor& queries, const torch::Tensor& keys,
                                  const torch::Tensor& values,
                                  const std::vector<int64_t>& counts, bool together) {
  TORCH_CHECK(queries.dim() == 2 && keys.dim() == 2 && values.sizes() == keys.sizes());
  TORCH_CHECK(queries.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
              values.scalar_type() == at::kBFloat16);
  TORCH_CHECK(queries.is_contiguous() && keys.is_contiguous() && values.is_contiguous());
  const int64_t m = queries.size(0), d = queries.size(1), c = keys.size(0);
  TORCH_CHECK(keys.size(1) == d && int64_t(counts.size()) == m && d % 2 == 0 &&
              d <= MAX_HEAD_DIM);
  for (int64_t count : counts) TORCH_CHECK(count >= 1 && count <= c);
  auto out = torch::empty({m, d}, queries.options());
  auto numerators = torch::zeros({m, c}, torch::TensorOptions().dtype(at::kFloat));
  const auto* q = reinterpret_cast<const bf16*>(queries.data_ptr());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  std::vector<Query> all;
  for (int64_t i = 0; i < m; i++) all.push_back({q + i * d, counts[i], o + i * d});
  std::vector<float> scores;
  std::vector<bf16> weights;
  const float scale = 1.0f / std::sqrt(float(d));
  const auto* k = reinterpret_cast<const bf16*>(keys.data_ptr());
  const auto* v = reinterpret_cast<const bf16*>(values.data_ptr());
  for (int64_t first = 0; first < m; first += together ? m : 1) {
    const int64_t size = together ? m : 1;
    attend_queries(all.data() + first, size, k, v, d, scale, scores, weights);
    int64_t longest = 0;  // the kernel's scores: [size, score_stride(longest)]
    for (int64_t i = first; i < first + size; i++) longest = std::max(longest, counts[i]);
    for (int64_t i = first; i < first + size; i++)
      std::memcpy(numerators.data_ptr<float>() + i * c,
                  scores.data() + (i - first) * score_stride(longest), counts[i] * 4);
  }
  return {out, numerators};
}

// Which instruction set the products run on: "amx" (a CPU with AMX bf16 whose OS lets this
// process use the tiles), "avx512-bf16", or "" (neither: the kernels cannot run here).
// allow_amx false keeps AMX off where it exists (to compare the paths).
std::string enable(bool allow_amx) {
  if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl"))
    return "";
  use_amx = allow_amx && __builtin_cpu_supports("amx-bf16") &&
            syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return use_amx ? "amx" : "avx512-bf16";
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("enable", &enable);
  m.def("pack", &pack);
  m.def("linear", &linear);
  // The typed arguments of forward_layers, made by keyword from Python
  // (runtime.native.llama.NativeLlama._fused_weights / _fused_layers).
  py::class_<Shape>(m, "Shape")
      .def(py::init([](int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t intermediate, double eps) {
             return Shape{hidden, heads, kv_heads, head_dim, intermediate, float(eps)};
           }),
           py::kw_only(), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"))
      .def_readonly("hidden", &Shape::hidden)
      .def_readonly("heads", &Shape::heads)
      .def_readonly("kv_heads", &Shape::kv_heads)
      .def_readonly("head_dim", &Shape::head_dim)
      .def_readonly("intermediate", &Shape::intermediate)
      .def_readonly("eps", &Shape::eps);
  py::class_<PackedLinear>(m, "PackedLinear")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, int64_t>(), py::kw_only(),
           py::arg("tiles"), py::arg("scales"), py::arg("bias"), py::arg("out_features"))
      .def_readonly("out_features", &PackedLinear::out_features);
  py::class_<LayerWeights>(m, "LayerWeights")
      .def(py::init<torch::Tensor, torch::Tensor, PackedLinear, PackedLinear, PackedLinear,
                    PackedLinear>(),
           py::kw_only(), py::arg("attn_norm"), py::arg("mlp_norm"), py::arg("qkv"),
           py::arg("out"), py::arg("gate_up"), py::arg("down"));
  py::class_<Decoder>(m, "Decoder")
      .def(py::init<Shape, std::vector<LayerWeights>, torch::Tensor, torch::Tensor, int64_t>(),
           py::kw_only(), py::arg("shape"), py::arg("layers"), py::arg("cos"), py::arg("sin"),
           py::arg("short_pass"))
      .def_property_readonly("num_layers",
                             [](const Decoder& decoder) { return decoder.layers.size(); });
  py::class_<PassRows>(m, "PassRows")
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>>(),
           py::kw_only(), py::arg("keys"), py::arg("values"), py::arg("starts"),
           py::arg("lengths"), py::arg("tree_bases"), py::arg("path_slots"),
           py::arg("path_offsets"));
  m.def("forward_layers", &forward_layers, py::arg("x"), py::arg("decoder"), py::arg("rows"),
        py::arg("taps"), py::arg("tap_layers"));
  m.def("attend", &attend);
}
