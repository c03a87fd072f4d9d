// Helpers shared by the CPU kernels: portable bfloat16 conversions and exp, and an AVX-512 part
// compiled only where the host has AVX512F + AVX512_BF16 (the kernels are built with
// -march=native); elsewhere the kernels use their portable loops.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace splitserve {

// bfloat16 bits to float (exact).
inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float to bfloat16 bits, rounding to nearest even as at::BFloat16's conversion does.
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Element access for kernels templated on the dtype: float32 as is, bfloat16 as its bits
// (uint16_t). to_dtype<T> rounds a float to T (a no-op for float).
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }
inline float from_float(float v, float* /*tag*/) { return v; }
inline uint16_t from_float(float v, uint16_t* /*tag*/) { return float_to_bf16(v); }

template <typename T>
inline T to_dtype(float v) {
  return from_float(v, static_cast<T*>(nullptr));
}

// exp(x) for x <= 0 to ~2 ulp: 2^n * p(r) after range reduction; a loop of these vectorizes
// (std::exp does not), and exp dominates the softmax of short blocks.
inline float exp_scalar(float x) {
  x = std::max(x, -87.3f);
  const float t = x * 1.44269504088896341f;  // x / ln 2
  const float n = std::floor(t);
  const float r = (t - n) * 0.693147180559945309f;  // in [0, ln 2)
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(float));
  return p * scale;
}

// exp(x) for any x: exp_scalar, and +inf past float's range.
inline float exp_any(float x) { return x > 88.72f ? __builtin_inff() : exp_scalar(x); }

}  // namespace splitserve

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define SPLITSERVE_AVX512_BF16 1

#include <immintrin.h>

namespace splitserve {

// exp(x) for x <= 0 in 16 lanes, the polynomial of exp_scalar: 2^n * p(r).
// Lanes below -87.3 are clamped there (~1e-38), so callers zero masked-out lanes themselves.
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One block's step of the online softmax for one query head: s holds the block's 16 scores,
// valid its live lanes. Updates the running max m and sum l, sets correction (what the
// accumulator is to be multiplied by) and returns the block's weights (0 on dead lanes).
inline __m512 online_softmax16(__m512 s, __mmask16 valid, float& m, float& l, float& correction) {
  const float m_new = std::max(m, _mm512_reduce_max_ps(s));
  correction = exp_scalar(m - m_new);
  const __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
  l = l * correction + _mm512_reduce_add_ps(e);
  m = m_new;
  return e;
}

// Lane i of the result is the sum of the 16 lanes of v[i]: a transpose-and-add tree, 45
// instructions for 16 horizontal sums instead of 16 separate reductions.
inline __m512 hsum16(const __m512* v) {
  __m512 x[8];
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 y[4];  // per 128-bit lane k: the sums over lane k of v[4i .. 4i+3]
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(x[2 * i]);
    const __m512d b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 z01 =
      _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z23 =
      _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z01, z23, 0x88), _mm512_shuffle_f32x4(z01, z23, 0xDD));
}

// 16 bfloat16 values widened to float (exact).
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 32 bfloat16 values as one dot-product operand.
inline __m512bh load_bf16_pairs(const uint16_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}

// 16 floats rounded to bfloat16 (nearest even, like at::BFloat16's conversion).
inline void store_bf16(uint16_t* p, __m512 x) {
  const __m256bh packed = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(packed));
}

}  // namespace splitserve

#endif
