// Paged-attention decode over an 8-bit KV cache (int8 or fp8 e4m3), read in place.
// Cache: uint8 [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim + 4]; each row is
// one token's K (or V) of one KV head: head_dim codes, then the row's float32 scale
// (engine/model/kv_quant.py). value = code * scale.
//
// One task per (sequence, KV head). Per block, the K and V tiles' codes are widened to float
// once and shared by the query heads of that KV head (GQA); a row's scale is applied to its
// score (K) and to its softmax weight (V), never per element. The loops are written for the
// compiler's vectorizer at the build's level (AVX2 / AVX-512): codes to float is a byte widen
// and a convert (int8), or integer shifts, a select and a multiply (fp8).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx512_bf16.h"
#include "decode_runs.h"
#include "decode_softmax.h"
#include "kv_rows.h"
#include "paged_decode_amx.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxGroup = splitserve::kMaxDecodeGroup;
constexpr int64_t kScaleBytes = splitserve::kKvScaleBytes;

enum class Codes : int64_t { kInt8 = 0, kFp8E4M3 = 1 };

#if defined(__F16C__)
// 8 fp8 e4m3 codes as float16 bits worth 2^-8 of their value (sign to bit 15, exponent and
// mantissa moved up 7 bits; float16's bias is 8 more than e4m3's), which F16C widens exactly,
// subnormals included. Callers fold the 2^8 into the row's scale.
inline __m128i fp8_e4m3_as_half(__m128i codes16) {
  const __m128i sign = _mm_slli_epi16(_mm_and_si128(codes16, _mm_set1_epi16(0x80)), 8);
  const __m128i mag = _mm_slli_epi16(_mm_and_si128(codes16, _mm_set1_epi16(0x7F)), 7);
  return _mm_or_si128(sign, mag);
}
#endif

// One tile's [bs, dim] codes widened to float, and its bs row scales (value = float * scale).
template <Codes kind, int64_t dim, int64_t bs>
inline void widen_tile(const uint8_t* tile, float* values, float* scales) {
  constexpr int64_t row = dim + kScaleBytes;
  for (int64_t t = 0; t < bs; ++t) {
    const uint8_t* r = tile + t * row;
    float* out = values + t * dim;
    std::memcpy(scales + t, r + dim, sizeof(float));
#if defined(__AVX2__) && defined(__F16C__)
    for (int64_t d = 0; d < dim; d += 8) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + d));
      if constexpr (kind == Codes::kInt8) {
        _mm256_store_ps(out + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
      } else {
        _mm256_store_ps(out + d, _mm256_cvtph_ps(fp8_e4m3_as_half(_mm_cvtepu8_epi16(raw))));
      }
    }
    if constexpr (kind == Codes::kFp8E4M3) scales[t] *= 256.f;
#else
    if constexpr (kind == Codes::kInt8) {
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(static_cast<int8_t>(r[d]));
    } else {
      for (int64_t d = 0; d < dim; ++d) out[d] = splitserve::e4m3_to_float(r[d]);
    }
#endif
  }
}

template <typename T>
inline float load_float(T v) {
  return static_cast<float>(v);
}
template <>
inline float load_float<at::BFloat16>(at::BFloat16 v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return splitserve::bf16_to_float(bits);
}

template <typename T, Codes kind, int64_t dim, int64_t bs>
void decode_one(const T* q, const uint8_t* cache, const int64_t* table, int64_t ctx, int64_t start,
                int64_t head_offset, int64_t block_stride, int64_t kv_stride, int64_t group,
                float scale, T* out) {
  splitserve::GroupSoftmax<dim, bs> softmax;
  alignas(64) float kf[bs * dim];
  alignas(64) float vf[bs * dim];
  float k_scale[bs];
  float v_scale[bs];
  constexpr int64_t tile_bytes = bs * (dim + kScaleBytes);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < dim; ++d) softmax.qf[g][d] = load_float(q[g * dim + d]) * scale;
  }
  softmax.reset(group);
  for (int64_t blk = start / bs; blk * bs < ctx; ++blk) {
    const uint8_t* k = cache + table[blk] * block_stride + head_offset;
    if ((blk + 1) * bs < ctx) {
      // Blocks are scattered: fetch the next K/V tiles while this one is computed.
      const uint8_t* next_k = cache + table[blk + 1] * block_stride + head_offset;
      for (int64_t off = 0; off < tile_bytes; off += 64) {
        __builtin_prefetch(next_k + off);
        __builtin_prefetch(next_k + kv_stride + off);
      }
    }
    widen_tile<kind, dim, bs>(k, kf, k_scale);
    widen_tile<kind, dim, bs>(k + kv_stride, vf, v_scale);
    softmax.template block<true>(kf, vf, k_scale, v_scale, std::max<int64_t>(start - blk * bs, 0),
                                 std::min(bs, ctx - blk * bs));
  }
  softmax.finish(out);
}

