// The AVX2 + FMA path of paged-attention decode (float32 and bfloat16), built at every level
// from AVX2 up; paged_decode.cpp calls it where the AVX-512 BF16 path does not apply.
//
// One task per sequence, or per run of a sequence's rows (a decode with draft tokens), or per
// (sequence, KV head) when there are fewer of those than threads: per block, the layer's K and
// V tiles of its KV heads are one contiguous run (see the cache layout), read in place front
// to back and prefetched kPrefetchBlocks ahead, since scattered blocks make decode
// latency-bound. q.k runs as 8-wide FMAs over head_dim, giving a block's 16 scores in two
// vectors after a horizontal-add tree; the online softmax is vectorized; p.V accumulates in
// float32 registers.
#include "paged_decode_avx2.h"

#include "avx2.h"

#if SPLITSERVE_AVX2

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "avx512_bf16.h"
#include "decode_runs.h"

namespace {

constexpr int64_t kBlockSize = 16;
constexpr int64_t kMaxHeads = 64;  // query heads of one sequence
constexpr int64_t kPrefetchBlocks = 2;

using splitserve::to_dtype;
using splitserve::to_float;

// Lanes t of [base, base + 8) with t0 <= t < t1, as an all-ones mask.
inline __m256 lane_mask(int64_t base, int64_t t0, int64_t t1) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lo = _mm256_set1_epi32(static_cast<int32_t>(t0 - base - 1));
  const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(t1 - base));
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_cmpgt_epi32(idx, lo), _mm256_cmpgt_epi32(hi, idx)));
}

