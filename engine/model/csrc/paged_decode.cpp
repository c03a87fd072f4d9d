// Paged-attention decode for CPU: one query token per sequence, K/V read in place through the
// block tables (no gather copy), online softmax in float32.
// Cache layout: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim].
//
// Per (sequence, KV head) task, per block: the [block_size, head_dim] K and V tiles are
// widened to float once, then shared by the query heads of that KV head (GQA).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "avx512_bf16.h"
#include "decode_softmax.h"
#include "paged_decode_avx2.h"

namespace {

constexpr int64_t kMaxGroup = splitserve::kMaxDecodeGroup;

template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = splitserve::bf16_to_float(s[i]);
}

template <typename T, int64_t dim, int64_t bs>
void decode_one(const T* q, const T* cache, const int64_t* table, int64_t ctx, int64_t start,
                int64_t head_offset, int64_t block_stride, int64_t kv_stride, int64_t group,
                float scale, T* out) {
  splitserve::GroupSoftmax<dim, bs> softmax;
  alignas(64) float kf[bs * dim];  // K tile widened to float
  alignas(64) float vf[bs * dim];  // V tile widened to float
  for (int64_t g = 0; g < group; ++g) {
    widen(q + g * dim, softmax.qf[g], dim);
    for (int64_t d = 0; d < dim; ++d) softmax.qf[g][d] *= scale;
  }
  softmax.reset(group);
  for (int64_t blk = start / bs; blk * bs < ctx; ++blk) {
    const T* k = cache + table[blk] * block_stride + head_offset;
    if ((blk + 1) * bs < ctx) {
      // Blocks are scattered: fetch the next K/V tiles while this one is computed.
      const char* next_k =
          reinterpret_cast<const char*>(cache + table[blk + 1] * block_stride + head_offset);
      for (int64_t off = 0; off < bs * dim * int64_t(sizeof(T)); off += 64) {
        __builtin_prefetch(next_k + off);
        __builtin_prefetch(next_k + kv_stride * int64_t(sizeof(T)) + off);
      }
    }
    widen(k, kf, bs * dim);
    widen(k + kv_stride, vf, bs * dim);
    softmax.template block<false>(kf, vf, nullptr, nullptr, std::max<int64_t>(start - blk * bs, 0),
                                  std::min(bs, ctx - blk * bs));
  }
  softmax.finish(out);
}

#if SPLITSERVE_AVX512_BF16
constexpr int64_t kMaxHeads = 64;  // query heads of one sequence on the bfloat16 path
constexpr int64_t kPrefetchBlocks = 2;

// The bfloat16 path, one task per sequence: per block, the layer's K and V tiles of every KV
// head are one contiguous run (see the cache layout), read front to back and prefetched
// kPrefetchBlocks ahead, since scattered blocks make decode latency-bound. q.k runs as
// bfloat16 pair dot products (exact products, float32 sums) giving a block's 16 scores in one
// vector; the online softmax is vectorized; p.V accumulates in float32 from the V tile.
template <int64_t dim>
void decode_seq_bf16(const uint16_t* q, const uint16_t* cache, const int64_t* table, int64_t ctx,
                     int64_t start, int64_t layer_offset, int64_t block_stride, int64_t kv_heads,
                     int64_t group, float scale, uint16_t* out) {
  constexpr int64_t bs = 16;
  constexpr int64_t kPairVecs = dim / 32;  // bfloat16 dot-product operands per row
  constexpr int64_t kVecs = dim / 16;      // float32 vectors per row
  const int64_t heads = kv_heads * group;
  const int64_t tile = bs * dim;  // elements of one head's K (or V) tile
  const int64_t layer_bytes = 2 * kv_heads * tile * 2;
  alignas(64) float acc[kMaxHeads][dim];
  alignas(64) float p[16];
  float m[kMaxHeads];
  float l[kMaxHeads];
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) acc[h][d] = 0.f;
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(scale);
  const int64_t end_blk = (ctx + bs - 1) / bs;
  for (int64_t blk = start / bs; blk < end_blk; ++blk) {
    if (blk + kPrefetchBlocks < end_blk) {
      const char* ahead = reinterpret_cast<const char*>(
          cache + table[blk + kPrefetchBlocks] * block_stride + layer_offset);
      for (int64_t off = 0; off < layer_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    const int64_t t0 = std::max<int64_t>(start - blk * bs, 0);
    const int64_t t1 = std::min(bs, ctx - blk * bs);
    const __mmask16 valid = static_cast<__mmask16>(((1u << t1) - 1) & ~((1u << t0) - 1));
    const uint16_t* block = cache + table[blk] * block_stride + layer_offset;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const uint16_t* k = block + kvh * tile;
      const uint16_t* v = block + (kv_heads + kvh) * tile;
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        __m512 dots[bs];
        for (int64_t t = 0; t < bs; ++t) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t c = 0; c < kPairVecs; ++c) {
            dot = _mm512_dpbf16_ps(dot, splitserve::load_bf16_pairs(q + h * dim + 32 * c),
                                   splitserve::load_bf16_pairs(k + t * dim + 32 * c));
          }
          dots[t] = dot;
        }
        const __m512 s = _mm512_mask_mul_ps(neg_inf, valid, splitserve::hsum16(dots), scale_v);
        float correction;
        const __m512 e = splitserve::online_softmax16(s, valid, m[h], l[h], correction);
        _mm512_store_ps(p, e);
        __m512 a[kVecs];
        const __m512 corr_v = _mm512_set1_ps(correction);
        for (int64_t c = 0; c < kVecs; ++c) {
          a[c] = _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * c), corr_v);
        }
        for (int64_t t = t0; t < t1; ++t) {
          const __m512 pt = _mm512_set1_ps(p[t]);
          for (int64_t c = 0; c < kVecs; ++c) {
            a[c] = _mm512_fmadd_ps(pt, splitserve::load_bf16(v + t * dim + 16 * c), a[c]);
          }
        }
        for (int64_t c = 0; c < kVecs; ++c) _mm512_store_ps(acc[h] + 16 * c, a[c]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / l[h]);
    for (int64_t c = 0; c < kVecs; ++c) {
      splitserve::store_bf16(out + h * dim + 16 * c,
                             _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * c), inv));
    }
  }
}