#if SPLITSERVE_AVX512_BF16
constexpr int64_t kMaxHeads = 64;  // query vectors (rows x heads) of one task, AVX-512 path
constexpr int64_t kPrefetchBlocks = 2;

// 16 codes of a row as 16 floats (fp8: 2^-8 of their value, see fp8_e4m3_as_half).
template <Codes kind>
inline __m512 widen16(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kind == Codes::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
  } else {
    const __m256i w = _mm256_cvtepu8_epi16(raw);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8);
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
  }
}

#if defined(__AVX512VNNI__)
// int8 keys are scored by integer dot products (vpdpwssd): key codes widened to int16 once per
// tile, the query heads quantized to int16 (scale absmax / 32767: a relative error near 2^-16,
// below the bfloat16 the query was computed in), int32 sums exact (64 x 127 x 32767 < 2^31).
// Half the widening stores of float keys and half the multiplies.
constexpr bool kIntegerKeyScores = true;
#else
constexpr bool kIntegerKeyScores = false;
#endif

// Lane i of the result is the sum of the 16 int32 lanes of v[i] (hsum16's tree, in integers).
inline __m512i hsum16_epi32(const __m512i* v) {
  __m512i x[8];
  for (int i = 0; i < 8; ++i) {
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  }
  __m512i y[4];
  for (int i = 0; i < 4; ++i) {
    y[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]),
                            _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  }
  const __m512i z01 = _mm512_add_epi32(_mm512_shuffle_i32x4(y[0], y[1], 0x88),
                                       _mm512_shuffle_i32x4(y[0], y[1], 0xDD));
  const __m512i z23 = _mm512_add_epi32(_mm512_shuffle_i32x4(y[2], y[3], 0x88),
                                       _mm512_shuffle_i32x4(y[2], y[3], 0xDD));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(z01, z23, 0x88),
                          _mm512_shuffle_i32x4(z01, z23, 0xDD));
}

// The query heads as int16 codes, and each head's value per code times the softmax scale.
template <int64_t dim>
struct QueryCodes {
  static constexpr int64_t kChunks = dim / 32;  // 32 int16 codes per vector
  alignas(64) int16_t codes[kMaxHeads][dim];
  float unit[kMaxHeads];

  void fill(const float* q, int64_t heads, float scale) {
    for (int64_t h = 0; h < heads; ++h) {
      const float* qh = q + h * dim;
      float absmax = 0.f;
      for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(qh[d]));
      const float step = absmax > 0.f ? absmax / 32767.f : 1.f;
      for (int64_t d = 0; d < dim; ++d) {
        const float code = std::clamp(std::nearbyint(qh[d] / step), -32767.f, 32767.f);
        codes[h][d] = static_cast<int16_t>(code);
      }
      unit[h] = step * scale;
    }
  }
};