// Decode of KV heads [kvh0, kvh1) of ``rows`` consecutive query positions of one sequence
// (one, or a decode with draft tokens): row r sees the first ctx + r tokens, and its query and
// output heads follow row r - 1's; q and out point at row 0's first head.
template <typename T, int64_t dim>
void decode_heads(const T* q, const T* cache, const int64_t* table, int64_t ctx, int64_t rows,
                  int64_t sliding_window, int64_t layer_offset, int64_t block_stride,
                  int64_t kv_heads, int64_t kvh0, int64_t kvh1, int64_t group, float scale,
                  T* out) {
  constexpr int64_t bs = kBlockSize;
  constexpr int64_t kVecs = dim / 8;
  const int64_t tile = bs * dim;
  const int64_t layer_bytes = 2 * kv_heads * tile * static_cast<int64_t>(sizeof(T));
  const int64_t seq_heads = kv_heads * group;
  const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
  alignas(32) float qf[kMaxHeads][dim];  // q * scale, widened once; row r's head h: r * H + h
  alignas(32) float acc[kMaxHeads][dim];
  alignas(32) float p[bs];
  float m[kMaxHeads];
  float l[kMaxHeads];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = r * seq_heads + kvh0 * group; h < r * seq_heads + kvh1 * group; ++h) {
      for (int64_t d = 0; d < dim; ++d) {
        qf[h][d] = to_float(q[h * dim + d]) * scale;
        acc[h][d] = 0.f;
      }
      m[h] = -std::numeric_limits<float>::infinity();
      l[h] = 0.f;
    }
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t end_blk = (ctx + rows - 1 + bs - 1) / bs;
  for (int64_t blk = start / bs; blk < end_blk; ++blk) {
    if (blk + kPrefetchBlocks < end_blk) {
      const char* ahead = reinterpret_cast<const char*>(
          cache + table[blk + kPrefetchBlocks] * block_stride + layer_offset);
      for (int64_t off = 0; off < layer_bytes; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    }
    const T* block = cache + table[blk] * block_stride + layer_offset;
    for (int64_t kvh = kvh0; kvh < kvh1; ++kvh) {
      const T* k = block + kvh * tile;
      const T* v = block + (kv_heads + kvh) * tile;
      for (int64_t qi = 0; qi < rows * group; ++qi) {
        const int64_t r = qi / group;
        const int64_t h = r * seq_heads + kvh * group + qi % group;
        const auto [t0, t1] =
            splitserve::row_tokens_in_block(ctx + r, sliding_window, blk * bs, bs);
        if (t1 <= t0) continue;  // this row sees none of the block
        const __m256 valid_lo = lane_mask(0, t0, t1);
        const __m256 valid_hi = lane_mask(8, t0, t1);
        __m256 dots[bs];
        for (int64_t t = 0; t < bs; ++t) {
          __m256 dot = _mm256_setzero_ps();
          for (int64_t c = 0; c < kVecs; ++c) {
            dot = _mm256_fmadd_ps(_mm256_load_ps(qf[h] + 8 * c),
                                  splitserve::load8(k + t * dim + 8 * c), dot);
          }
          dots[t] = dot;
        }
        const __m256 s_lo = _mm256_blendv_ps(neg_inf, splitserve::hsum8(dots), valid_lo);
        const __m256 s_hi = _mm256_blendv_ps(neg_inf, splitserve::hsum8(dots + 8), valid_hi);
        const float m_new = std::max(m[h], splitserve::hmax8(_mm256_max_ps(s_lo, s_hi)));
        const float correction = splitserve::exp_scalar(m[h] - m_new);
        const __m256 m_v = _mm256_set1_ps(m_new);
        const __m256 e_lo = _mm256_and_ps(splitserve::exp256(_mm256_sub_ps(s_lo, m_v)), valid_lo);
        const __m256 e_hi = _mm256_and_ps(splitserve::exp256(_mm256_sub_ps(s_hi, m_v)), valid_hi);
        l[h] = l[h] * correction + splitserve::hadd8(_mm256_add_ps(e_lo, e_hi));
        m[h] = m_new;
        _mm256_store_ps(p, e_lo);
        _mm256_store_ps(p + 8, e_hi);
        __m256 a[kVecs];
        const __m256 corr_v = _mm256_set1_ps(correction);
        for (int64_t c = 0; c < kVecs; ++c)
          a[c] = _mm256_mul_ps(_mm256_load_ps(acc[h] + 8 * c), corr_v);
        for (int64_t t = t0; t < t1; ++t) {
          const __m256 pt = _mm256_set1_ps(p[t]);
          for (int64_t c = 0; c < kVecs; ++c) {
            a[c] = _mm256_fmadd_ps(pt, splitserve::load8(v + t * dim + 8 * c), a[c]);
          }
        }
        for (int64_t c = 0; c < kVecs; ++c) _mm256_store_ps(acc[h] + 8 * c, a[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = r * seq_heads + kvh0 * group; h < r * seq_heads + kvh1 * group; ++h) {
      const float inv = 1.f / l[h];
      for (int64_t d = 0; d < dim; ++d) out[h * dim + d] = to_dtype<T>(acc[h][d] * inv);
    }
  }
}

template <typename T>
void run(const T* qp, const T* cp, const int64_t* tables, const int64_t* lens, int64_t batch,
         int64_t heads, int64_t dim, int64_t max_blocks, int64_t layer_offset, int64_t block_stride,
         int64_t kv_heads, float scale, int64_t sliding_window, T* op) {
  const int64_t group = heads / kv_heads;
  auto heads_fn = dim == 32   ? decode_heads<T, 32>
                  : dim == 64 ? decode_heads<T, 64>
                              : decode_heads<T, 128>;
  // One task per run of a sequence's rows (decode_runs.h). Whole runs keep each block's K/V
  // one contiguous read; split by KV head only when there are too few runs to keep every
  // thread busy.
  const std::vector<int64_t> firsts = splitserve::shared_table_runs(
      tables, lens, batch, max_blocks, kBlockSize, kMaxHeads / heads);
  const int64_t num_runs = static_cast<int64_t>(firsts.size()) - 1;
  const int64_t per_seq = num_runs < at::get_num_threads() ? kv_heads : 1;
  at::parallel_for(0, num_runs * per_seq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = firsts[i / per_seq];
      const int64_t kvh0 = per_seq == 1 ? 0 : i % per_seq;
      const int64_t kvh1 = per_seq == 1 ? kv_heads : kvh0 + 1;
      heads_fn(qp + b * heads * dim, cp, tables + b * max_blocks, lens[b],
               firsts[i / per_seq + 1] - b, sliding_window, layer_offset, block_stride, kv_heads,
               kvh0, kvh1, group, scale, op + b * heads * dim);
    }
  });
}

}  // namespace

bool paged_decode_avx2(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables,
                       const int64_t* lens, int64_t max_blocks, int64_t layer, float scale,
                       int64_t sliding_window, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t layers = kv_cache.size(1), kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  if ((!is_bf16 && q.scalar_type() != at::kFloat) || bs != kBlockSize ||
      (dim != 32 && dim != 64 && dim != 128) || heads > kMaxHeads) {
    return false;
  }
  const int64_t block_stride = layers * 2 * kv_heads * bs * dim;
  const int64_t layer_offset = layer * 2 * kv_heads * bs * dim;
  if (is_bf16) {
    run(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>()), tables, lens, batch,
        heads, dim, max_blocks, layer_offset, block_stride, kv_heads, scale, sliding_window,
        reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
  } else {
    run(q.data_ptr<float>(), kv_cache.data_ptr<float>(), tables, lens, batch, heads, dim,
        max_blocks, layer_offset, block_stride, kv_heads, scale, sliding_window,
        out.data_ptr<float>());
  }
  return true;
}

#endif
