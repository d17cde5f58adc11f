// The Python-facing operations, one module per kernel path (built with scalar.cpp or avx2.cpp): the product of float activations with a GGUF-quantised weight,
// exact dequantisation, and row lookup.
// verispec/quant/quant_kernels.py validates arguments first and says what is wrong; the checks here
// only keep a bad call from reading out of bounds.

#include "activations.h"
#include "dequantize.h"
#include "forward.h"
#include "greedy.h"
#include "rows.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <optional>
#include <vector>

namespace vq {

inline int64_t row_length(const torch::Tensor& weight, int64_t type) {
  TORCH_CHECK(known_type(int(type)), "unsupported GGUF type ", type);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kUInt8 &&
              weight.is_contiguous(), "weight must be a contiguous uint8 [N, row_bytes] tensor");
  const Layout shape = layout(int(type));
  TORCH_CHECK(weight.size(1) % shape.block_bytes == 0, "row_bytes is not a whole number of blocks");
  return weight.size(1) / shape.block_bytes * shape.block_size;
}

// y [R, N] = x [R, K] . dequantised weight [N, K]^T, in dot.h's order.
torch::Tensor matmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t type) {
  const int64_t K = row_length(weight, type);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
              x.size(1) == K, "x must be a contiguous float32 [R, K] tensor");
  const int64_t R = x.size(0), N = weight.size(0), padded = padded_length(K);
  // 1. activations quantised row by row
  auto codes = torch::empty({R, padded}, torch::kInt8);
  auto scales = torch::empty({R, padded / QK}, torch::kFloat32);
  auto sums = torch::empty({R, padded / 16}, torch::kFloat32);
  const Activations acts{codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
                         sums.data_ptr<float>(), padded};
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++)
      quantize_row(xs + r * K, K, padded, codes.data_ptr<int8_t>() + r * padded,
                   scales.data_ptr<float>() + r * (padded / QK),
                   sums.data_ptr<float>() + r * (padded / 16));
  });
  // 2. threads split the weight rows; each weight row meets its activations in tiles of 16
  auto y = torch::empty({R, N}, torch::kFloat32);
  float* out = y.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  const RowsFn rows = rows_for(int(type));
  at::parallel_for(0, N, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; n++)
      for (int64_t r0 = 0; r0 < R; r0 += MAX_TILE)
        rows(w + n * row_bytes, K, acts, r0, std::min<int64_t>(MAX_TILE, R - r0),
             out + r0 * N + n, N);
  });
  return y;
}

// Activations quantised row by row (dot.h's and panels.h's codes), with the panel sums.
struct Quantised {
  torch::Tensor codes, scales, sums, s32, b16;
  Activations view() const {
    return {codes.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data_ptr<float>(),
            codes.size(1)};
  }
  PanelSums panel_sums_view() const { return {s32.data_ptr<float>(), b16.data_ptr<int32_t>()}; }
};

// x [R, K] float32, checked.
inline Quantised quantise_for_panels(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
              x.size(1) == K, "x must be a contiguous float32 [R, K] tensor");
  const int64_t R = x.size(0), padded = padded_length(K);
  Quantised q{torch::empty({R, padded}, torch::kInt8), torch::empty({R, padded / QK}, torch::kFloat32),
              torch::empty({R, padded / 16}, torch::kFloat32),
              torch::empty({R, padded / QK}, torch::kFloat32),
              torch::empty({R, padded / 16}, torch::kInt32)};
  const Activations acts = q.view();
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, R, 1, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; r++) {
      quantize_row(xs + r * K, K, padded, q.codes.data_ptr<int8_t>() + r * padded,
                   q.scales.data_ptr<float>() + r * (padded / QK),
                   q.sums.data_ptr<float>() + r * (padded / 16));
      panel_sums(acts, r, q.s32.data_ptr<float>() + r * (padded / QK),
                 q.b16.data_ptr<int32_t>() + r * (padded / 16));
    }
  });
  return q;
}