// One task per sequence, as the bfloat16 path of paged_decode.cpp: per block, the layer's K and
// V tiles of every KV head are one contiguous run, prefetched kPrefetchBlocks ahead. Per KV
// head the K and V tiles are widened once (to float; int8 keys with VNNI to int16) and shared by
// its query heads; a block's 16 scores come from 16 dot products summed by one transpose tree
// (hsum16, or hsum16_epi32 for integer scores), then the row scales and the online softmax are
// applied in one vector; in p.V each V row's scale is folded into its weight, and the query
// vectors of a KV head go kTile at a time, so that each V row is loaded once per tile.
//
// ``rows`` consecutive query positions of one sequence (a decode with draft tokens) share the
// task: row r sees the first ctx + r tokens, and each block is widened once for all of them.
template <Codes kind, int64_t dim>
void decode_seq(const float* q, const uint8_t* cache, const int64_t* table, int64_t ctx,
                int64_t rows, int64_t sliding_window, int64_t layer_offset, int64_t block_stride,
                int64_t kv_heads, int64_t group, float scale, float* out) {
  constexpr int64_t bs = 16;
  constexpr int64_t row = dim + kScaleBytes;
  constexpr int64_t kVecs = dim / 16;
  constexpr float code_unit = kind == Codes::kInt8 ? 1.f : 256.f;
  const int64_t seq_heads = kv_heads * group;
  const int64_t heads = rows * seq_heads;  // query vectors: row r's head h is r * seq_heads + h
  const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
  const int64_t last_ctx = ctx + rows - 1;
  const int64_t tile = bs * row;
  const int64_t layer_bytes = 2 * kv_heads * tile;
  alignas(64) float acc[kMaxHeads][dim];
  alignas(64) float kf[bs][dim];
  alignas(64) float vf[bs][dim];
  alignas(64) float k_scale[bs];
  alignas(64) float v_scale[bs];
  float m[kMaxHeads];
  float l[kMaxHeads];
  constexpr bool kIntegerScores = kind == Codes::kInt8 && kIntegerKeyScores;
  constexpr int64_t kChunks = QueryCodes<dim>::kChunks;
  // Query vectors whose p.V shares each V row load: kTile x kVecs accumulators in registers.
  constexpr int64_t kTile = kVecs >= 8 ? 2 : 4;
  QueryCodes<dim> qc;
  if constexpr (kIntegerScores) qc.fill(q, heads, scale);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t d = 0; d < dim; ++d) acc[h][d] = 0.f;
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t end_blk = (last_ctx + bs - 1) / bs;
  for (int64_t blk = start / bs; blk < end_blk; ++blk) {
    if (blk + kPrefetchBlocks < end_blk) {
      const uint8_t* ahead = cache + table[blk + kPrefetchBlocks] * block_stride + layer_offset;
      for (int64_t off = 0; off < layer_bytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
      }
    }
    const uint8_t* block = cache + table[blk] * block_stride + layer_offset;
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      const uint8_t* k = block + kvh * tile;
      const uint8_t* v = block + (kv_heads + kvh) * tile;
      alignas(64) int16_t kw[kIntegerScores ? bs : 1][dim];
      for (int64_t t = 0; t < bs; ++t) {
        for (int64_t c = 0; c < kVecs; ++c) {
          if constexpr (!kIntegerScores) {
            _mm512_store_ps(kf[t] + 16 * c, widen16<kind>(k + t * row + 16 * c));
          }
          _mm512_store_ps(vf[t] + 16 * c, widen16<kind>(v + t * row + 16 * c));
        }
        if constexpr (kIntegerScores) {
          for (int64_t c = 0; c < kChunks; ++c) {
            const __m256i codes =
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + t * row + 32 * c));
            _mm512_store_si512(kw[t] + 32 * c, _mm512_cvtepi8_epi16(codes));
          }
        }
        std::memcpy(k_scale + t, k + t * row + dim, sizeof(float));
        std::memcpy(v_scale + t, v + t * row + dim, sizeof(float));
      }
      const __m512 ks = _mm512_mul_ps(_mm512_load_ps(k_scale), _mm512_set1_ps(code_unit));
      const __m512 vs = _mm512_mul_ps(_mm512_load_ps(v_scale), _mm512_set1_ps(code_unit));
      // Query vectors of this KV head (rows x group) in tiles of kTile: scores and softmax per
      // vector, then p.V for the whole tile, each V row loaded once into registers.
      for (int64_t q0 = 0; q0 < rows * group; q0 += kTile) {
        const int64_t nt = std::min(kTile, rows * group - q0);
        int64_t hs[kTile];
        float correction[kTile];
        alignas(64) float pw[kTile][bs];
        int64_t lo = bs, hi = 0;  // the tokens some vector of the tile sees
        for (int64_t n = 0; n < nt; ++n) {
          const int64_t qi = q0 + n;
          const int64_t r = qi / group;
          const int64_t h = r * seq_heads + kvh * group + qi % group;
          hs[n] = h;
          const auto [t0, t1] =
              splitserve::row_tokens_in_block(ctx + r, sliding_window, blk * bs, bs);
          if (t1 <= t0) {  // this row sees none of the block
            correction[n] = 1.f;
            _mm512_store_ps(pw[n], _mm512_setzero_ps());
            continue;
          }
          lo = std::min(lo, t0);
          hi = std::max(hi, t1);
          const __mmask16 valid = static_cast<__mmask16>(((1u << t1) - 1) & ~((1u << t0) - 1));
          __m512 raw;
          if constexpr (kIntegerScores) {
            __m512i qv[kChunks];
            for (int64_t c = 0; c < kChunks; ++c) qv[c] = _mm512_load_si512(qc.codes[h] + 32 * c);
            __m512i dots[bs];
            for (int64_t t = 0; t < bs; ++t) {
              __m512i dot = _mm512_madd_epi16(qv[0], _mm512_load_si512(kw[t]));
              for (int64_t c = 1; c < kChunks; ++c) {
                dot = _mm512_dpwssd_epi32(dot, qv[c], _mm512_load_si512(kw[t] + 32 * c));
              }
              dots[t] = dot;
            }
            raw = _mm512_mul_ps(_mm512_cvtepi32_ps(hsum16_epi32(dots)), _mm512_set1_ps(qc.unit[h]));
          } else {
            __m512 qv[kVecs];
            for (int64_t c = 0; c < kVecs; ++c) {
              qv[c] = _mm512_mul_ps(_mm512_loadu_ps(q + h * dim + 16 * c), _mm512_set1_ps(scale));
            }
            __m512 dots[bs];
            for (int64_t t = 0; t < bs; ++t) {
              __m512 dot = _mm512_mul_ps(qv[0], _mm512_load_ps(kf[t]));
              for (int64_t c = 1; c < kVecs; ++c) {
                dot = _mm512_fmadd_ps(qv[c], _mm512_load_ps(kf[t] + 16 * c), dot);
              }
              dots[t] = dot;
            }
            raw = splitserve::hsum16(dots);
          }
          const __m512 s = _mm512_mask_mul_ps(neg_inf, valid, raw, ks);
          const __m512 e = splitserve::online_softmax16(s, valid, m[h], l[h], correction[n]);
          // Dead lanes stay exactly 0 whatever their scale bytes hold.
          _mm512_store_ps(pw[n], _mm512_maskz_mul_ps(valid, e, vs));
        }
        if (hi <= lo) continue;
        __m512 a[kTile][kVecs];
        for (int64_t n = 0; n < kTile; ++n) {
          if (n >= nt) break;
          const __m512 corr_v = _mm512_set1_ps(correction[n]);
          for (int64_t c = 0; c < kVecs; ++c) {
            a[n][c] = _mm512_mul_ps(_mm512_load_ps(acc[hs[n]] + 16 * c), corr_v);
          }
        }
        for (int64_t t = lo; t < hi; ++t) {
          __m512 v[kVecs];
          for (int64_t c = 0; c < kVecs; ++c) v[c] = _mm512_load_ps(vf[t] + 16 * c);
          for (int64_t n = 0; n < kTile; ++n) {
            if (n >= nt) break;
            const __m512 pt = _mm512_set1_ps(pw[n][t]);
            for (int64_t c = 0; c < kVecs; ++c) a[n][c] = _mm512_fmadd_ps(pt, v[c], a[n][c]);
          }
        }
        for (int64_t n = 0; n < kTile; ++n) {
          if (n >= nt) break;
          for (int64_t c = 0; c < kVecs; ++c) _mm512_store_ps(acc[hs[n]] + 16 * c, a[n][c]);
        }
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / l[h]);
    for (int64_t c = 0; c < kVecs; ++c) {
      _mm512_storeu_ps(out + h * dim + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[h] + 16 * c), inv));
    }
  }
}

