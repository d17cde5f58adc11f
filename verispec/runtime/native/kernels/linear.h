// verispec's C++ kernels (see kernels.cpp): linear layers over packed weights, on AMX tiles
// or with VDPBF16PS.

#pragma once

#include "common.h"

namespace {

// ---------------------------------------------------------------------------------------------
// Linear: y [M, N] = x [M, K] W^T (+ bias) (+ residual), W packed as [ceil(N/32), K/2, 32, 2]
// (pairs of K for 32 output features: the layout an AMX B tile reads). W is bfloat16, or int8
// with one fp32 scale per output feature (W = scale * int8): an int8 block is widened to
// bfloat16 (exactly: |q| <= 127) one tile at a time in L1, so memory streams half the bytes
// and the tiles multiply exactly what they would for bfloat16 weights.

struct Weight {
  const void* packed;
  const float* bias;    // [N] or null
  const float* scales;  // [N] for int8 weights, else null
  int64_t n, k;
};

Weight weight_of(const torch::Tensor& packed, const torch::Tensor& bias,
                 const torch::Tensor& scales, int64_t n) {
  const bool int8 = packed.scalar_type() == at::kChar;
  TORCH_CHECK(int8 || packed.scalar_type() == at::kBFloat16, "weights: bfloat16 or int8");
  TORCH_CHECK(!int8 || scales.numel() >= n, "int8 weights need a scale per output feature");
  return {packed.data_ptr(), bias.numel() ? bias.data_ptr<float>() : nullptr,
          int8 ? scales.data_ptr<float>() : nullptr, n, packed.size(1) * 2};
}
__attribute__((target("amx-tile,amx-bf16"))) void configure_tiles(int64_t rows) {
  TileConfig config;
  for (int tile = 0; tile < 3; tile++) {  // 0, 1: C; 2: A (rows x 32 of K)
    config.rows[tile] = uint8_t(rows);
    config.colsb[tile] = 64;
  }
  for (int tile = 3; tile < 5; tile++) {  // 3, 4: B (16 pairs of K x 16 features)
    config.rows[tile] = 16;
    config.colsb[tile] = 64;
  }
  load_tile_config(config);
}

// One K tile of B, int8 -> bfloat16: 16 pairs of K x 32 features x 2.
__attribute__((target("avx512f,avx512bf16"))) inline void widen_tile(const int8_t* in,
                                                                      bf16* out) {
  for (int64_t i = 0; i < (TILE_K / 2) * BLOCK * 2; i += 32) {
    const __m512 low = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
    const __m512 high = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i + 16))));
    _mm512_storeu_si512(out + i, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

// out [rows, 32] fp32 = x [rows, K] (row stride K) times one packed block [K/2, 32, 2]
// (unscaled for int8 weights).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bf16"))) void block_product(
    const bf16* x, int64_t rows, int64_t k, const void* block, bool int8, float* out) {
  alignas(64) bf16 widened[(TILE_K / 2) * BLOCK * 2];
  configure_tiles(rows);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t kb = 0; kb < k / TILE_K; kb++) {
    const int64_t at = kb * (TILE_K / 2) * BLOCK * 2;
    const bf16* b = static_cast<const bf16*>(block) + at;
    if (int8) {
      widen_tile(static_cast<const int8_t*>(block) + at, widened);
      b = widened;
    }
    _tile_loadd(2, x + kb * TILE_K, k * 2);
    _tile_loadd(3, b, BLOCK * 4);
    _tile_loadd(4, b + 32, BLOCK * 4);
    _tile_dpbf16ps(0, 2, 3);
    _tile_dpbf16ps(1, 2, 4);
  }
  _tile_stored(0, out, BLOCK * 4);
  _tile_stored(1, out + 16, BLOCK * 4);
  _tile_release();
}

