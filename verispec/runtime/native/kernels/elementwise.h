// verispec's C++ kernels (see kernels.cpp): RMSNorm, rotary embeddings and SwiGLU, rounded
// as transformers' bfloat16 modules round.

#pragma once

#include "common.h"

namespace {

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

}  // namespace