// x [R, K] -> the activations the products read: codes [R, padded] int8, scales [R, padded /
// 32], sums [R, padded / 16], and the panel sums b16 [R, padded / 16] int32, s32 [R, padded /
// 32], each row quantised as a pass quantises it (forward.h's QuantisedRows).
std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "x must be a contiguous float32 [R, K] tensor");
  const int64_t R = x.size(0), K = x.size(1), padded = padded_length(K);
  auto codes = torch::empty({R, padded}, torch::kInt8);
  auto scales = torch::empty({R, padded / QK}, torch::kFloat32);
  auto sums = torch::empty({R, padded / 16}, torch::kFloat32);
  auto b16 = torch::empty({R, padded / 16}, torch::kInt32);
  auto s32 = torch::empty({R, padded / QK}, torch::kFloat32);
  for (int64_t r = 0; r < R; r++)
    quantize_row(x.data_ptr<float>() + r * K, K, padded, codes.data_ptr<int8_t>() + r * padded,
                 scales.data_ptr<float>() + r * (padded / QK),
                 sums.data_ptr<float>() + r * (padded / 16),
                 b16.data_ptr<int32_t>() + r * (padded / 16),
                 s32.data_ptr<float>() + r * (padded / QK));
  return {codes, scales, sums, b16, s32};
}

inline void check_panels(const torch::Tensor& weight, int64_t type) {
  TORCH_CHECK(has_panels(int(type)), "GGUF type ", type, " has no panel layout");
  TORCH_CHECK(weight.size(0) % PANEL == 0, "panels need a multiple of 16 rows");
}

// The file-layout weight [N, row_bytes] as panels of 16 rows: [N / 16, K / 256 * panel bytes].
torch::Tensor pack(const torch::Tensor& weight, int64_t type) {
  const int64_t K = row_length(weight, type);
  check_panels(weight, type);
  const int64_t panels = weight.size(0) / PANEL, bytes = panel_bytes(int(type), K);
  auto out = torch::empty({panels, bytes}, torch::kUInt8);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; p++) {
      pack_panel_of(int(type), w, row_bytes, PANEL * p, K, o + p * bytes);
    }
  });
  return out;
}

// y [R, N] = x [R, K] . the packed weight's rows, in panels.h's order, on this path's kernel.
torch::Tensor matmul_panels(const torch::Tensor& x, const torch::Tensor& panels, int64_t type,
                            int64_t K) {
  const PanelFn kernel = panels_for(int(type));
  TORCH_CHECK(kernel != nullptr, "the ", path_name(), " path has no panel kernel for type ", type);
  TORCH_CHECK(K > 0 && K % panel_block_size(int(type)) == 0 && panels.dim() == 2 &&
              panels.scalar_type() == torch::kUInt8 && panels.is_contiguous() &&
              panels.size(1) == panel_bytes(int(type), K),
              "panels must be a contiguous uint8 [N / 16, panel bytes] tensor");
  const Quantised q = quantise_for_panels(x, K);
  const int64_t R = x.size(0), N = panels.size(0) * PANEL, bytes = panels.size(1);
  const Activations acts = q.view();
  const PanelSums sums = q.panel_sums_view();
  auto y = torch::empty({R, N}, torch::kFloat32);
  float* out = y.data_ptr<float>();
  const uint8_t* w = panels.data_ptr<uint8_t>();
  at::parallel_for(0, panels.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; p++)
      for (int64_t r0 = 0; r0 < R; r0 += PANEL_TILE)
        kernel(w + p * bytes, K, acts, sums, r0, std::min<int64_t>(PANEL_TILE, R - r0),
               out + r0 * N + PANEL * p, N);
  });
  return y;
}

// panels.h's order in plain C++ from the file-layout weight: what matmul_panels must give.
torch::Tensor matmul_panels_reference(const torch::Tensor& x, const torch::Tensor& weight,
                                      int64_t type) {
  const int64_t K = row_length(weight, type);
  TORCH_CHECK(has_panels(int(type)), "GGUF type ", type, " has no panel layout");
  const Quantised q = quantise_for_panels(x, K);
  const int64_t R = x.size(0), N = weight.size(0), row_bytes = weight.size(1);
  const Activations acts = q.view();
  const PanelSums sums = q.panel_sums_view();
  auto y = torch::empty({R, N}, torch::kFloat32);
  float* out = y.data_ptr<float>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; n++) {
    const uint8_t* row = w + n * row_bytes;
    reference_of(int(type), row, K, acts, sums, 0, R, out + n, N);
  }
  return y;
}

