// verispec's CPU kernels: a bfloat16 decoder forward for Llama-family models on CPUs with AMX
// (Sapphire Rapids and later) or, without AMX, with AVX512-BF16 (AMD Zen 4 and later, Cooper
// Lake): the same packed weights, products on AMX tiles or with VDPBF16PS.
//
// Why: on a 2-core CPU a SmolLM2-135M decode step in eager PyTorch spent ~15 ms in per-op
// overhead (~20 small ops a layer) and called oneDNN 121 times at ~50 us of fixed cost each
// (33.5 ms a step); here a whole pass is one call (12.4 ms a step, 11.7 ms the bandwidth bound).
//
// Batch invariance by construction: every output element is computed by one thread in an order
// that depends only on its own inputs, never on how many positions or rows the pass holds.
//   - linear: AMX tiles of up to 16 rows, or AVX-512 registers of up to 8; a row's dot products
//     run over K in the same order whatever the other rows are (rows do not interact);
//   - attention in short passes (decode, verification): each query over exactly its own keys
//     0..p; its scores come from AMX tiles in which no score depends on another query or key,
//     its softmax and weighted sum run in key order (attend_group);
//   - norms, rotary, SwiGLU: elementwise or per row.
// So a position's logits are the same bits in a pass of 1, K+1 or many positions and rows
// (tests/test_kernels.py checks it), and speculative greedy equals plain greedy. Prompt passes
// (more than `short_pass` positions) attend with torch's fused causal kernel, whose rounding
// depends on their length; they run in passes of their own (verispec.native.runner).
//
// Rounding mirrors transformers' bfloat16 modules: every op's output is rounded to bfloat16,
// accumulations run in fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace {

using bf16 = uint16_t;
constexpr int64_t BLOCK = 32;  // output features per packed weight block (two AMX C tiles)
constexpr int64_t TILE_K = 32;  // bf16 values of K per AMX tile row
constexpr int64_t TILE_M = 16;  // rows per AMX tile
constexpr int64_t MAX_HEAD_DIM = 256;
constexpr int64_t VECTOR_ROWS = 3;  // rows per register block on the AVX512-BF16 path

// Which products run: AMX tiles where the CPU has them and the OS grants them (enable()), else
// AVX512-BF16. Set once when the module loads, before any weights are used.
bool use_amx = false;

inline float f32(bf16 v) {
  uint32_t bits = uint32_t(v) << 16;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline bf16 round_bf16(float v) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16(bits >> 16);
}