// The same product without AMX: rows in register blocks of R (up to VECTOR_ROWS), each step
// multiplying one pair of K by the block's 32 x 2 weights with VDPBF16PS. A row keeps SPLIT
// partial sums per 16 features (pair p goes to sum p % SPLIT; added at the end) so that even a
// lone row has four independent chains; R x SPLIT x 2 accumulators must fit in 32 registers
// with the weights. Two sums a row leave room for more rows a block than four, and more rows
// a block mean fewer passes over the weights: each extra pass over a block costs a fixed share
// of a one-row pass however few rows it takes, which is also why a call's rows are split into
// blocks as even as they go (16 rows as 6 + 5 + 5, not 7 + 7 + 2). A row's sums run in the
// same order whatever R is, so its bits do not depend on the other rows.
constexpr int SPLIT = 2;  // the sums in vector_rows add two
constexpr int64_t VECTOR_ROWS = 7;  // rows per register block (block_product_vector's cases)
static_assert(VECTOR_ROWS * SPLIT * 2 + 3 <= 32,
              "the accumulators, two weight vectors and a broadcast fit AVX-512's 32 registers");

// `ahead` [ahead_lines of 64 bytes]: memory to prefetch into L2 meanwhile, spread over K (the
// thread's next weight block, or this pass's share of it): a wide call multiplies each block
// once per register block of rows, and without it the memory stream would idle meanwhile.
// steady: a few lines every step of K (one pass over the block: an even stream keeps the
// memory busy without bursts), else a tile's lines at the start of each tile (with several
// passes over a block, a steady stream gains nothing and can lose).
// keep: where int8 weights are widened to (for the later passes), or null.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void vector_rows(
    const bf16* x, int64_t k, const void* block, bool int8, float* out, const char* ahead,
    int64_t ahead_lines, bool steady, bf16* keep) {
  alignas(64) bf16 widened[(TILE_K / 2) * BLOCK * 2];
  __m512 acc[R][SPLIT][2];
  for (int r = 0; r < R; r++)
    for (int s = 0; s < SPLIT; s++) acc[r][s][0] = acc[r][s][1] = _mm512_setzero_ps();
  const int64_t tiles = k / TILE_K, lines_per_tile = (ahead_lines + tiles - 1) / tiles;
  const int64_t steps = tiles * (TILE_K / 2 / SPLIT);
  const int64_t lines_per_step = (ahead_lines + steps - 1) / steps;
  int64_t line = 0;
  for (int64_t kb = 0; kb < tiles; kb++) {
    if (ahead && !steady)
      for (line = kb * lines_per_tile;
           line < std::min(ahead_lines, (kb + 1) * lines_per_tile); line++)
        _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    const int64_t at = kb * (TILE_K / 2) * BLOCK * 2;
    const bf16* b = static_cast<const bf16*>(block) + at;
    if (int8) {
      b = keep ? keep + at : widened;
      widen_tile(static_cast<const int8_t*>(block) + at, const_cast<bf16*>(b));
    }
    for (int64_t pair = 0; pair < TILE_K / 2; pair += SPLIT) {
      if (ahead && steady)
        for (int64_t i = 0; i < lines_per_step && line < ahead_lines; i++, line++)
          _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
      for (int s = 0; s < SPLIT; s++) {
        const __m512bh low = (__m512bh)_mm512_loadu_si512(b + (pair + s) * BLOCK * 2);
        const __m512bh high = (__m512bh)_mm512_loadu_si512(b + (pair + s) * BLOCK * 2 + 32);
        for (int r = 0; r < R; r++) {
          int32_t bits;  // x[r, 2 (pair + s)], x[r, 2 (pair + s) + 1] in every lane
          std::memcpy(&bits, x + r * k + kb * TILE_K + 2 * (pair + s), 4);
          const __m512bh both = (__m512bh)_mm512_set1_epi32(bits);
          acc[r][s][0] = _mm512_dpbf16_ps(acc[r][s][0], both, low);
          acc[r][s][1] = _mm512_dpbf16_ps(acc[r][s][1], both, high);
        }
      }
    }
  }
  static_assert(SPLIT == 2, "the sums below add two");
  for (int r = 0; r < R; r++)
    for (int half = 0; half < 2; half++)
      _mm512_storeu_ps(out + r * BLOCK + 16 * half,
                       _mm512_add_ps(acc[r][0][half], acc[r][1][half]));
}

