// The 8-bit KV row format shared by the kernels that read and write it (engine/model/kv_quant.py
// is the torch reference): head_dim one-byte codes (int8, or fp8 e4m3fn) then the row's float32
// scale; value = code * scale.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace splitserve {

constexpr int64_t kKvScaleBytes = 4;

inline uint32_t float_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float bits_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// fp8 e4m3fn (bias 7, no infinities; the codes written never hold its NaN) to float, exactly:
// normals move their exponent and mantissa into float's fields and rebias by 120; subnormals
// are m * 2^-9.
inline float e4m3_to_float(uint8_t c) {
  const uint32_t em = c & 0x7Fu;
  const float mag =
      em < 8 ? static_cast<float>(em) * 0x1p-9f : bits_float((em << 20) + (120u << 23));
  return (c & 0x80u) ? -mag : mag;
}

// |x| <= 448 to fp8 e4m3fn, rounding to nearest even (as torch's conversion).
inline uint8_t float_to_e4m3(float x) {
  const uint32_t bits = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const float a = std::fabs(x);
  if (a >= 448.f) return sign | 0x7E;
  if (a < 0x1p-6f) return sign | static_cast<uint8_t>(std::nearbyint(a * 512.f));
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const uint32_t rounded = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20;
  return sign | static_cast<uint8_t>(rounded - (120u << 3));
}

// x <- H x / sqrt(n), H Sylvester's Hadamard matrix of order n (a power of two): the fast
// Walsh-Hadamard transform, its own inverse (kv_quant.key_rotation in torch).
inline void hadamard(float* x, int64_t n) {
  for (int64_t len = 1; len < n; len <<= 1) {
    for (int64_t i = 0; i < n; i += 2 * len) {
      for (int64_t j = i; j < i + len; ++j) {
        const float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
    }
  }
  const float norm = 1.f / std::sqrt(static_cast<float>(n));
  for (int64_t i = 0; i < n; ++i) x[i] *= norm;
}

}  // namespace splitserve
