// The Python-facing operations, one module per kernel path (built with scalar.cpp or avx2.cpp): the product of float activations with a GGUF-quantised weight,
// exact dequantisation, and row lookup.
// verispec/quant/kernels.py validates arguments first and says what is wrong; the checks here
// only keep a bad call from reading out of bounds.

#include "activations.h"
#include "dequantize.h"
#include "rows.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

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
}
