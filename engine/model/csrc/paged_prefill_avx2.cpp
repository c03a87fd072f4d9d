// Paged prefill in float32 with AVX2 + FMA (the work split and entry point are in
// prefill_tasks.h and paged_prefill.cpp).
//
// Per 16-key block the K tile is transposed once (kt[d][t]), so kRowStep rows share each load
// of a head dim's 16 keys: 2 vectors of scores per row, one FMA per row, key vector and dim.
// Softmax is online, in float32, masked causally (and by the sliding window) per row; p.V
// accumulates each row's output in registers from the V tile read in place.
#include "paged_prefill_avx2.h"

#if SPLITSERVE_AVX2

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "avx512_bf16.h"

namespace splitserve {
namespace {

constexpr int64_t kBlock = kPrefillBlock;
constexpr int64_t kMaxRows = kPrefillMaxRows;
constexpr int64_t kRowStep = 4;  // rows sharing one pass over the transposed K tile

template <int64_t dim>
void prefill_task(const PrefillTask& task, const PrefillChunk& chunk,
                  const PrefillLayout<float>& lay) {
  constexpr int64_t kVecs = dim / 8;
  const int64_t tile = kBlock * dim;
  const int64_t group = lay.group;
  const int64_t rows = (task.q_end - task.q_begin) * group;
  const int64_t padded_rows = (rows + kRowStep - 1) / kRowStep * kRowStep;

  alignas(32) float q_rows[kMaxRows][dim];  // scaled
  alignas(32) float acc[kMaxRows][dim];
  alignas(32) float kt[dim][kBlock];  // kt[d][t]: dim d of key t
  alignas(32) float p[kRowStep][kBlock];
  int32_t pos[kMaxRows];
  float m[kMaxRows];
  float l[kMaxRows];
  float corr[kRowStep];
  bool active[kRowStep];

  // Row r = i * group + g: query position i of the tile, query head g of the KV head. Padding
  // rows repeat the last row; their results are dropped.
  for (int64_t r = 0; r < padded_rows; ++r) {
    const int64_t src_row = std::min(r, rows - 1);
    const float* src = lay.q_row(task, chunk, src_row);
    for (int64_t d = 0; d < dim; ++d) q_rows[r][d] = src[d] * lay.scale;
    pos[r] = lay.position(task, chunk, src_row);
    std::fill(acc[r], acc[r] + dim, 0.f);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }

  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t blk = task.key_begin / kBlock; blk * kBlock < task.key_end; ++blk) {
    const float* base = lay.cache + chunk.table[blk] * lay.block_stride + lay.layer_offset;
    const float* k = base + task.kv_head * tile;
    const float* v = base + (lay.kv_heads + task.kv_head) * tile;
    for (int64_t t = 0; t < kBlock; ++t) {
      for (int64_t d = 0; d < dim; ++d) kt[d][t] = k[t * dim + d];
    }
    const __m256i key_lo =
        _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(blk * kBlock)), lane);
    const __m256i key_hi = _mm256_add_epi32(key_lo, _mm256_set1_epi32(8));

    for (int64_t rb = 0; rb < padded_rows; rb += kRowStep) {
      __m256 s[kRowStep][2];
      for (int64_t r = 0; r < kRowStep; ++r) s[r][0] = s[r][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; ++d) {
        const __m256 k0 = _mm256_load_ps(kt[d]);
        const __m256 k1 = _mm256_load_ps(kt[d] + 8);
        for (int64_t r = 0; r < kRowStep; ++r) {
          const __m256 qq = _mm256_broadcast_ss(&q_rows[rb + r][d]);
          s[r][0] = _mm256_fmadd_ps(qq, k0, s[r][0]);
          s[r][1] = _mm256_fmadd_ps(qq, k1, s[r][1]);
        }
      }
      for (int64_t r = 0; r < kRowStep; ++r) {
        const int64_t row = rb + r;
        // Key j is visible to the row at position pos when j <= pos (and pos - j < window).
        const __m256i limit = _mm256_set1_epi32(pos[row] + 1);
        __m256i lo = _mm256_cmpgt_epi32(limit, key_lo);
        __m256i hi = _mm256_cmpgt_epi32(limit, key_hi);
        if (lay.window > 0) {
          const __m256i first = _mm256_set1_epi32(pos[row] - static_cast<int32_t>(lay.window));
          lo = _mm256_and_si256(lo, _mm256_cmpgt_epi32(key_lo, first));
          hi = _mm256_and_si256(hi, _mm256_cmpgt_epi32(key_hi, first));
        }
        const __m256 valid_lo = _mm256_castsi256_ps(lo);
        const __m256 valid_hi = _mm256_castsi256_ps(hi);
        active[r] = _mm256_movemask_ps(_mm256_or_ps(valid_lo, valid_hi)) != 0;
        if (!active[r]) continue;
        const __m256 s_lo = _mm256_blendv_ps(neg_inf, s[r][0], valid_lo);
        const __m256 s_hi = _mm256_blendv_ps(neg_inf, s[r][1], valid_hi);
        const float m_new = std::max(m[row], splitserve::hmax8(_mm256_max_ps(s_lo, s_hi)));
        corr[r] = exp_scalar(m[row] - m_new);
        const __m256 m_v = _mm256_set1_ps(m_new);
        const __m256 e_lo = _mm256_and_ps(exp256(_mm256_sub_ps(s_lo, m_v)), valid_lo);
        const __m256 e_hi = _mm256_and_ps(exp256(_mm256_sub_ps(s_hi, m_v)), valid_hi);
        l[row] = l[row] * corr[r] + splitserve::hadd8(_mm256_add_ps(e_lo, e_hi));
        m[row] = m_new;
        _mm256_store_ps(p[r], e_lo);
        _mm256_store_ps(p[r] + 8, e_hi);
      }
      for (int64_t r = 0; r < kRowStep; ++r) {
        if (!active[r]) continue;
        float* a_row = acc[rb + r];
        __m256 a[kVecs];
        const __m256 c = _mm256_set1_ps(corr[r]);
        for (int64_t u = 0; u < kVecs; ++u) a[u] = _mm256_mul_ps(_mm256_load_ps(a_row + 8 * u), c);
        for (int64_t t = 0; t < kBlock; ++t) {
          const __m256 pt = _mm256_set1_ps(p[r][t]);
          for (int64_t u = 0; u < kVecs; ++u) {
            a[u] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + t * dim + 8 * u), a[u]);
          }
        }
        for (int64_t u = 0; u < kVecs; ++u) _mm256_store_ps(a_row + 8 * u, a[u]);
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    float* dst = lay.out_row(task, chunk, r);
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = acc[r][d] * inv;
  }
}

}  // namespace

void run_prefill_f32_avx2(const std::vector<PrefillTask>& tasks,
                          const std::vector<PrefillChunk>& chunks, const PrefillLayout<float>& lay,
                          int64_t dim) {
  auto run = dim == 32 ? prefill_task<32> : dim == 64 ? prefill_task<64> : prefill_task<128>;
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < num_tasks; ++i) run(tasks[i], chunks[tasks[i].seq], lay);
}

}  // namespace splitserve

#endif