// True (and done) when the AVX-512 path covers this call: float32 queries (bfloat16 ones are
// widened first, a few KB), head_dim 32, 64 or 128. bf16_model: the model computes in
// bfloat16, so over int8 codes at head_dim 64 an AMX build runs the tiles instead
// (paged_decode_amx.h); float32 models keep these float32 products.
bool decode_avx512(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables,
                   const int64_t* lens, int64_t max_blocks, int64_t layer, float scale,
                   int64_t sliding_window, Codes kind, bool bf16_model, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t layers = kv_cache.size(1), kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  if (bs != 16 || (dim != 32 && dim != 64 && dim != 128) || heads > kMaxHeads) return false;
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  at::Tensor of = out.scalar_type() == at::kFloat ? out : at::empty_like(qf);
  const int64_t row = dim + kScaleBytes;
  const int64_t block_stride = layers * 2 * kv_heads * bs * row;
  const int64_t layer_offset = layer * 2 * kv_heads * bs * row;
  const int64_t group = heads / kv_heads;
  using Fn = void (*)(const float*, const uint8_t*, const int64_t*, int64_t, int64_t, int64_t,
                      int64_t, int64_t, int64_t, int64_t, float, float*);
  Fn run;
  if (kind == Codes::kInt8) {
    run = dim == 32 ? decode_seq<Codes::kInt8, 32>
          : dim == 64 ? decode_seq<Codes::kInt8, 64> : decode_seq<Codes::kInt8, 128>;
  } else {
    run = dim == 32 ? decode_seq<Codes::kFp8E4M3, 32>
          : dim == 64 ? decode_seq<Codes::kFp8E4M3, 64> : decode_seq<Codes::kFp8E4M3, 128>;
  }
  const float* qp = qf.data_ptr<float>();
  const uint8_t* cp = kv_cache.data_ptr<uint8_t>();
  float* op = of.data_ptr<float>();
#if defined(SPLITSERVE_AMX_DECODE)
  static_assert(kMaxHeads <= splitserve::kAmxMaxQueryHeads, "decode_seq_amx's tiles are sized");
  const bool amx = bf16_model && kind == Codes::kInt8 && dim == splitserve::kAmxDim &&
                   kv_heads <= splitserve::kAmxMaxKvHeads && sliding_window <= 0 &&
                   splitserve::amx_tiles_enabled();
#else
  (void)bf16_model;
#endif
  const std::vector<int64_t> firsts =
      splitserve::shared_table_runs(tables, lens, batch, max_blocks, bs, kMaxHeads / heads);
  const int64_t num_tasks = static_cast<int64_t>(firsts.size()) - 1;
  at::parallel_for(0, num_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = firsts[i];
#if defined(SPLITSERVE_AMX_DECODE)
      if (amx) {
        splitserve::decode_seq_amx(qp + b * heads * dim, cp, tables + b * max_blocks, lens[b],
                                   firsts[i + 1] - b, layer_offset, block_stride, kv_heads,
                                   group, scale, op + b * heads * dim);
        continue;
      }
#endif
      run(qp + b * heads * dim, cp, tables + b * max_blocks, lens[b], firsts[i + 1] - b,
          sliding_window, layer_offset, block_stride, kv_heads, group, scale,
          op + b * heads * dim);
    }
  });
  if (!of.is_same(out)) out.copy_(of);
  return true;
}
#endif

