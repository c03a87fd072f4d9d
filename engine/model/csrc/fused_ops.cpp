// Fused elementwise ops for CPU, in float32 and bfloat16: each is one pass over memory instead
// of the three to six torch ops (and their bfloat16 <-> float32 round trips) it replaces, with
// the same rounding points as those ops in that dtype (in float32, every rounding to the dtype
// is a no-op), so results equal the torch composition except where torch's own reductions or
// exp differ in the last float32 bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx512_bf16.h"

namespace {

// Elements per parallel task: a decode step's 64 rows are still split over the threads.
constexpr int64_t kElementsPerTask = 16384;

inline int64_t rows_per_task(int64_t width) {
  return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(width, 1));
}

using splitserve::to_dtype;
using splitserve::to_float;

// A float32 value rounded to T and back: where torch's op chain rounds to the dtype.
template <typename T>
inline float round_to(float v) {
  return to_float(to_dtype<T>(v));
}

#if SPLITSERVE_AVX512_BF16
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return splitserve::load_bf16(p); }
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) { splitserve::store_bf16(p, x); }

template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m256bh packed = _mm512_cvtneps_pbh(v);
    const __m256i bits = reinterpret_cast<const __m256i&>(packed);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
}

// x * sigmoid(x) with e = exp(-|x|) <= 1, exp512's range: x / (1 + e) for x >= 0 and
// x * e / (1 + e) below (the scalar loop's x / (1 + exp(-x)), without its overflow).
inline __m512 silu512(__m512 x) {
  const __m512 e = splitserve::exp512(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.f), e));
}
#endif

template <typename T>
const T* ptr(const at::Tensor& t);
template <>
const float* ptr<float>(const at::Tensor& t) {
  return t.data_ptr<float>();
}
template <>
const uint16_t* ptr<uint16_t>(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

template <typename T>
T* mut(at::Tensor& t) {
  return const_cast<T*>(ptr<T>(t));
}

void check_dtype(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, name,
              ": float32 or bfloat16 only");
}

void check_rows(const at::Tensor& x, const char* name) {
  check_dtype(x, name);
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows with a dense last dim expected");
}

// Runs fn.template operator()<T>() with T the element type of x (float or uint16_t bits).
template <typename Fn>
void dispatch(const at::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(static_cast<float*>(nullptr));
  } else {
    fn(static_cast<uint16_t*>(nullptr));
  }
}

}  // namespace

// Hugging Face's RMSNorm: normalize in float32, round, then scale by weight (rounded).
// With `residual`, first residual := residual + x (rounded, in place) and normalize that:
// the decoder's residual add fused into the next norm. Returns the normalized rows.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps,
                    c10::optional<at::Tensor> residual) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous, in x's dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.size(0) == hidden, "rms_norm: weight size");
  auto out = at::empty({rows, hidden}, x.options());
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "rms_norm: residual dtype");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == hidden);
  }
  const int64_t x_stride = x.stride(0);
  const int64_t res_stride = residual.has_value() ? residual->stride(0) : 0;
  const float epsf = static_cast<float>(eps);
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* xp = ptr<T>(x);
    const T* wp = ptr<T>(weight);
    T* res = residual.has_value() ? mut<T>(*residual) : nullptr;
    T* op = mut<T>(out);
    at::parallel_for(0, rows, rows_per_task(hidden), [&](int64_t begin, int64_t end) {
      std::vector<float> row(hidden);
      for (int64_t r = begin; r < end; ++r) {
        const T* xr = xp + r * x_stride;
        if (res != nullptr) {
          T* rr = res + r * res_stride;
          for (int64_t i = 0; i < hidden; ++i) {
            rr[i] = to_dtype<T>(to_float(rr[i]) + to_float(xr[i]));
            row[i] = to_float(rr[i]);
          }
        } else {
          for (int64_t i = 0; i < hidden; ++i) row[i] = to_float(xr[i]);
        }
        float sum_sq = 0.f;
        for (int64_t i = 0; i < hidden; ++i) sum_sq += row[i] * row[i];
        const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + epsf);
        T* orow = op + r * hidden;
        for (int64_t i = 0; i < hidden; ++i)
          orow[i] = to_dtype<T>(round_to<T>(row[i] * inv) * to_float(wp[i]));
      }
    });
  });
  return out;
}

// silu(gate) * up for gate_up = [gate | up] rows, rounding after the SiLU as torch's two ops do.
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width, "silu_and_mul: odd width");
  auto out = at::empty({rows, width}, gate_up.options());
  const int64_t stride = gate_up.stride(0);
  dispatch(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* gp = ptr<T>(gate_up);
    T* op = mut<T>(out);
    at::parallel_for(0, rows, rows_per_task(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = gp + r * stride;
        const T* u = g + width;
        T* o = op + r * width;
        int64_t i = 0;
#if SPLITSERVE_AVX512_BF16
        for (; i + 16 <= width; i += 16) {
          const __m512 silu = round_to<T>(silu512(load16(g + i)));
          store16(o + i, _mm512_mul_ps(silu, load16(u + i)));
        }
#endif
        for (; i < width; ++i) {
          const float x = to_float(g[i]);
          const float silu = round_to<T>(x / (1.f + splitserve::exp_any(-x)));
          o[i] = to_dtype<T>(silu * to_float(u[i]));
        }
      }
    });
  });
  return out;
}

// Rotates heads [0, num_heads) of x [T, heads, D] in place: x * cos + cat(x2, x1) * sin with
// the tables of RotaryEmbedding.cos_sin ([T, 1, D]: [cos, cos] and [-sin, sin]), rounding
// after each multiply and the add as torch's three ops do.
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t num_heads) {
  check_dtype(x, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_: [T, heads, D] with a dense last dim");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary_: contiguous cos/sin tables in x's dtype expected");
  const int64_t tokens = x.size(0), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(num_heads <= x.size(1) && cos.numel() == tokens * dim && sin.numel() == tokens * dim);
  const int64_t st = x.stride(0), sh = x.stride(1);
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    T* xp = mut<T>(x);
    const T* cp = ptr<T>(cos);
    const T* sp = ptr<T>(sin);
    at::parallel_for(0, tokens, rows_per_task(num_heads * dim), [&](int64_t begin, int64_t end) {
      std::vector<float> v(dim);
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cp + t * dim;
        const T* s = sp + t * dim;
        for (int64_t h = 0; h < num_heads; ++h) {
          T* row = xp + t * st + h * sh;
          for (int64_t d = 0; d < dim; ++d) v[d] = to_float(row[d]);
          for (int64_t d = 0; d < dim; ++d) {
            const float rotated = v[d < half ? d + half : d - half];
            row[d] = to_dtype<T>(round_to<T>(v[d] * to_float(c[d])) +
                                 round_to<T>(rotated * to_float(s[d])));
          }
        }
      }
    });
  });
}