// The weight's rows `ids` [M] (int64) dequantised: [M, K].
inline torch::Tensor get_rows(const torch::Tensor& weight, int64_t type, const torch::Tensor& ids) {
  const int64_t K = row_length(weight, type);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "ids must be a contiguous int64 [M] tensor");
  const int64_t M = ids.size(0), N = weight.size(0), row_bytes = weight.size(1);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; i++) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id out of range");
  auto out = torch::empty({M, K}, torch::kFloat32);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, M, 8, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; i++)
      dequantize_row(int(type), w + id[i] * row_bytes, K, o + i * K);
  });
  return out;
}

// The whole weight dequantised: [N, K].
inline torch::Tensor dequantize(const torch::Tensor& weight, int64_t type) {
  return get_rows(weight, type, torch::arange(weight.size(0), torch::kInt64));
}

}  // namespace vq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("path") = vq::path_name();
  m.def("matmul", &vq::matmul, "y = x . dequantise(weight)^T by int8 products");
  m.def("dequantize", &vq::dequantize, "exact float32 dequantisation");
  m.def("get_rows", &vq::get_rows, "rows of the weight, dequantised");
  m.def("pack", &vq::pack, "the weight as panels of 16 rows (panels.h)");
  m.def("quantize_activations", &vq::quantize_activations,
        "activations as a pass quantises them: codes, scales, sums, b16, s32");
  m.def("matmul_panels", &vq::matmul_panels, "y = x . packed weight^T in panels.h's order");
  m.def("matmul_panels_reference", &vq::matmul_panels_reference,
        "panels.h's order in plain C++, from the file's blocks");
  m.def("set_prefetch", [](bool lone_row, int64_t far) {
          TORCH_CHECK(far >= 0, "far must be >= 0, got ", far);
          vq::prefetch_lone_row() = lone_row;
          vq::prefetch_far() = far;
        }, "how panel kernels fetch blocks ahead (panels.h): into L1 for a lone row too, and "
        "into L2 `far` blocks ahead (0: not)", pybind11::arg("lone_row"), pybind11::arg("far"));
  m.def("greedy_top", [](const torch::Tensor& logits) {
          TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 &&
                      logits.stride(1) == 1, "logits: [rows, V] float32, rows contiguous");
          const int64_t rows = logits.size(0), width = logits.size(1);
          auto indices = torch::empty({rows}, torch::kInt64);
          auto probs = torch::empty({rows}, torch::kFloat32);
          for (int64_t r = 0; r < rows; r++) {
            const auto [index, prob] =
                vq::greedy_top(logits.data_ptr<float>() + r * logits.stride(0), width);
            indices.data_ptr<int64_t>()[r] = index;
            probs.data_ptr<float>()[r] = prob;
          }
          return std::make_pair(indices, probs);
        }, "each row's first largest logit's index and its softmax probability (greedy.h)",
        pybind11::arg("logits"));
  m.def("panel_types", [] {
    std::vector<int64_t> types;
    for (int t : vq::kPanelTypes)
      if (vq::panels_for(t) != nullptr) types.push_back(t);
    return types;
  }, "the types this path multiplies as panels");
  // The whole decoder pass (forward.h), its typed arguments made by keyword from Python
  // (runtime/native/gguf_model.py); module-local, as every path's module binds the same types
  // and tests load several in one process.
  py::class_<vq::Shape>(m, "Shape", py::module_local())
      .def(py::init([](int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       int64_t intermediate, double eps) {
             return vq::Shape{hidden, heads, kv_heads, head_dim, intermediate, float(eps)};
           }),
           py::kw_only(), py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"));
  py::class_<vq::Part>(m, "Part", py::module_local())
      .def(py::init<torch::Tensor, int64_t, bool, int64_t, int64_t, torch::Tensor>(),
           py::kw_only(), py::arg("data"), py::arg("type"), py::arg("panels"),
           py::arg("out_features"), py::arg("in_features"), py::arg("bias"));
  py::class_<vq::LayerWeights>(m, "LayerWeights", py::module_local())
      .def(py::init<torch::Tensor, torch::Tensor, vq::Projection, vq::Projection,
                    vq::Projection, vq::Projection>(),
           py::kw_only(), py::arg("attn_norm"), py::arg("mlp_norm"), py::arg("qkv"),
           py::arg("out"), py::arg("gate_up"), py::arg("down"));
  py::class_<vq::Decoder>(m, "Decoder", py::module_local())
      .def(py::init([](vq::Shape shape, std::vector<vq::LayerWeights> layers, torch::Tensor cos,
                       torch::Tensor sin, std::optional<torch::Tensor> final_norm,
                       vq::Projection head) {
             return vq::Decoder(shape, std::move(layers), std::move(cos), std::move(sin),
                                final_norm.value_or(torch::empty({0})), std::move(head));
           }),
           py::kw_only(), py::arg("shape"), py::arg("layers"), py::arg("cos"), py::arg("sin"),
           py::arg("final_norm") = py::none(), py::arg("head") = vq::Projection())
      .def_property_readonly("num_layers",
                             [](const vq::Decoder& decoder) { return decoder.layers.size(); })
      .def_property_readonly("has_head",
                             [](const vq::Decoder& decoder) { return !decoder.head.empty(); });
  py::class_<vq::PassRows>(m, "PassRows", py::module_local())
      .def(py::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                    std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<int64_t>>(),
           py::kw_only(), py::arg("keys"), py::arg("values"), py::arg("starts"),
           py::arg("lengths"), py::arg("tree_bases"), py::arg("path_slots"),
           py::arg("path_offsets"));
  m.def("forward_layers",
        [](torch::Tensor x, const vq::Decoder& decoder, const vq::PassRows& rows,
           torch::Tensor taps, const std::vector<int64_t>& tap_layers,
           const std::vector<int64_t>& wanted, std::optional<torch::Tensor> logits) {
          vq::forward_layers(std::move(x), decoder, rows, std::move(taps), tap_layers, wanted,
                             logits.value_or(torch::empty({0})));
        },
        py::arg("x"), py::arg("decoder"), py::arg("rows"), py::arg("taps"),
        py::arg("tap_layers"), py::arg("wanted") = std::vector<int64_t>(),
        py::arg("logits") = py::none(),
        "every decoder layer of one pass, and the wanted positions' logits (forward.h)");
  // A lone greedy draft row's chain in one call (greedy.h): (tokens, their cumulative
  // probabilities, passes run).
  m.def("greedy_chain",
        [](const vq::Decoder& decoder, const torch::Tensor& embedding, int64_t embedding_type,
           std::vector<int64_t> unread, torch::Tensor features, torch::Tensor keys,
           torch::Tensor values,
           int64_t start, int64_t steps, torch::Tensor logits, const torch::Tensor& head_ids,
           std::vector<double> prior, std::vector<double> keep_a, std::vector<double> keep_b,
           std::vector<double> more_a, std::vector<double> more_b) {
          TORCH_CHECK(vq::row_length(embedding, embedding_type) == decoder.shape.hidden,
                      "embedding rows must be hidden wide");
          const vq::ChainPrices prices{std::move(keep_a), std::move(keep_b), std::move(more_a),
                                       std::move(more_b), std::move(prior)};
          vq::Chain chain = vq::greedy_chain(decoder, embedding, embedding_type, unread,
                                             std::move(features), std::move(keys),
                                             std::move(values), start, steps,
                                             std::move(logits), head_ids, prices);
          return py::make_tuple(chain.tokens, chain.cumulative, chain.passes);
        },
        py::kw_only(), py::arg("decoder"), py::arg("embedding"), py::arg("embedding_type"),
        py::arg("unread"), py::arg("features"), py::arg("keys"), py::arg("values"),
        py::arg("start"), py::arg("steps"), py::arg("logits"), py::arg("head_ids"),
        py::arg("prior") = std::vector<double>(), py::arg("keep_a") = std::vector<double>(),
        py::arg("keep_b") = std::vector<double>(), py::arg("more_a") = std::vector<double>(),
        py::arg("more_b") = std::vector<double>(),
        "a lone greedy row's draft chain: embedding, layers, head and greedy_top a step");
}