template <typename T, Codes kind>
void decode_task(const T* q, const uint8_t* cache, const int64_t* table, int64_t ctx,
                 int64_t start, int64_t head_offset, int64_t block_stride, int64_t kv_stride,
                 int64_t group, int64_t dim, float scale, T* out) {
  switch (dim) {
    case 16:
      return decode_one<T, kind, 16, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                         kv_stride, group, scale, out);
    case 32:
      return decode_one<T, kind, 32, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                         kv_stride, group, scale, out);
    case 64:
      return decode_one<T, kind, 64, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                         kv_stride, group, scale, out);
    case 128:
      return decode_one<T, kind, 128, 16>(q, cache, table, ctx, start, head_offset, block_stride,
                                          kv_stride, group, scale, out);
  }
  TORCH_CHECK(false, "paged_decode_quantized: head_dim ", dim, " not built");
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables,
         const int64_t* lens, int64_t max_blocks, int64_t layer, float scale,
         int64_t sliding_window, Codes kind, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t layers = kv_cache.size(1), kv_heads = kv_cache.size(3), bs = kv_cache.size(4);
  const int64_t row = kv_cache.size(5);
  const int64_t group = heads / kv_heads;
  const int64_t block_stride = layers * 2 * kv_heads * bs * row;
  const int64_t kv_stride = kv_heads * bs * row;
  const T* qp = q.data_ptr<T>();
  const uint8_t* cp = kv_cache.data_ptr<uint8_t>();
  T* op = out.data_ptr<T>();
  auto task = kind == Codes::kInt8 ? decode_task<T, Codes::kInt8> : decode_task<T, Codes::kFp8E4M3>;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      const int64_t ctx = lens[b];
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, ctx - sliding_window) : 0;
      const int64_t q_offset = (b * heads + h * group) * dim;
      task(qp + q_offset, cp, tables + b * max_blocks, ctx, start,
           (layer * 2 * kv_heads + h) * bs * row, block_stride, kv_stride, group, dim, scale,
           op + q_offset);
    }
  });
}

}  // namespace