// next: the next block this thread multiplies (prefetched meanwhile), or null. int8 weights
// multiplied in more than one pass are widened to bfloat16 by the first pass into a copy the
// later passes read (exactly: they multiply the same values), not once a pass.
void block_product_vector(const bf16* x, int64_t rows, int64_t k, const void* block, bool int8,
                          float* out, const void* next) {
  const int64_t passes = (rows + VECTOR_ROWS - 1) / VECTOR_ROWS;
  const int64_t lines = k * BLOCK * (int8 ? 1 : 2) / 64, share = (lines + passes - 1) / passes;
  thread_local std::vector<bf16> widened;  // [K/2, 32, 2]: the first pass widens into it
  bf16* keep = nullptr;
  if (int8 && passes > 1) {
    widened.resize(k * BLOCK);
    keep = widened.data();
  }
  for (int64_t pass = 0, row = 0; pass < passes; pass++) {
    const int64_t size = (rows - row + (passes - pass) - 1) / (passes - pass);  // even passes
    const bf16* at = x + row * k;
    float* into = out + row * BLOCK;
    const char* ahead = next ? static_cast<const char*>(next) + pass * share * 64 : nullptr;
    const int64_t ahead_lines = std::min(share, lines - pass * share);
    const bool steady = passes == 1;
    static_assert(VECTOR_ROWS == 7, "one case below per register block size");
    switch (size) {
      case 1: vector_rows<1>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
      case 2: vector_rows<2>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
      case 3: vector_rows<3>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
      case 4: vector_rows<4>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
      case 5: vector_rows<5>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
      case 6: vector_rows<6>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
      default: vector_rows<7>(at, k, block, int8, into, ahead, ahead_lines, steady, keep); break;
    }
    if (keep) block = keep, int8 = false, keep = nullptr;  // later passes: the widened copy
    row += size;
  }
}

// dst [width] = round(out * scale + bias), or round(res + round(out * scale + bias)).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store_row(
    const float* out, int64_t width, const Weight& w, int64_t col, bf16* dst, const bf16* res) {
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 mask = lanes(width - j);
    __m512 v = _mm512_loadu_ps(out + j);
    if (w.scales) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, w.scales + col + j));
    if (w.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, w.bias + col + j));
    __m256bh rounded = _mm512_cvtneps_pbh(v);
    if (res) {
      const __m512 sum = _mm512_add_ps(_mm512_cvtpbh_ps(rounded),
                                       load_bf16(res + j, mask));
      rounded = _mm512_cvtneps_pbh(sum);
    }
    _mm256_mask_storeu_epi16(dst + j, mask, (__m256i)rounded);
  }
}

// y = round(x W^T + bias); with residual: y = round(residual + round(x W^T + bias)) (residual
// may be y itself: each element is read and written by the thread that owns its block).
// AMX multiplies a block by TILE_M rows at a time; the vector path takes all of them in one
// call, so the next block's prefetch spreads over every pass (in chunks of TILE_M rows the
// chunks before the last left memory idle: 17 rows cost 1.5x 16 rows).
void linear_into(const bf16* x, int64_t m, const Weight& w, bf16* y, const bf16* residual) {
  const int64_t blocks = (w.n + BLOCK - 1) / BLOCK;
  const int64_t element = w.scales ? 1 : 2;  // bytes per weight
  const int64_t chunk = use_amx ? TILE_M : m;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> out;  // [chunk, BLOCK]
    if (int64_t(out.size()) < chunk * BLOCK) out.resize(chunk * BLOCK);
    for (int64_t block = first; block < last; block++) {
      const int64_t col = block * BLOCK, width = std::min(BLOCK, w.n - col);
      const char* packed = static_cast<const char*>(w.packed) + block * w.k * BLOCK * element;
      for (int64_t row = 0; row < m; row += chunk) {
        const int64_t rows = std::min(chunk, m - row);
        if (use_amx)
          block_product(x + row * w.k, rows, w.k, packed, w.scales != nullptr, out.data());
        else
          block_product_vector(x + row * w.k, rows, w.k, packed, w.scales != nullptr, out.data(),
                               block + 1 < last ? packed + w.k * BLOCK * element : nullptr);
        for (int64_t i = 0; i < rows; i++)
          store_row(out.data() + i * BLOCK, width, w, col, y + (row + i) * w.n + col,
                    residual ? residual + (row + i) * w.n + col : nullptr);
      }
    }
  });
}

}  // namespace
