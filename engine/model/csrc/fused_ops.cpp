// Fused bfloat16 elementwise ops for CPU: each is one pass over memory instead of the three to
// six torch ops (and their bfloat16 <-> float32 round trips) it replaces, with the same
// rounding points as those ops, so results equal the torch composition except where torch's
// own reductions or exp differ in the last float32 bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "avx512_bf16.h"

namespace {

constexpr int64_t kRowsPerTask = 64;

using splitserve::bf16_to_float;
using splitserve::float_to_bf16;

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

const uint16_t* bf16_ptr(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

uint16_t* bf16_mut(at::Tensor& t) {
  return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>());
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, name, ": bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows with a dense last dim expected");
}

}  // namespace

// Hugging Face's RMSNorm: normalize in float32, round, then scale by weight (rounded).
// With `residual`, first residual := residual + x (rounded, in place) and normalize that:
// the decoder's residual add fused into the next norm. Returns the normalized rows.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps,
                    c10::optional<at::Tensor> residual) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kBFloat16);
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.size(0) == hidden, "rms_norm: weight size");
  auto out = at::empty({rows, hidden}, x.options());
  uint16_t* res = nullptr;
  int64_t res_stride = 0;
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == hidden);
    res = bf16_mut(*residual);
    res_stride = residual->stride(0);
  }
  const uint16_t* xp = bf16_ptr(x);
  const uint16_t* wp = bf16_ptr(weight);
  uint16_t* op = bf16_mut(out);
  const int64_t x_stride = x.stride(0);
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* xr = xp + r * x_stride;
      if (res != nullptr) {
        uint16_t* rr = res + r * res_stride;
        for (int64_t i = 0; i < hidden; ++i) {
          rr[i] = float_to_bf16(bf16_to_float(rr[i]) + bf16_to_float(xr[i]));
          row[i] = bf16_to_float(rr[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) row[i] = bf16_to_float(xr[i]);
      }
      float sum_sq = 0.f;
      for (int64_t i = 0; i < hidden; ++i) sum_sq += row[i] * row[i];
      const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + epsf);
      uint16_t* orow = op + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        orow[i] = float_to_bf16(round_bf16(row[i] * inv) * bf16_to_float(wp[i]));
    }
  });
  return out;
}

// silu(gate) * up for gate_up = [gate | up] rows, rounding after the SiLU as torch's two ops do.
at::Tensor silu_and_mul(at::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) == 2 * width, "silu_and_mul: odd width");
  auto out = at::empty({rows, width}, gate_up.options());
  const uint16_t* gp = bf16_ptr(gate_up);
  uint16_t* op = bf16_mut(out);
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = gp + r * stride;
      const uint16_t* u = g + width;
      uint16_t* o = op + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float x = bf16_to_float(g[i]);
        const float silu = round_bf16(x / (1.f + splitserve::exp_any(-x)));
        o[i] = float_to_bf16(silu * bf16_to_float(u[i]));
      }
    }
  });
  return out;
}

// Rotates heads [0, num_heads) of x [T, heads, D] in place: x * cos + cat(x2, x1) * sin with
// the tables of RotaryEmbedding.cos_sin ([T, 1, D]: [cos, cos] and [-sin, sin]), rounding
// after each multiply and the add as torch's three ops do.
void rotary_(at::Tensor x, at::Tensor cos, at::Tensor sin, int64_t num_heads) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3 && x.stride(2) == 1,
              "rotary_: bfloat16 [T, heads, D] with a dense last dim expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16);
  const int64_t tokens = x.size(0), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(num_heads <= x.size(1) && cos.numel() == tokens * dim && sin.numel() == tokens * dim);
  uint16_t* xp = bf16_mut(x);
  const uint16_t* cp = bf16_ptr(cos);
  const uint16_t* sp = bf16_ptr(sin);
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> v(dim);
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* c = cp + t * dim;
      const uint16_t* s = sp + t * dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        uint16_t* row = xp + t * st + h * sh;
        for (int64_t d = 0; d < dim; ++d) v[d] = bf16_to_float(row[d]);
        for (int64_t d = 0; d < dim; ++d) {
          const float rotated = v[d < half ? d + half : d - half];
          row[d] = float_to_bf16(round_bf16(v[d] * bf16_to_float(c[d])) +
                                 round_bf16(rotated * bf16_to_float(s[d])));
        }
      }
    }
  });
}
