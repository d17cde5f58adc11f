// The float math of a forward pass besides the products (norms, rotary, softmax, SwiGLU), on
// 16 float lanes written with GCC's vector extensions: the compiler lowers one `Floats` to one
// AVX-512 register, two AVX2 registers or a loop, and every operation is an IEEE operation per
// lane (the kernels build with -ffp-contract=off, so nothing is fused behind our back). The
// same source therefore gives the same bits on every path, and every value depends only on its
// own inputs: a position's norm, rotary or softmax never sees another position of the pass.
//
// Reductions run in one fixed order: lane l takes elements l, l + 16, l + 32, ... in turn,
// then `lane_sum` folds the 16 lanes by halves (l + 8, then l + 4, l + 2, l + 1).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vq {

constexpr int64_t LANES = 16;
typedef float Floats __attribute__((vector_size(64)));
typedef int32_t Ints __attribute__((vector_size(64)));

inline Floats splat(float v) { return Floats{} + v; }

inline Floats load_lanes(const float* p) {
  Floats v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store_lanes(float* p, Floats v) { std::memcpy(p, &v, sizeof v); }

// Lane 0 of v folded by halves: combine(lane l, lane l + 8), then l + 4, l + 2, l + 1, as
// register shuffles (the lanes a step leaves behind are never read). V: Floats or Ints.
template <class V, class Combine>
inline auto fold_lanes(V v, Combine combine) {
  v = combine(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 0, 0, 0, 0, 0, 0, 0));
  v = combine(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
  v = combine(v, __builtin_shufflevector(v, v, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
  v = combine(v, __builtin_shufflevector(v, v, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0));
  return v[0];
}

// Lanes l + 8, then l + 4, l + 2, l + 1 added onto lane l.
inline float lane_sum(Floats v) {
  return fold_lanes(v, [](Floats x, Floats y) { return x + y; });
}

// Lane t = lane_sum(parts[t]) for 16 vectors at once, bit for bit: the same additions (lane
// l + 8 onto l, then l + 4, l + 2, l + 1), each step halving the partial sums a key holds and
// doubling the keys a register holds, so 16 sums cost 15 shuffled additions instead of 64.
inline Floats lane_sums16(const Floats* parts) {
  // combine(a, b): a's and b's keys side by side, each key's partial p plus partial p + W/2
  const auto step16 = [](Floats a, Floats b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  };
  const auto step8 = [](Floats a, Floats b) {
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  };
  const auto step4 = [](Floats a, Floats b) {
    return __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  };
  const auto step2 = [](Floats a, Floats b) {
    return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  };
  Floats pairs[8], quads[4], octets[2];
  for (int i = 0; i < 8; i++) pairs[i] = step16(parts[2 * i], parts[2 * i + 1]);
  for (int i = 0; i < 4; i++) quads[i] = step8(pairs[2 * i], pairs[2 * i + 1]);
  for (int i = 0; i < 2; i++) octets[i] = step4(quads[2 * i], quads[2 * i + 1]);
  return step2(octets[0], octets[1]);
}

inline float lane_max(Floats v) {
  float a[LANES];
  store_lanes(a, v);
  float m = a[0];
  for (int l = 1; l < LANES; l++) m = a[l] > m ? a[l] : m;
  return m;
}

// e^x per lane, for x in [-87, 88] within 2 ulp (clamped outside; -inf gives e^-87 ~ 1.6e-38,
// which callers that need an exact zero mask): x = n ln2 + r with |r| <= ln2 / 2, e^r by a
// degree-6 polynomial (Cephes' expf coefficients), 2^n put into the exponent bits.
inline Floats exp_lanes(Floats x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  // n = round(x / ln2): adding 1.5 * 2^23 rounds to an integer (ties to even) for |v| < 2^22
  const Floats shifter = splat(12582912.0f);
  const Floats n = (x * 1.44269504088896341f + shifter) - shifter;
  // r = x - n ln2 in two steps: ln2's high part has few bits, so n * 0.693359375 is exact
  const Floats r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  Floats p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const Ints exponent = (__builtin_convertvector(n, Ints) + 127) << 23;
  Floats scale;
  std::memcpy(&scale, &exponent, sizeof scale);
  return p * scale;
}

// out = x * (1 / sqrt(mean(x^2) + eps)) * weight over K values (K a multiple of 16).
inline void rms_norm_row(const float* x, int64_t K, const float* weight, float eps, float* out) {
  Floats squares = Floats{};
  for (int64_t i = 0; i < K; i += LANES) {
    const Floats v = load_lanes(x + i);
    squares = squares + v * v;
  }
  const float inverse = 1.0f / std::sqrt(lane_sum(squares) / float(K) + eps);
  for (int64_t i = 0; i < K; i += LANES)
    store_lanes(out + i, load_lanes(x + i) * inverse * load_lanes(weight + i));
}

// Rotary embedding of `heads` heads of d values (d even) in place, transformers' half-split
// convention with the rotated half's sign folded into sin (llama.py's rope_tables):
// x' = x * cos + swap_halves(x) * sin, element by element.
inline void rotate_heads(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; h++) {
    float* head = x + h * d;
    for (int64_t i = 0; i < half; i++) {
      const float low = head[i], high = head[half + i];
      head[i] = low * cos[i] + high * sin[i];
      head[half + i] = high * cos[half + i] + low * sin[half + i];
    }
  }
}

// SwiGLU: out = silu(gate) * up = gate / (1 + e^-gate) * up over I values (a multiple of 16).
inline void swiglu_row(const float* gate, const float* up, int64_t I, float* out) {
  for (int64_t i = 0; i < I; i += LANES) {
    const Floats g = load_lanes(gate + i);
    store_lanes(out + i, g / (exp_lanes(-g) + 1.0f) * load_lanes(up + i));
  }
}

// q . k over d values (a multiple of 16), in the fixed order above.
inline float dot_lanes(const float* q, const float* k, int64_t d) {
  Floats sum = load_lanes(q) * load_lanes(k);
  for (int64_t i = LANES; i < d; i += LANES) sum = sum + load_lanes(q + i) * load_lanes(k + i);
  return lane_sum(sum);
}

}  // namespace vq