inline __mmask16 lanes(int64_t count) {  // the first min(count, 16) lanes of a vector
  return __mmask16((1u << std::min<int64_t>(16, count)) - 1u);
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

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

// GCC declares _tile_loadconfig as reading 8 bytes, so stores that fill the rest of the 64-byte
// config may be dropped as dead (seen with -O3: a #GP at ldtilecfg); a memory clobber keeps them.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
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

// The same product without AMX: rows in register blocks of R, each step multiplying one pair
// of K by the block's 32 x 2 weights with VDPBF16PS. A row keeps SPLIT partial sums per 16
// features (pair p goes to sum p % SPLIT; added in a fixed tree at the end) so that even a lone
// row has independent chains enough to hide the instruction's latency. A row's sums run in the
// same order whatever R is, so its bits do not depend on the other rows.
constexpr int SPLIT = 4;  // the fixed tree in vector_rows adds four

// `ahead` [ahead_lines of 64 bytes]: memory to prefetch into L2 meanwhile, spread over K (the
// thread's next weight block, or this pass's share of it): a wide call multiplies each block
// once per register block of rows, and without it the memory stream would idle meanwhile.
// keep: where int8 weights are widened to (for the later passes), or null.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void vector_rows(
    const bf16* x, int64_t k, const void* block, bool int8, float* out, const char* ahead,
    int64_t ahead_lines, bf16* keep) {
  alignas(64) bf16 widened[(TILE_K / 2) * BLOCK * 2];
  __m512 acc[R][SPLIT][2];
  for (int r = 0; r < R; r++)
    for (int s = 0; s < SPLIT; s++) acc[r][s][0] = acc[r][s][1] = _mm512_setzero_ps();
  const int64_t tiles = k / TILE_K, lines_per_tile = (ahead_lines + tiles - 1) / tiles;
  for (int64_t kb = 0; kb < tiles; kb++) {
    if (ahead)
      for (int64_t line = kb * lines_per_tile;
           line < std::min(ahead_lines, (kb + 1) * lines_per_tile); line++)
        _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    const int64_t at = kb * (TILE_K / 2) * BLOCK * 2;
    const bf16* b = static_cast<const bf16*>(block) + at;
    if (int8) {
      b = keep ? keep + at : widened;
      widen_tile(static_cast<const int8_t*>(block) + at, const_cast<bf16*>(b));
    }
    for (int64_t pair = 0; pair < TILE_K / 2; pair += SPLIT) {
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
  static_assert(SPLIT == 4, "the sums below are added as a tree of four");
  for (int r = 0; r < R; r++)
    for (int half = 0; half < 2; half++)
      _mm512_storeu_ps(out + r * BLOCK + 16 * half,
                       _mm512_add_ps(_mm512_add_ps(acc[r][0][half], acc[r][1][half]),
                                     _mm512_add_ps(acc[r][2][half], acc[r][3][half])));
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
  for (int64_t pass = 0; pass < passes; pass++) {
    const int64_t row = pass * VECTOR_ROWS;
    const bf16* at = x + row * k;
    float* into = out + row * BLOCK;
    const char* ahead = next ? static_cast<const char*>(next) + pass * share * 64 : nullptr;
    const int64_t ahead_lines = std::min(share, lines - pass * share);
    switch (std::min(VECTOR_ROWS, rows - row)) {
      case 1: vector_rows<1>(at, k, block, int8, into, ahead, ahead_lines, keep); break;
      case 2: vector_rows<2>(at, k, block, int8, into, ahead, ahead_lines, keep); break;
      default: vector_rows<3>(at, k, block, int8, into, ahead, ahead_lines, keep); break;
    }
    if (keep) block = keep, int8 = false, keep = nullptr;  // later passes: the widened copy
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512 load_bf16(
    const bf16* p, __mmask16 mask) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, p));
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
void linear_into(const bf16* x, int64_t m, const Weight& w, bf16* y, const bf16* residual) {
  const int64_t blocks = (w.n + BLOCK - 1) / BLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) float out[TILE_M * BLOCK];
    for (int64_t block = first; block < last; block++) {
      const int64_t col = block * BLOCK, width = std::min(BLOCK, w.n - col);
      for (int64_t row = 0; row < m; row += TILE_M) {
        const int64_t rows = std::min(TILE_M, m - row);
        const int64_t element = w.scales ? 1 : 2;  // bytes per weight
        const void* packed = static_cast<const char*>(w.packed) + block * w.k * BLOCK * element;
        if (use_amx) {
          block_product(x + row * w.k, rows, w.k, packed, w.scales != nullptr, out);
        } else {
          const bool last_pass = block + 1 < last && row + TILE_M >= m;
          block_product_vector(x + row * w.k, rows, w.k, packed, w.scales != nullptr, out,
                               last_pass ? static_cast<const char*>(packed) +
                                               w.k * BLOCK * element : nullptr);
        }
        for (int64_t i = 0; i < rows; i++)
          store_row(out + i * BLOCK, width, w, col, y + (row + i) * w.n + col,
                    residual ? residual + (row + i) * w.n + col : nullptr);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Elementwise pieces.

__attribute__((target("avx512f,avx512bf16"))) inline __m512 round_trip(__m512 v) {  // via bf16
  return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v));
}

// transformers' LlamaRMSNorm in bfloat16: weight * bf16(x * rsqrt(mean(x^2) + eps)); the sum
// of squares in 16 lanes, then a fixed tree.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void rms_norm_row(
    const bf16* in, int64_t h, const bf16* weight, float eps, bf16* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 mask = lanes(h - i);
    const __m512 v = load_bf16(in + i, mask);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 scale =
      _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(squares) / float(h) + eps));
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 mask = lanes(h - i);
    const __m512 normed = round_trip(_mm512_mul_ps(load_bf16(in + i, mask), scale));
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)_mm512_cvtneps_pbh(
                                                _mm512_mul_ps(load_bf16(weight + i, mask), normed)));
  }
}

void rms_norm(const bf16* x, int64_t m, int64_t h, const bf16* weight, float eps, bf16* out) {
  at::parallel_for(0, m, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last; row++)
      rms_norm_row(x + row * h, h, weight, eps, out + row * h);
  });
}