// q: [B, H, D] float32 or bfloat16, contiguous; kv_cache: uint8 [NB, L, 2, KVH, 16, D + 4]
// contiguous; block_tables: [B, max_blocks] int64; context_lens: [B] int64 (>= 1);
// kind: 0 int8, 1 fp8 e4m3; rotate_query: the keys are stored Hadamard-rotated (int8), so the
// query is rotated too (in float32, on a copy). Returns [B, H, D] in q's dtype.
at::Tensor paged_decode_quantized(at::Tensor q, at::Tensor kv_cache, at::Tensor block_tables,
                                  at::Tensor context_lens, int64_t layer, double scale,
                                  int64_t sliding_window, int64_t kind, bool rotate_query) {
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  TORCH_CHECK(kv_cache.scalar_type() == at::kByte, "paged_decode_quantized: cache must be uint8");
  TORCH_CHECK(kind == 0 || kind == 1, "paged_decode_quantized: kind is 0 (int8) or 1 (fp8)");
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == 16, "paged_decode_quantized: block_size 16 only");
  TORCH_CHECK(kv_cache.size(5) == dim + kScaleBytes, "paged_decode_quantized: row is not D + 4");
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "paged_decode_quantized: unsupported query heads per KV head");
  const at::ScalarType out_dtype = q.scalar_type();
  if (rotate_query) {
    TORCH_CHECK((dim & (dim - 1)) == 0, "paged_decode_quantized: rotation needs a power-of-two D");
    q = q.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    float* rows = q.data_ptr<float>();
    at::parallel_for(0, q.numel() / dim, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) splitserve::hadamard(rows + r * dim, dim);
    });
  }
  auto out = at::empty_like(q);
  const Codes codes = static_cast<Codes>(kind);
  const float s = static_cast<float>(scale);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  bool done = false;
#if SPLITSERVE_AVX512_BF16
  done = decode_avx512(q, kv_cache, tables, lens, max_blocks, layer, s, sliding_window, codes,
                       out_dtype == at::kBFloat16, out);
#endif
  if (!done && q.scalar_type() == at::kFloat) {
    run<float>(q, kv_cache, tables, lens, max_blocks, layer, s, sliding_window, codes, out);
  } else if (!done) {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "paged_decode_quantized: q float32 or bf16");
    run<at::BFloat16>(q, kv_cache, tables, lens, max_blocks, layer, s, sliding_window, codes, out);
  }
  return out.scalar_type() == out_dtype ? out : out.to(out_dtype);
}

// The bits of the query codes int8 keys are scored against at this head_dim (16: int16 codes,
// kIntegerKeyScores), or 0 where scores are float products; a reference quantizes its query
// the same way to match this build bit for bit.
int64_t int8_decode_query_bits(int64_t head_dim) {
#if SPLITSERVE_AVX512_BF16
  if (kIntegerKeyScores && (head_dim == 32 || head_dim == 64 || head_dim == 128)) return 16;
#endif
  return 0;
}
