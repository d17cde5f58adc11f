// verispec's C++ kernels (see kernels.cpp): what every part uses: bfloat16 helpers, sizes,
// the ISA switch, AMX tile configuration, a bf16 load and e^x on AVX-512.

#pragma once

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

// GCC declares _tile_loadconfig as reading 8 bytes, so stores that fill the rest of the 64-byte
// config may be dropped as dead (seen with -O3: a #GP at ldtilecfg); a memory clobber keeps them.
__attribute__((target("amx-tile"))) inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline __m512 load_bf16(
    const bf16* p, __mmask16 mask) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, p));
}

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

}  // namespace