// Rotary embedding in place on `heads` heads of width d: x * cos + rotate_half(x) * sin, each
// product rounded as transformers does; cos/sin rows [d] with the sign folded into sin.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void rotate(
    bf16* x, int64_t heads, int64_t d, const bf16* cos, const bf16* sin) {
  const int64_t half = d / 2;
  if (half % 16 == 0 && d <= MAX_HEAD_DIM) {  // whole 16-lane chunks on each side
    const int64_t chunks = d / 16;
    const __mmask16 all = 0xffff;
    for (int64_t h = 0; h < heads; h++) {
      bf16* v = x + h * d;
      __m512 head[MAX_HEAD_DIM / 16];
      for (int64_t c = 0; c < chunks; c++) head[c] = load_bf16(v + 16 * c, all);
      for (int64_t c = 0; c < chunks; c++) {
        const __m512 swapped = head[(c + chunks / 2) % chunks];
        const __m512 sum = _mm512_add_ps(
            round_trip(_mm512_mul_ps(head[c], load_bf16(cos + 16 * c, all))),
            round_trip(_mm512_mul_ps(swapped, load_bf16(sin + 16 * c, all))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(sum));
      }
    }
    return;
  }
  float head[MAX_HEAD_DIM];
  for (int64_t h = 0; h < heads; h++) {
    bf16* v = x + h * d;
    for (int64_t i = 0; i < d; i++) head[i] = f32(v[i]);
    for (int64_t i = 0; i < d; i++) {
      const float swapped = head[i < half ? i + half : i - half];
      v[i] = round_bf16(f32(round_bf16(head[i] * f32(cos[i]))) +
                        f32(round_bf16(swapped * f32(sin[i]))));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention. attend_one: one query over keys 0..count-1 of one KV head with AVX512-BF16 (without
// AMX, and for head widths that are not a multiple of 32); attend_group (below): the AMX path.

__attribute__((target("avx512f"))) inline __m512 exp512(__m512 x) {  // e^x, rel err ~2e-7
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);  // 2^f, f in [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Softmax numerators of scores [n] in place (exp(score - max)), also rounded to bf16 into
// weights [n] when given; returns 1 / their sum (16 lanes, then a fixed tree). The max is exact
// in any order; every other sum runs in the same order for the same n.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) float softmax_in_place(
    float* scores, int64_t n, bf16* weights) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = lanes(n - j);
    top = _mm512_mask_max_ps(top, mask, top, _mm512_maskz_loadu_ps(mask, scores + j));
  }
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(top));
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = lanes(n - j);
    const __m512 e = _mm512_maskz_mov_ps(
        mask, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + j), shift)));
    _mm512_mask_storeu_ps(scores + j, mask, e);
    if (weights)
      _mm256_mask_storeu_epi16(weights + j, mask, (__m256i)_mm512_cvtneps_pbh(e));
    total = _mm512_add_ps(total, e);
  }
  return 1.0f / _mm512_reduce_add_ps(total);
}

// Lane r of the result: the sum of v[r]'s 16 lanes, by a fixed tree (128-bit halves, then
// pairs, then within lanes), so every key's score is summed the same way wherever it sits.
__attribute__((target("avx512f"))) inline __m512 sum_lanes16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; i++)  // [v2i: 0+2, 1+3 | v2i+1: 0+2, 1+3] (128-bit quarters)
    x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; i++)  // quarter k: 4 partial sums of v[4i + k]
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; i++)  // quarter k: 2 partials of v[8i + k], then of v[8i + 4 + k]
    z[i] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(y[2 * i], y[2 * i + 1], 0xEE));
  // lane 4k + m: the sum of v[4m + k]
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),
                                    _mm512_shuffle_ps(z[0], z[1], 0xDD));
  const __m512i row_at = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(row_at, sums);
}

// Dimensions 32 c .. 32 c + 31 of a key or value row (CHUNKS > 0: all there; else masked).
template <int CHUNKS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512i load_chunk(
    const bf16* row, int64_t c, __mmask32 mask) {
  return CHUNKS > 0 ? _mm512_loadu_si512(row + 32 * c)
                    : _mm512_maskz_loadu_epi16(mask, row + 32 * c);
}

