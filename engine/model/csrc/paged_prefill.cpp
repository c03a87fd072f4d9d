// Paged-attention prefill for CPU: every prefill chunk of a step attends causally to its whole
// context, the cached prefix and its own tokens, read in place from the paged cache (the
// chunk's K/V are written there first). No gather copy, no mask tensor, one call per layer for
// all chunks. Cache layout: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim].
// The work split is prefill_tasks.h's; this file has the entry point and the bfloat16 path
// (AVX-512 BF16); paged_prefill_avx2.cpp has the float32 path (AVX2).
//
// bfloat16: per 16-key block the K tile is transposed once into bfloat16 pairs per key, so each
// row's 16 scores come out of head_dim / 2 pair dot products as one vector, and the V tile is
// interleaved once into pairs of keys, so p.V is head_dim / 16 pair dot products per key pair.
// Softmax is online, in float32; the probabilities are rounded to bfloat16 for p.V, as Hugging
// Face's eager attention rounds them before its p.V matmul.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "avx512_bf16.h"
#include "paged_prefill_avx2.h"
#include "prefill_tasks.h"

using splitserve::PrefillChunk;
using splitserve::PrefillLayout;
using splitserve::PrefillTask;

#if SPLITSERVE_AVX512_BF16

namespace {

constexpr int64_t kBlock = splitserve::kPrefillBlock;
constexpr int64_t kMaxRows = splitserve::kPrefillMaxRows;
constexpr int64_t kRowStep = 8;  // rows sharing one pass over the transposed K tile
using Task = PrefillTask;
using Chunk = PrefillChunk;
using Layout = PrefillLayout<uint16_t>;

// acc lanes hold head dims in the order the unpack instructions interleave V (within each
// 128-bit lane); this restores dim order for the 32 dims of vectors 2c (lo) and 2c + 1 (hi).
inline void store_unpermuted(uint16_t* dst, __m512 lo, __m512 hi, __m512 inv) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  splitserve::store_bf16(dst, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), inv));
  splitserve::store_bf16(dst + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), inv));
}

