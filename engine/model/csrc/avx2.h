// AVX2 + FMA helpers shared by the CPU kernels, compiled where the build's level has them
// (engine/cpu_isa.py: every level from AVX2 up); elsewhere the kernels use their portable
// loops.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define SPLITSERVE_AVX2 1

#include <immintrin.h>

#include <cstdint>

namespace splitserve {

// exp(x) for x <= 0 in 8 lanes, the polynomial of exp_scalar (avx512_bf16.h): 2^n * p(r).
// Lanes below -87.3 are clamped there (~1e-38), so callers zero masked-out lanes themselves.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_floor_ps(t);
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.f / 5040.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// Lane i of the result is the sum of the 8 lanes of v[i]: a horizontal-add tree, 10
// instructions for 8 sums.
inline __m256 hsum8(const __m256* v) {
  const __m256 h01 = _mm256_hadd_ps(v[0], v[1]);
  const __m256 h23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 h45 = _mm256_hadd_ps(v[4], v[5]);
  const __m256 h67 = _mm256_hadd_ps(v[6], v[7]);
  // Per 128-bit lane: [s0 s1 s2 s3] and [s4 s5 s6 s7], each the half-lane partial sums.
  const __m256 h0123 = _mm256_hadd_ps(h01, h23);
  const __m256 h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20),
                       _mm256_permute2f128_ps(h0123, h4567, 0x31));
}

// The largest and the sum of the 8 lanes of v.
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hadd8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// 8 values widened to float: float32 as is, bfloat16 exactly (bits shifted up).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

}  // namespace splitserve

#endif