// out [d] = softmax(q . K^T * scale) V over keys [count, d] and values [count, d], for one query
// on the AVX512-BF16 path (and head widths the AMX path does not take); from key tail_start on,
// the keys and values are read from tail_keys / tail_values instead (a tree node's path: the
// same values in the same order as its chain's cache holds them). Scores: bf16 products summed
// in fp32 with VDPBF16PS, 16 keys at a time; the softmax's numerators rounded to bf16 as the
// weights (as the AMX path does); the weighted sum of values over pairs of keys in key order.
// Nothing depends on other queries or on where a key sits in its block. d even. CHUNKS > 0:
// d is exactly 32 CHUNKS, known when compiling (the loops over d unrolled, their vectors kept
// in registers; attend_one picks it); 0: any even d, masked.
template <int CHUNKS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void attend_query(
    const bf16* q, const bf16* keys, const bf16* values, int64_t count, int64_t d, float scale,
    float* scores, bf16* weights, bf16* out, int64_t tail_start, const bf16* tail_keys,
    const bf16* tail_values) {
  const auto key_of = [&](int64_t j) {
    return j < tail_start ? keys + j * d : tail_keys + (j - tail_start) * d;
  };
  const auto value_of = [&](int64_t j) {
    return j < tail_start ? values + j * d : tail_values + (j - tail_start) * d;
  };
  const int64_t chunks = CHUNKS > 0 ? CHUNKS : (d + 31) / 32;  // of 32 dimensions (16 pairs)
  __m512bh query[MAX_HEAD_DIM / 32];
  __mmask32 masks[MAX_HEAD_DIM / 32];
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t width = CHUNKS > 0 ? 32 : std::min<int64_t>(32, d - 32 * c);
    masks[c] = __mmask32(width == 32 ? ~0u : (1u << width) - 1u);
    query[c] = (__m512bh)_mm512_maskz_loadu_epi16(masks[c], q + 32 * c);
  }
  // 1. Scores, 16 keys at a time: per key 16 partial sums of pairs, then summed across.
  for (int64_t first = 0; first < count; first += 16) {
    const int64_t n = std::min<int64_t>(16, count - first);
    __m512 partial[16];
    for (int64_t r = 0; r < 16; r++) {
      partial[r] = _mm512_setzero_ps();
      if (r >= n) continue;
      const bf16* key = key_of(first + r);
      for (int64_t c = 0; c < chunks; c++)
        partial[r] = _mm512_dpbf16_ps(partial[r], (__m512bh)load_chunk<CHUNKS>(key, c, masks[c]),
                                      query[c]);
    }
    _mm512_mask_storeu_ps(scores + first, lanes(n),
                          _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(scale)));
  }
  // 2. Exponentials, their bf16 roundings as weights, 1 / their fp32 sum.
  const float norm = softmax_in_place(scores, count, weights);
  // 3. The weighted sum of values, two keys at a time: lane i of a 16-dim half gets
  // w_j v_j[i] + w_j+1 v_j+1[i] (values interleaved in pairs of keys).
  alignas(64) uint16_t index[64];
  for (int i = 0; i < 16; i++) {
    index[2 * i] = uint16_t(i), index[2 * i + 1] = uint16_t(32 + i);
    index[32 + 2 * i] = uint16_t(16 + i), index[32 + 2 * i + 1] = uint16_t(48 + i);
  }
  const __m512i low = _mm512_load_si512(index), high = _mm512_load_si512(index + 32);
  __m512 acc[MAX_HEAD_DIM / 16];
  for (int64_t c = 0; c < 2 * chunks; c++) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < count; j += 2) {
    const bool pair = j + 1 < count;
    const uint32_t both = uint32_t(weights[j]) | (pair ? uint32_t(weights[j + 1]) << 16 : 0u);
    const __m512bh weight = (__m512bh)_mm512_set1_epi32(int32_t(both));
    const bf16* value = value_of(j);
    const bf16* next = pair ? value_of(j + 1) : nullptr;
    for (int64_t c = 0; c < chunks; c++) {
      const __m512i a = load_chunk<CHUNKS>(value, c, masks[c]);
      const __m512i b = pair ? load_chunk<CHUNKS>(next, c, masks[c]) : _mm512_setzero_si512();
      acc[2 * c] = _mm512_dpbf16_ps(acc[2 * c], (__m512bh)_mm512_permutex2var_epi16(a, low, b),
                                    weight);
      acc[2 * c + 1] = _mm512_dpbf16_ps(
          acc[2 * c + 1], (__m512bh)_mm512_permutex2var_epi16(a, high, b), weight);
    }
  }
  alignas(64) float result[MAX_HEAD_DIM + 32];
  for (int64_t c = 0; c < 2 * chunks; c++)
    _mm512_store_ps(result + 16 * c, _mm512_mul_ps(acc[c], _mm512_set1_ps(norm)));
  for (int64_t i = 0; i < d; i++) out[i] = round_bf16(result[i]);
}

void attend_one(const bf16* q, const bf16* keys, const bf16* values, int64_t count, int64_t d,
                float scale, float* scores, bf16* weights, bf16* out,
                int64_t tail_start = INT64_MAX, const bf16* tail_keys = nullptr,
                const bf16* tail_values = nullptr) {
  switch (d) {
    case 64:
      return attend_query<2>(q, keys, values, count, d, scale, scores, weights, out,
                             tail_start, tail_keys, tail_values);
    case 128:
      return attend_query<4>(q, keys, values, count, d, scale, scores, weights, out,
                             tail_start, tail_keys, tail_values);
    default:
      return attend_query<0>(q, keys, values, count, d, scale, scores, weights, out,
                             tail_start, tail_keys, tail_values);
  }
}