template <int64_t dim>
void prefill_task(const Task& task, const Chunk& chunk, const Layout& lay) {
  constexpr int64_t kPairs = dim / 2;  // bfloat16 pairs per row
  constexpr int64_t kVecs = dim / 16;  // float32 vectors per row
  const int64_t tile = kBlock * dim;
  const int64_t group = lay.group;
  const int64_t rows = (task.q_end - task.q_begin) * group;
  const int64_t padded_rows = (rows + kRowStep - 1) / kRowStep * kRowStep;

  alignas(64) uint32_t q_rows[kMaxRows][kPairs];
  alignas(64) float acc[kMaxRows][dim];
  alignas(64) uint32_t kt[kPairs][kBlock];   // kt[j][t]: pair j of key t
  alignas(64) uint32_t vp[kBlock / 2][dim];  // keys (2i, 2i+1) interleaved per dim
  alignas(64) uint32_t p_pairs[kRowStep][kBlock / 2];
  int32_t pos[kMaxRows];
  float m[kMaxRows];
  float l[kMaxRows];
  float corr[kRowStep];
  bool active[kRowStep];

  // Row r = i * group + g: query position i of the tile, query head g of the KV head.
  for (int64_t r = 0; r < padded_rows; ++r) {
    const int64_t src_row = std::min(r, rows - 1);
    std::memcpy(q_rows[r], lay.q_row(task, chunk, src_row), dim * sizeof(uint16_t));
    pos[r] = lay.position(task, chunk, src_row);
    std::fill(acc[r], acc[r] + dim, 0.f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }

  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 scale_v = _mm512_set1_ps(lay.scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t blk = task.key_begin / kBlock; blk * kBlock < task.key_end; ++blk) {
    const uint16_t* base = lay.cache + chunk.table[blk] * lay.block_stride + lay.layer_offset;
    const uint32_t* k32 = reinterpret_cast<const uint32_t*>(base + task.kv_head * tile);
    for (int64_t t = 0; t < kBlock; ++t) {
      for (int64_t j = 0; j < kPairs; ++j) kt[j][t] = k32[t * kPairs + j];
    }
    const uint16_t* v = base + (lay.kv_heads + task.kv_head) * tile;
    for (int64_t tp = 0; tp < kBlock / 2; ++tp) {
      for (int64_t c = 0; c < dim / 32; ++c) {
        const __m512i a = _mm512_loadu_si512(v + (2 * tp) * dim + 32 * c);
        const __m512i b = _mm512_loadu_si512(v + (2 * tp + 1) * dim + 32 * c);
        _mm512_store_si512(vp[tp] + 32 * c, _mm512_unpacklo_epi16(a, b));
        _mm512_store_si512(vp[tp] + 32 * c + 16, _mm512_unpackhi_epi16(a, b));
      }
    }
    const __m512i key_pos =
        _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(blk * kBlock)), lane);

    for (int64_t rb = 0; rb < padded_rows; rb += kRowStep) {
      __m512 s[kRowStep];
      for (int64_t r = 0; r < kRowStep; ++r) s[r] = _mm512_setzero_ps();
      for (int64_t j = 0; j < kPairs; ++j) {
        const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_load_si512(kt[j]));
        for (int64_t r = 0; r < kRowStep; ++r) {
          const __m512bh qq = reinterpret_cast<__m512bh>(
              _mm512_set1_epi32(static_cast<int32_t>(q_rows[rb + r][j])));
          s[r] = _mm512_dpbf16_ps(s[r], qq, kv);
        }
      }
      for (int64_t r = 0; r < kRowStep; ++r) {
        const int64_t row = rb + r;
        __mmask16 valid = _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(pos[row]));
        if (lay.window > 0) {
          valid &= _mm512_cmpgt_epi32_mask(
              key_pos, _mm512_set1_epi32(pos[row] - static_cast<int32_t>(lay.window)));
        }
        active[r] = valid != 0;
        if (!active[r]) continue;
        const __m512 sv = _mm512_mask_mul_ps(neg_inf, valid, s[r], scale_v);
        const float m_new = std::max(m[row], _mm512_reduce_max_ps(sv));
        corr[r] = splitserve::exp_scalar(m[row] - m_new);
        const __m512 e = _mm512_maskz_mov_ps(
            valid, splitserve::exp512(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
        l[row] = l[row] * corr[r] + _mm512_reduce_add_ps(e);
        m[row] = m_new;
        const __m256bh packed = _mm512_cvtneps_pbh(e);
        std::memcpy(p_pairs[r], &packed, sizeof(packed));
      }
      for (int64_t r = 0; r < kRowStep; ++r) {
        if (!active[r]) continue;
        float* a_row = acc[rb + r];
        __m512 a[kVecs];
        const __m512 c = _mm512_set1_ps(corr[r]);
        for (int64_t u = 0; u < kVecs; ++u) a[u] = _mm512_mul_ps(_mm512_load_ps(a_row + 16 * u), c);
        for (int64_t tp = 0; tp < kBlock / 2; ++tp) {
          const __m512bh pp =
              reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int32_t>(p_pairs[r][tp])));
          for (int64_t u = 0; u < kVecs; ++u) {
            a[u] = _mm512_dpbf16_ps(a[u], pp,
                                    reinterpret_cast<__m512bh>(_mm512_load_si512(vp[tp] + 16 * u)));
          }
        }
        for (int64_t u = 0; u < kVecs; ++u) _mm512_store_ps(a_row + 16 * u, a[u]);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    uint16_t* dst = lay.out_row(task, chunk, r);
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t c = 0; c < dim / 32; ++c) {
      store_unpermuted(dst + 32 * c, _mm512_load_ps(acc[r] + 32 * c),
                       _mm512_load_ps(acc[r] + 32 * c + 16), inv);
    }
  }
}

