// GGUF block formats as ggml lays them out (the file's raw bytes, never repacked), and what every
// kernel path shares: type ids, block sizes, fp16 conversion, the K-types' 6-bit scale unpacking.
//
// One block of each type (bytes in order; d, m, dmin are fp16; "nibbles" hold element i in the
// low half of byte i and element i + half in the high half):
//   Q4_0  18 B / 32: d, 16 B nibbles                       value d * (q - 8)
//   Q4_1  20 B / 32: d, m, 16 B nibbles                    value d * q + m
//   Q5_0  22 B / 32: d, 4 B fifth bits (bit i), nibbles    value d * (q - 16)
//   Q5_1  24 B / 32: d, m, 4 B fifth bits, nibbles         value d * q + m
//   Q8_0  34 B / 32: d, 32 int8                            value d * q
//   Q4_K 144 B / 256: d, dmin, 12 B scales, 128 B nibbles  sub-block j of 32: d*sc_j*q - dmin*m_j
//   Q5_K 176 B / 256: d, dmin, 12 B scales, 32 B fifth bits (bit j of byte i), 128 B nibbles
//   Q6_K 210 B / 256: 128 B low nibbles, 64 B high pairs, 16 int8 scales, d
//                     sub-block of 16 k: d * scale_k * (q - 32)

#pragma once

#include <cstdint>
#include <cstring>

namespace vq {

enum QType : int {  // gguf.GGMLQuantizationType values
  Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
};

constexpr int64_t QK = 32;     // activation block (and the 32-element weight block)
constexpr int64_t QK_K = 256;  // K-type super-block; also the activation padding unit
constexpr int64_t GROUP = 8;   // 32-element blocks a kernel decodes at once (one super-block)

struct Layout {
  int64_t block_size;   // elements per block
  int64_t block_bytes;  // bytes per block
};

inline bool known_type(int type) {
  switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K:
      return true;
    default:
      return false;
  }
}

inline Layout layout(int type) {
  switch (type) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    default: return {0, 0};
  }
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// IEEE half to float, exact for every finite value, subnormals included (the same bits as F16C's
// VCVTPH2PS and NumPy's float16 -> float32 cast), in plain C++ for the portable path.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0u);  // inf; NaN quiet
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise the mantissa
    int shift = 0;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      shift++;
    }
    bits = sign | uint32_t(113 - shift) << 23 | ((mantissa & 0x3ff) << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float load_half(const uint8_t* p) { return half_to_float(load_u16(p)); }

// Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (0..7) from the 12 scale bytes s:
// sub-blocks 0-3 in the low 6 bits of s[j] / s[j + 4]; 4-7 from the nibbles of s[j + 4] with
// their top two bits in the spare high bits of s[j - 4] / s[j].
inline void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

}  // namespace vq