// Attention for up to 16 queries that share one KV head (the heads of a GQA group, the
// positions of a verification pass): scores on AMX as K Q^T (a tile of 16 keys straight from
// the cache times a tile of the queries, transposed once), softmax and the weighted sum of
// values in fp32 with AVX-512, one query at a time over exactly its own keys. A score depends
// only on its query and key, and each query's sums run in key order, so a query gets the same
// bits whichever queries share its call. Needs head_dim % 32 == 0.

// Tile numbers must be compile-time constants: C tiles 0-3 by a run-time index.
__attribute__((target("amx-tile"))) inline void tile_zero(int64_t t) {
  switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}

__attribute__((target("amx-tile,amx-bf16"))) inline void tile_product(int64_t t) {  // C += A B
  switch (t) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}

__attribute__((target("amx-tile"))) inline void tile_store(int64_t t, float* out, int64_t stride) {
  switch (t) {
    case 0: _tile_stored(0, out, stride); break;
    case 1: _tile_stored(1, out, stride); break;
    case 2: _tile_stored(2, out, stride); break;
    default: _tile_stored(3, out, stride); break;
  }
}

struct Query {
  const bf16* q;  // [d]
  int64_t count;  // attends over keys 0..count-1
  bf16* out;      // [d]
  // Its keys and values from attend_group's `tail_start` on, in position order, zero past
  // `count` (`tail_rows` of them): a tree node's path (see forward_layers); null: the cache's.
  const bf16* tail_keys = nullptr;
  const bf16* tail_values = nullptr;
  int64_t tail_rows = 0;
};

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void
attend_group(const Query* queries, int64_t count, const bf16* keys, const bf16* values,
             int64_t capacity, int64_t d, float scale, std::vector<float>& scores,
             std::vector<bf16>& weights, int64_t tail_start = INT64_MAX) {
  // Where query c reads the keys (values) of block `first`: the cache, or from tail_start on
  // its own tail; blocks past a source's rows are staged, zero-padded.
  struct Source {
    const bf16* keys;
    const bf16* values;
    int64_t rows, first;  // rows of the source, the block's first row in it
  };
  const auto source = [&](int64_t c, int64_t first) -> Source {
    if (first < tail_start || queries[c].tail_keys == nullptr)
      return {keys, values, capacity, first};
    return {queries[c].tail_keys, queries[c].tail_values, queries[c].tail_rows,
            first - tail_start};
  };
  // Queries reading the same source as query c in block `first` (c's own bit included).
  const auto sharing = [&](int64_t c, int64_t first) {
    uint32_t members = 0;
    const bf16* own = source(c, first).keys;
    for (int64_t other = 0; other < count; other++)
      if (source(other, first).keys == own) members |= 1u << other;
    return members;
  };
  int64_t longest = 0;
  for (int64_t c = 0; c < count; c++) longest = std::max(longest, queries[c].count);
  const int64_t stride = (longest + 15) / 16 * 16;  // scores row per query
  if (int64_t(scores.size()) < TILE_M * stride) scores.resize(TILE_M * stride);
  // 1. The queries as B tiles: [d/2 pairs][16 queries][2], zero columns past `count`.
  alignas(64) bf16 tiled[MAX_HEAD_DIM / 2 * TILE_M * 2] = {};
  for (int64_t c = 0; c < count; c++)
    for (int64_t i = 0; i < d; i++) tiled[(i / 2) * TILE_M * 2 + c * 2 + i % 2] = queries[c].q[i];
  TileConfig config;  // every tile 16 x 64 bytes; scores: 0 = C, 1 = A, 2 = B; sums: 0-3 = C,
  for (int tile = 0; tile < 6; tile++) {  // 4 = A, 5 = B
    config.rows[tile] = 16;
    config.colsb[tile] = 64;
  }
  load_tile_config(config);
  alignas(64) float block_scores[16 * 16];
  alignas(64) bf16 staged[16 * MAX_HEAD_DIM];
  // 2. Scores, 16 keys at a time, one tile per source of the block (the cache; in a tree's
  // tail, each node's path).
  const __m512i column = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(16));
  for (int64_t first = 0; first < longest; first += 16) {
    uint32_t done = 0;
    for (int64_t c = 0; c < count; c++) {
      if (done >> c & 1u) continue;
      const uint32_t members = first < tail_start ? (1u << count) - 1u : sharing(c, first);
      done |= members;
      const Source from = source(c, first);
      const bf16* block = from.keys + from.first * d;
      if (from.first + 16 > from.rows) {
        std::memset(staged, 0, sizeof(staged));
        std::memcpy(staged, block, std::max<int64_t>(0, from.rows - from.first) * d * 2);
        block = staged;
      }
      _tile_zero(0);
      for (int64_t kb = 0; kb < d / TILE_K; kb++) {
        _tile_loadd(1, block + kb * TILE_K, d * 2);
        _tile_loadd(2, tiled + kb * (TILE_K / 2) * TILE_M * 2, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, block_scores, 64);
      // The tile is [key][query]: each member's column, scaled, into its row of scores.
      for (int64_t m = 0; m < count; m++)
        if (members >> m & 1u)
          _mm512_storeu_ps(scores.data() + m * stride + first,
                           _mm512_mul_ps(_mm512_i32gather_ps(column, block_scores + m, 4),
                                         _mm512_set1_ps(scale)));
    }
  }
  // 3. Softmax per query, over its own keys: the exponentials rounded to bf16 as the weights
  // of step 4 (zero past the query's keys), 1 / their fp32 sum.
  const int64_t padded = (longest + 31) / 32 * 32;
  weights.assign(TILE_M * padded, 0);
  float norms[TILE_M];
  for (int64_t c = 0; c < count; c++)
    norms[c] = softmax_in_place(scores.data() + c * stride, queries[c].count,
                                weights.data() + c * padded);
  // 4. Weighted sums of values on AMX: P [16 queries x 32 keys] times values in pairs of
  // keys, 32 keys at a time; each query's sums over its own keys, the zeros past them adding
  // nothing.
  alignas(64) bf16 pairs[16 * MAX_HEAD_DIM * 2];  // [16 key pairs][d][2]
  alignas(64) float sums[TILE_M * MAX_HEAD_DIM];
  alignas(64) bf16 own_weights[TILE_M * 32];
  __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
  {
    alignas(64) uint16_t index[64];
    for (int i = 0; i < 16; i++) {
      index[2 * i] = uint16_t(i), index[2 * i + 1] = uint16_t(32 + i);
      index[32 + 2 * i] = uint16_t(16 + i), index[32 + 2 * i + 1] = uint16_t(48 + i);
    }
    low = _mm512_load_si512(index);
    high = _mm512_load_si512(index + 32);
  }
  for (int64_t columns = 0; columns < d; columns += 64) {  // up to 4 C tiles at a time
    const int64_t tiles = std::min<int64_t>(4, (d - columns) / 16);
    load_tile_config(config);
    for (int64_t t = 0; t < tiles; t++) tile_zero(t);
    for (int64_t first = 0; first < padded; first += 32) {
      uint32_t done = 0;
      for (int64_t c = 0; c < count; c++) {  // one product per source of the block
        if (done >> c & 1u) continue;
        const uint32_t members = first < tail_start ? (1u << count) - 1u : sharing(c, first);
        done |= members;
        const Source from = source(c, first);
        for (int64_t r = 0; r < 16; r++) {  // interleave value rows first+2r, first+2r+1
          const int64_t j = from.first + 2 * r;
          for (int64_t dim = columns; dim < columns + tiles * 16; dim += 32) {
            const __m512i a = j < from.rows ? _mm512_loadu_si512(from.values + j * d + dim)
                                            : _mm512_setzero_si512();
            const __m512i b = j + 1 < from.rows
                                  ? _mm512_loadu_si512(from.values + (j + 1) * d + dim)
                                  : _mm512_setzero_si512();
            _mm512_store_si512(pairs + r * 128 + (dim - columns) * 2,
                               _mm512_permutex2var_epi16(a, low, b));
            _mm512_store_si512(pairs + r * 128 + (dim - columns) * 2 + 32,
                               _mm512_permutex2var_epi16(a, high, b));
          }
        }
        if (members == (1u << count) - 1u) {
          _tile_loadd(4, weights.data() + first, padded * 2);
        } else {  // the other sources' queries weigh these values zero: they add nothing
          for (int64_t m = 0; m < TILE_M; m++)
            for (int64_t j = 0; j < 32; j++)
              own_weights[m * 32 + j] =
                  m < count && (members >> m & 1u) ? weights[m * padded + first + j] : bf16(0);
          _tile_loadd(4, own_weights, 64);
        }
        for (int64_t t = 0; t < tiles; t++) {
          _tile_loadd(5, pairs + t * 32, 256);
          tile_product(t);
        }
      }
    }
    for (int64_t t = 0; t < tiles; t++) tile_store(t, sums + columns + t * 16, d * 4);
  }
  _tile_release();
  for (int64_t c = 0; c < count; c++)
    for (int64_t i = 0; i < d; i++) queries[c].out[i] = round_bf16(sums[c * d + i] * norms[c]);
}

