// 8-bit KV cache rows on the CPU, in one pass each (engine/model/kv_quant.py is the torch
// reference): kv_write_quantized quantizes a step's new K/V into their cache rows;
// dequantize_kv_blocks widens one layer of some blocks into a scratch cache for the prefill
// kernel. A row is head_dim codes and its float32 scale (the row's absmax over 127 or 448);
// int8 keys are stored rotated by the normalized Hadamard matrix, applied here as a fast
// Walsh-Hadamard transform (its own inverse).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kv_rows.h"

namespace {

constexpr int64_t kScaleBytes = splitserve::kKvScaleBytes;
constexpr int64_t kMaxDim = 256;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }

template <typename T>
void quantize_row(const T* src, int64_t dim, bool int8, bool rotate, uint8_t* row) {
  float x[kMaxDim];
  for (int64_t d = 0; d < dim; ++d) x[d] = load(src, d);
  if (rotate) splitserve::hadamard(x, dim);
  float absmax = 0.f;
  for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(x[d]));
  const float scale = absmax > 0.f ? absmax / (int8 ? 127.f : 448.f) : 1.f;
  if (int8) {
    for (int64_t d = 0; d < dim; ++d) {
      const float q = std::nearbyint(x[d] / scale);
      row[d] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(q, -127.f, 127.f)));
    }
  } else {
    for (int64_t d = 0; d < dim; ++d) {
      row[d] = splitserve::float_to_e4m3(std::clamp(x[d] / scale, -448.f, 448.f));
    }
  }
  std::memcpy(row + dim, &scale, sizeof(float));
}

template <typename T>
void dequantize_row(const uint8_t* row, int64_t dim, bool int8, bool rotate, T* dst) {
  float x[kMaxDim];
  float scale;
  std::memcpy(&scale, row + dim, sizeof(float));
  for (int64_t d = 0; d < dim; ++d) {
    const float code =
        int8 ? static_cast<float>(static_cast<int8_t>(row[d])) : splitserve::e4m3_to_float(row[d]);
    x[d] = code * scale;
  }
  if (rotate) splitserve::hadamard(x, dim);
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(x[d]);
}

void check(const at::Tensor& kv_cache, int64_t kind, int64_t dim, bool rotate) {
  TORCH_CHECK(kv_cache.scalar_type() == at::kByte && kv_cache.is_contiguous(),
              "8-bit KV: the cache must be contiguous uint8");
  TORCH_CHECK(kind == 0 || kind == 1, "8-bit KV: kind is 0 (int8) or 1 (fp8 e4m3)");
  TORCH_CHECK(kv_cache.size(5) == dim + kScaleBytes && dim <= kMaxDim, "8-bit KV: bad row size");
  TORCH_CHECK(!rotate || (dim & (dim - 1)) == 0, "8-bit KV: rotation needs a power-of-two dim");
}

}  // namespace

// kv_cache: uint8 [NB, L, 2, KVH, BS, D + 4]; slot_rows: [T, KVH] int64, layer 0's key rows (as
// PagedKVCache.slot_rows); k, v: [T, KVH, D] float32 or bfloat16, contiguous; kind: 0 int8,
// 1 fp8 e4m3; rotate_keys: store H k instead of k.
void kv_write_quantized(at::Tensor kv_cache, at::Tensor slot_rows, at::Tensor k, at::Tensor v,
                        int64_t layer, int64_t kind, bool rotate_keys) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  check(kv_cache, kind, dim, rotate_keys);
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && slot_rows.is_contiguous());
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && slot_rows.scalar_type() == at::kLong);
  const int64_t bs = kv_cache.size(4), row_bytes = dim + kScaleBytes;
  const int64_t layer_rows = layer * 2 * kv_heads * bs;
  uint8_t* base = kv_cache.data_ptr<uint8_t>();
  const int64_t* rows = slot_rows.data_ptr<int64_t>();
  const bool int8 = kind == 0;
  auto write = [&](auto* kp, auto* vp) {
    at::parallel_for(0, tokens * kv_heads, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t key_row = rows[i] + layer_rows;
        quantize_row(kp + i * dim, dim, int8, rotate_keys, base + key_row * row_bytes);
        quantize_row(vp + i * dim, dim, int8, false, base + (key_row + kv_heads * bs) * row_bytes);
      }
    });
  };
  if (k.scalar_type() == at::kFloat) {
    write(k.data_ptr<float>(), v.data_ptr<float>());
  } else {
    TORCH_CHECK(k.scalar_type() == at::kBFloat16, "kv_write_quantized: k float32 or bfloat16");
    write(k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>());
  }
}

// out: [n, 1, 2, KVH, BS, D] float32 or bfloat16, contiguous: layer `layer` of blocks
// block_ids [n] (int64), dequantized, keys rotated back when rotate_keys.
void dequantize_kv_blocks(at::Tensor kv_cache, at::Tensor block_ids, int64_t layer, int64_t kind,
                          bool rotate_keys, at::Tensor out) {
  const int64_t dim = out.size(5);
  check(kv_cache, kind, dim, rotate_keys);
  TORCH_CHECK(out.is_contiguous() && block_ids.scalar_type() == at::kLong);
  const int64_t layers = kv_cache.size(1), kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  const int64_t row_bytes = dim + kScaleBytes;
  const int64_t layer_rows = 2 * kv_heads * bs;  // rows of one block's layer
  const uint8_t* base = kv_cache.data_ptr<uint8_t>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  const int64_t n = block_ids.size(0);
  const bool int8 = kind == 0;
  auto run = [&](auto* op) {
    at::parallel_for(0, n * layer_rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / layer_rows, r = i % layer_rows;
        const bool is_key = r < kv_heads * bs;
        const uint8_t* row = base + ((ids[b] * layers + layer) * layer_rows + r) * row_bytes;
        dequantize_row(row, dim, int8, rotate_keys && is_key, op + i * dim);
      }
    });
  };
  if (out.scalar_type() == at::kFloat) {
    run(out.data_ptr<float>());
  } else {
    TORCH_CHECK(out.scalar_type() == at::kBFloat16, "dequantize_kv_blocks: out float32 or bf16");
    run(out.data_ptr<c10::BFloat16>());
  }
}
