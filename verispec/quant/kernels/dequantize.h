// Exact dequantisation: the same float32 bits as gguf-py's gguf.quants.dequantize, whose NumPy
// code rounds every product and sum on its own (so the translation units build with
// -ffp-contract=off: a fused multiply-add would round once and differ in the last bit).

#pragma once

#include "formats.h"

namespace vq {

// One block of `type` at p into out[0 .. block_size).
inline void dequantize_block(int type, const uint8_t* p, float* out) {
  switch (type) {
    case Q4_0: {
      const float d = load_half(p);
      for (int i = 0; i < 16; i++) {
        out[i] = d * float(int(p[2 + i] & 15) - 8);
        out[i + 16] = d * float(int(p[2 + i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const float d = load_half(p), m = load_half(p + 2);
      for (int i = 0; i < 16; i++) {
        out[i] = d * float(p[4 + i] & 15) + m;
        out[i + 16] = d * float(p[4 + i] >> 4) + m;
      }
      return;
    }
    case Q5_0: {
      const float d = load_half(p);
      const uint32_t high = load_u32(p + 2);
      for (int i = 0; i < 16; i++) {
        const int lo = (p[6 + i] & 15) | int((high >> i) & 1) << 4;
        const int hi = (p[6 + i] >> 4) | int((high >> (i + 16)) & 1) << 4;
        out[i] = d * float(lo - 16);
        out[i + 16] = d * float(hi - 16);
      }
      return;
    }
    case Q5_1: {
      const float d = load_half(p), m = load_half(p + 2);
      const uint32_t high = load_u32(p + 4);
      for (int i = 0; i < 16; i++) {
        const int lo = (p[8 + i] & 15) | int((high >> i) & 1) << 4;
        const int hi = (p[8 + i] >> 4) | int((high >> (i + 16)) & 1) << 4;
        out[i] = d * float(lo) + m;
        out[i + 16] = d * float(hi) + m;
      }
      return;
    }
    case Q8_0: {
      const float d = load_half(p);
      for (int i = 0; i < 32; i++) out[i] = float(int8_t(p[2 + i])) * d;
      return;
    }
    case Q4_K:
    case Q5_K: {
      const float d = load_half(p), dmin = load_half(p + 2);
      const uint8_t* scales = p + 4;
      const uint8_t* high = p + 16;                        // Q5_K only
      const uint8_t* nibbles = p + (type == Q4_K ? 16 : 48);
      for (int j = 0; j < 8; j++) {
        int scale, min;
        k_scale_min(scales, j, scale, min);
        const float step = d * float(scale), offset = dmin * float(min);
        const uint8_t* q = nibbles + 32 * (j / 2);
        const int shift = 4 * (j % 2);
        for (int i = 0; i < 32; i++) {
          int v = (q[i] >> shift) & 15;
          if (type == Q5_K) v |= ((high[i] >> j) & 1) << 4;
          out[32 * j + i] = step * float(v) - offset;
        }
      }
      return;
    }
    case Q6_K: {
      const uint8_t* low = p;
      const uint8_t* high = p + 128;
      const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
      const float d = load_half(p + 208);
      for (int j = 0; j < 8; j++) {  // 32-element block j: half h of the super-block, quarter k
        const int h = j / 4, k = j % 4;
        const uint8_t* lo = low + 64 * h + 32 * (k % 2);
        const uint8_t* hi = high + 32 * h;
        for (int i = 0; i < 32; i++) {
          const int v = ((lo[i] >> (4 * (k / 2))) & 15) | ((hi[i] >> (2 * k)) & 3) << 4;
          const float step = d * float(scales[(32 * j + i) / 16]);
          out[32 * j + i] = step * float(v - 32);
        }
      }
      return;
    }
    default:
      return;
  }
}

// A row of K elements (K / block_size blocks) into out[0 .. K).
inline void dequantize_row(int type, const uint8_t* row, int64_t K, float* out) {
  const Layout shape = layout(type);
  for (int64_t b = 0; b < K / shape.block_size; b++)
    dequantize_block(type, row + b * shape.block_bytes, out + b * shape.block_size);
}

}  // namespace vq