// out [width] = round(round(silu(gate)) * up), gate and up the halves of in [2 width].
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void swiglu(
    const bf16* in, int64_t width, bf16* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < width; j += 16) {
    const __mmask16 mask = lanes(width - j);
    const __m512 gate = load_bf16(in + j, mask), up = load_bf16(in + width + j, mask);
    const __m512 silu = _mm512_div_ps(
        gate, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
    const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));
    _mm256_mask_storeu_epi16(out + j, mask, (__m256i)_mm512_cvtneps_pbh(
                                                _mm512_mul_ps(rounded, up)));
  }
}

// ---------------------------------------------------------------------------------------------

struct Shape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps;
};

struct QueryGroup {  // queries first..last-1 (t * group + head in group) of one row's KV head
  int64_t row, kv_head, first, last;
};

// body(task, scratch) for every task in [0, n). balance: the threads take the next task as they
// finish one, for a batch, whose rows attend over caches of different lengths (a static split
// left one thread with the long rows while the other waited: a pass of rows of 1300, 1300, 100
// and 100 tokens took 25% longer than one of four rows of 700). Otherwise (one sequence) each
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
  int64_t tree_base;  // -1, or the first slot of a token tree (verispec.native.llama.TreeLinks)
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

// The decoder layers over every row's new positions; x [N, H] is updated in place, and each
// row's keys and values at its new positions are written into its cache.
void forward_layers(torch::Tensor x, const std::vector<torch::Tensor>& layers,
                    const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& keys,
                    const std::vector<torch::Tensor>& values, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& lengths, std::vector<int64_t> sizes, double eps,
                    int64_t short_pass, torch::Tensor taps,
                    const std::vector<int64_t>& tap_layers,
                    const std::vector<int64_t>& tree_bases,
                    const std::vector<int64_t>& path_slots,
                    const std::vector<int64_t>& path_offsets) {
  const Shape shape{sizes.at(0), sizes.at(1), sizes.at(2), sizes.at(3), sizes.at(4), float(eps)};
  const int64_t n = x.size(0), h = shape.hidden, d = shape.head_dim;
  const int64_t q_width = shape.heads * d, kv_width = shape.kv_heads * d;
  const int64_t qkv_width = q_width + 2 * kv_width;
  TORCH_CHECK(d <= MAX_HEAD_DIM && d % 2 == 0, "head_dim must be even and at most ",
              MAX_HEAD_DIM);
  TORCH_CHECK(layers.size() % 11 == 0, "11 tensors a layer");
  TORCH_CHECK(x.is_contiguous() && x.scalar_type() == at::kBFloat16 && x.size(1) == h);
  // taps [N, len(tap_layers), H]: the hidden state after the first tap_layers[j] layers.
  const int64_t num_taps = int64_t(tap_layers.size());
  TORCH_CHECK(num_taps == 0 || (taps.is_contiguous() && taps.scalar_type() == at::kBFloat16 &&
                                taps.size(0) == x.size(0) && taps.size(1) == num_taps &&
                                taps.size(2) == h), "taps must be [N, len(tap_layers), H]");

  // Token trees (any rows with tree_bases[r] >= 0): new slot i attends over slots
  // 0..base-1 and then path_slots[path_offsets[i]..path_offsets[i+1]-1] (its ancestors and
  // itself), at position base - 1 + its depth; an empty path is an ordinary slot.
  const bool trees = !tree_bases.empty();
  TORCH_CHECK(!trees || (tree_bases.size() == starts.size() &&
                         int64_t(path_offsets.size()) == n + 1), "tree arguments' sizes");
  const auto path_length = [&](int64_t i) {
    return trees ? path_offsets[i + 1] - path_offsets[i] : int64_t(0);
  };
  std::vector<Row> rows;
  std::vector<int64_t> positions;  // [N]: each new slot's position in its sequence
  std::vector<int64_t> owner;      // [N]: its row
  int64_t offset = 0;
  for (size_t r = 0; r < starts.size(); r++) {
    TORCH_CHECK(keys[r].is_contiguous() && values[r].is_contiguous());
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
      owner.push_back(int64_t(r));
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
  const bf16* cos_table = reinterpret_cast<const bf16*>(cos.data_ptr());
  const bf16* sin_table = reinterpret_cast<const bf16*>(sin.data_ptr());
  const float scale = 1.0f / std::sqrt(float(d));
  int64_t longest = 0;
  for (int64_t p : positions) longest = std::max(longest, p + 1);
  std::vector<int64_t> short_queries;  // the positions of short passes
  for (const Row& row : rows)
    if (row.length <= short_pass)
      for (int64_t t = 0; t < row.length; t++) short_queries.push_back(row.offset + t);
  // The same queries by KV head, in groups of up to 16 (member = t * group + head in group).
  const int64_t group = shape.heads / shape.kv_heads;
  std::vector<QueryGroup> groups;
  for (size_t r = 0; r < rows.size(); r++) {
    if (rows[r].length > short_pass) continue;
    const int64_t members = rows[r].length * group;
    // One query head per task for a lone decode row (work for both threads), else up to 16.
    const int64_t size = rows.size() == 1 && rows[r].length == 1 ? 1 : TILE_M;
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

  for (size_t layer = 0; layer * 11 < layers.size(); layer++) {
    // attn_norm, mlp_norm, qkv bias (fp32, or empty), then packed weights and their scales
    // (empty for bfloat16) for qkv, out, gate_up, down
    const torch::Tensor* w = &layers[layer * 11];
    const bf16* attn_norm = reinterpret_cast<const bf16*>(w[0].data_ptr());
    const bf16* mlp_norm = reinterpret_cast<const bf16*>(w[1].data_ptr());
    const torch::Tensor none;
    // 1. Norm, fused q/k/v, rotary on q and k.
    rms_norm(hidden, n, h, attn_norm, shape.eps, normed);
    linear_into(normed, n, weight_of(w[3], w[2], w[4], qkv_width), qkv, nullptr);
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
    // 3. Attention. Short passes (decode, verification): one (position, head) per task, each
    // over exactly its own keys. Prompt passes: torch's fused causal kernel, row by row.
    if (use_amx && d % TILE_K == 0) {
      // Tasks of up to 16 queries that share a KV head: a decode step's query heads one by
      // one (more tasks for the threads), a verification pass's positions and heads together.
      const auto attend_task = [&](int64_t task, GroupScratch& s) {
        const QueryGroup& g = groups[task];
        const Row& row = rows[g.row];
        const int64_t base = (int64_t(layer) * shape.kv_heads + g.kv_head) * row.capacity * d;
        // A tree's nodes read their keys from the 32-key block holding slot base on in
        // their own staged copies (one per node, shared by its query heads).
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
        attend_group(s.queries.data(), int64_t(s.queries.size()), row.keys + base,
                     row.values + base, row.capacity, d, scale, s.scores, s.weights,
                     tail_start);
      };
      parallel_tasks<GroupScratch>(int64_t(groups.size()), balance, attend_task);
    } else {
      const auto attend_task = [&](int64_t task, GroupScratch& s) {
        s.scores.resize(longest + 16);
        const int64_t i = short_queries[task / shape.heads], head = task % shape.heads;
        const Row& row = rows[owner[i]];
        const int64_t base = (int64_t(layer) * shape.kv_heads + head / group) * row.capacity * d;
        const bf16 *keys_of = row.keys + base, *values_of = row.values + base;
        int64_t tail_start = INT64_MAX;
        if (path_length(i)) {  // a tree node: its path's keys and values after the prefix
          const int64_t length = path_length(i);
          s.tails.resize(2 * length * d);
          const int64_t* path = path_slots.data() + path_offsets[i];
          stage_path(keys_of, row.tree_base, path, length, row.tree_base, length, d,
                     s.tails.data());
          stage_path(values_of, row.tree_base, path, length, row.tree_base, length, d,
                     s.tails.data() + length * d);
          tail_start = row.tree_base;
        }
        s.weights.resize(longest + 16);
        attend_one(qkv + i * qkv_width + head * d, keys_of, values_of, positions[i] + 1, d,
                   scale, s.scores.data(), s.weights.data(), attended + i * q_width + head * d,
                   tail_start, s.tails.data(), s.tails.data() + path_length(i) * d);
      };
      parallel_tasks<GroupScratch>(int64_t(short_queries.size()) * shape.heads, balance,
                                   attend_task);
    }
    for (const Row& row : rows)
      if (row.length > short_pass) attend_prompt(row, layer, shape, qkv, qkv_width, attended);
    // 4. Output projection onto the residual stream.
    linear_into(attended, n, weight_of(w[5], none, w[6], h), hidden, hidden);
    // 5. SwiGLU MLP onto the residual stream.
    rms_norm(hidden, n, h, mlp_norm, shape.eps, normed);
    linear_into(normed, n, weight_of(w[7], none, w[8], 2 * shape.intermediate), gate_up,
                nullptr);
    const int64_t inter = shape.intermediate;
    at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; i++)
        swiglu(gate_up + i * 2 * inter, inter, act + i * inter);
    });
    linear_into(act, n, weight_of(w[9], none, w[10], h), hidden, hidden);
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
  m.def("forward_layers", &forward_layers);
}