void run_bf16(const std::vector<Task>& tasks, const std::vector<Chunk>& chunks, const Layout& lay,
              int64_t dim) {
  auto run = dim == 32 ? prefill_task<32> : dim == 64 ? prefill_task<64> : prefill_task<128>;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < num_tasks; ++i) run(tasks[i], chunks[tasks[i].seq], lay);
}

}  // namespace

#endif

namespace {

template <typename T>
PrefillLayout<T> layout(const at::Tensor& q, const at::Tensor& kv_cache, at::Tensor& out,
                        const T* qp, const T* cp, T* op, int64_t layer, double scale,
                        int64_t sliding_window) {
  const int64_t dim = q.size(2), layers = kv_cache.size(1), kv_heads = kv_cache.size(3);
  const int64_t bs = kv_cache.size(4);
  return {qp,
          q.stride(0),
          q.stride(1),
          op,
          out.stride(0),
          out.stride(1),
          cp,
          layers * 2 * kv_heads * bs * dim,
          layer * 2 * kv_heads * bs * dim,
          kv_heads,
          q.size(1) / kv_heads,
          static_cast<float>(scale),
          sliding_window};
}

}  // namespace

bool paged_prefill_supported(const std::string& dtype, int64_t head_dim, int64_t block_size,
                             int64_t group) {
  if (!(head_dim == 32 || head_dim == 64 || head_dim == 128) ||
      block_size != splitserve::kPrefillBlock || group > splitserve::kPrefillMaxRows) {
    return false;
  }
#if SPLITSERVE_AVX512_BF16
  if (dtype == "bfloat16") return true;
#endif
#if SPLITSERVE_AVX2
  if (dtype == "float32") return true;
#endif
  return false;
}

// q, out: [T, H, D] (bfloat16 or float32, see paged_prefill_supported) with unit stride on D;
// kv_cache: [NB, L, 2, KVH, 16, D] contiguous in q's dtype; block_tables: [S, max_blocks]
// int64; q_starts, q_lens, context_lens: [S] int64, chunk s being rows
// [q_starts[s], q_starts[s] + q_lens[s]) of q, the last q_lens[s] of its context_lens[s]
// tokens. Writes those rows of out.
void paged_prefill(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables, at::Tensor q_starts,
                   at::Tensor q_lens, at::Tensor context_lens, int64_t layer, double scale,
                   int64_t sliding_window, at::Tensor out) {
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  TORCH_CHECK(kv_cache.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
              "paged_prefill: q, cache and out dtypes differ");
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "paged_prefill: head_dim must be dense");
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(heads == group * kv_heads, "paged_prefill: heads not a multiple of KV heads");
  TORCH_CHECK(paged_prefill_supported(is_bf16 ? "bfloat16" : "float32", dim, bs, group) &&
                  (is_bf16 || q.scalar_type() == at::kFloat),
              "paged_prefill: dtype or shape not built at this CPU level");
  std::vector<PrefillChunk> chunks;
  std::vector<PrefillTask> tasks;
  splitserve::build_prefill_tasks(block_tables.data_ptr<int64_t>(), q_starts.data_ptr<int64_t>(),
                                  q_lens.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                                  q_starts.size(0), block_tables.size(1), kv_heads, group,
                                  sliding_window, chunks, tasks);
#if SPLITSERVE_AVX512_BF16
  if (is_bf16) {
    const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
    const auto* cp = reinterpret_cast<const uint16_t*>(kv_cache.data_ptr<at::BFloat16>());
    auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    return run_bf16(tasks, chunks,
                    layout(q, kv_cache, out, qp, cp, op, layer, scale, sliding_window), dim);
  }
#endif
#if SPLITSERVE_AVX2
  if (!is_bf16) {
    return splitserve::run_prefill_f32_avx2(
        tasks, chunks,
        layout(q, kv_cache, out, q.data_ptr<float>(), kv_cache.data_ptr<float>(),
               out.data_ptr<float>(), layer, scale, sliding_window),
        dim);
  }
#endif
  TORCH_CHECK(false, "paged_prefill: unreachable");
}
