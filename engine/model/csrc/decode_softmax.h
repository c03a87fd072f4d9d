// The online softmax of a group of query heads over float K/V tiles, one block at a time: the
// portable decode loops of paged_decode.cpp (tiles widened from the cache's dtype) and
// paged_decode_quantized.cpp (tiles widened from 8-bit codes, with a scale per row).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "avx512_bf16.h"

namespace splitserve {

constexpr int64_t kMaxDecodeGroup = 16;  // query heads per KV head

template <int64_t dim, int64_t bs>
struct GroupSoftmax {
  alignas(64) float qf[kMaxDecodeGroup][dim];  // the queries, scaled: filled by the caller
  alignas(64) float acc[kMaxDecodeGroup][dim];
  alignas(64) float s[kMaxDecodeGroup][bs];
  float m[kMaxDecodeGroup];
  float l[kMaxDecodeGroup];
  int64_t group = 0;

  void reset(int64_t num_heads) {
    group = num_heads;
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t d = 0; d < dim; ++d) acc[g][d] = 0.f;
      m[g] = -std::numeric_limits<float>::infinity();
      l[g] = 0.f;
    }
  }

  // One block: tokens [t0, t1) of the [bs, dim] tiles kf and vf count. With kScaled, token t's
  // key is kf[t] * k_scale[t] and its value vf[t] * v_scale[t].
  template <bool kScaled>
  void block(const float* kf, const float* vf, const float* k_scale, const float* v_scale,
             int64_t t0, int64_t t1) {
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s[g];
      const float* qg = qf[g];
      for (int64_t t = 0; t < bs; ++t) {
        const float* kr = kf + t * dim;
        float dot = 0.f;
        for (int64_t d = 0; d < dim; ++d) dot += qg[d] * kr[d];
        if constexpr (kScaled) dot *= k_scale[t];
        sg[t] = (t >= t0 && t < t1) ? dot : -std::numeric_limits<float>::infinity();
      }
      float m_new = m[g];
      for (int64_t t = 0; t < bs; ++t) m_new = std::max(m_new, sg[t]);
      const float correction = exp_scalar(m[g] - m_new);
      float sum = 0.f;
      for (int64_t t = 0; t < bs; ++t) {
        sg[t] = (t >= t0 && t < t1) ? exp_scalar(sg[t] - m_new) : 0.f;
        sum += sg[t];
      }
      l[g] = l[g] * correction + sum;
      float* ag = acc[g];
      for (int64_t d = 0; d < dim; ++d) ag[d] *= correction;
      for (int64_t t = t0; t < t1; ++t) {
        float p = sg[t];
        if constexpr (kScaled) p *= v_scale[t];
        const float* vr = vf + t * dim;
        for (int64_t d = 0; d < dim; ++d) ag[d] += p * vr[d];
      }
      m[g] = m_new;
    }
  }

  template <typename T>
  void finish(T* out) const {
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.f / l[g];
      for (int64_t d = 0; d < dim; ++d) out[g * dim + d] = static_cast<T>(acc[g][d] * inv);
    }
  }
};

}  // namespace splitserve