// True (and done) when the bfloat16 path covers this call.
bool paged_decode_bf16(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables,
                       const int64_t* lens, int64_t max_blocks, int64_t layer, float scale,
                       int64_t sliding_window, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t layers = kv_cache.size(1), kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  if (q.scalar_type() != at::kBFloat16 || bs != 16 || (dim != 32 && dim != 64 && dim != 128) ||
      heads > kMaxHeads) {
    return false;
  }
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t block_stride = layers * 2 * kv_heads * bs * dim;
  const int64_t layer_offset = layer * 2 * kv_heads * bs * dim;
  const int64_t group = heads / kv_heads;
  auto run = dim == 32   ? decode_seq_bf16<32>
             : dim == 64 ? decode_seq_bf16<64>
                         : decode_seq_bf16<128>;
  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t ctx = lens[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      run(qp + b * heads * dim, cp, tables + b * max_blocks, ctx, start, layer_offset, block_stride,
          kv_heads, group, scale, op + b * heads * dim);
    }
  });
  return true;
}
#endif

// Instantiations for the (head_dim, block_size) pairs in PAGED_DECODE_SHAPES (cpu_kernels.py).
template <typename T>
void decode_task(const T* q, const T* cache, const int64_t* table, int64_t ctx, int64_t start,
                 int64_t head_offset, int64_t block_stride, int64_t kv_stride, int64_t group,
                 int64_t dim, int64_t bs, float scale, T* out) {
  if (bs == 16) {
    switch (dim) {
      case 16:
        return decode_one<T, 16, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                     kv_stride, group, scale, out);
      case 32:
        return decode_one<T, 32, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                     kv_stride, group, scale, out);
      case 64:
        return decode_one<T, 64, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                     kv_stride, group, scale, out);
      case 128:
        return decode_one<T, 128, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                      kv_stride, group, scale, out);
    }
  }
  TORCH_CHECK(false, "paged_decode: head_dim ", dim, " block_size ", bs, " not built");
}

}  // namespace

// q: [B, H, D] contiguous; kv_cache: [NB, L, 2, KVH, BS, D] contiguous;
// block_tables: [B, max_blocks] int64; context_lens: [B] int64 (>= 1). Returns [B, H, D].
at::Tensor paged_decode(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                        at::Tensor context_lens, int64_t layer, double scale,
                        int64_t sliding_window) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and cache dtypes differ");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t layers = kv_cache.size(1), kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(group <= kMaxGroup, "paged_decode: too many query heads per KV head");
  TORCH_CHECK(heads == group * kv_heads, "paged_decode: heads not a multiple of KV heads");
  auto out = at::empty_like(q);
  const int64_t block_stride = layers * 2 * kv_heads * bs * dim;
  const int64_t kv_stride = kv_heads * bs * dim;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
#if SPLITSERVE_AVX512_BF16
  if (paged_decode_bf16(q, kv_cache, tables, lens, max_blocks, layer, static_cast<float>(scale),
                        sliding_window, out)) {
    return out;
  }
#endif
#if SPLITSERVE_AVX2
  if (paged_decode_avx2(q, kv_cache, tables, lens, max_blocks, layer, static_cast<float>(scale),
                        sliding_window, out)) {
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* cp = kv_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / kv_heads, h = i % kv_heads;
        const int64_t ctx = lens[b];
        const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
        const int64_t q_offset = (b * heads + h * group) * dim;
        decode_task<scalar_t>(qp + q_offset, cp, tables + b * max_blocks, ctx, start,
                              (layer * 2 * kv_heads + h) * bs * dim, block_stride, kv_stride, group,
                              dim, bs, static_cast<float>(scale), op + q_offset);
      }
    });
  });
  return out;
}
