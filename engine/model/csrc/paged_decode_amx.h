// Paged decode over an int8 KV cache on AMX tiles, in integers (bfloat16 models, head_dim 64):
// the task of paged_decode_quantized.cpp's AVX-512 path (one sequence's run of query rows,
// every KV head) with both matrix products on the tiles and no code widened.
//
// Up to 16 query vectors of one KV head (the rows x the group) form a tile, and 4 blocks (64
// tokens) a step, so that each tile product is a full 16 x 16 x 64 one:
// - S = Q K^T (TDPBSSD), per block: each query's int16 codes (one scale a query, as the VNNI
//   path scores int8 keys) split into a high and a low int8 part are two A tiles, the block's
//   key codes transposed by 4-byte groups the B tile; the int32 sums are exact (256 high + low).
// - The online softmax runs per query over the step's tokens (K row scales applied as vectors);
//   the weights, V's row scales folded in, are quantized per query and step to 16 bits, split
//   into a high and a low uint8 part.
// - O += P V (TDPBUSD): the weights are two A tiles over the 64 tokens, V's codes interleaved by
//   4 tokens the B tile, one 16-dim chunk of the output at a time (two chunks in flight).
// A query's result depends only on its own row of every tile, so a row computes the same alone
// as in a run (decode_runs.h).
#pragma once

#include "avx512_bf16.h"
#include "decode_runs.h"

#if SPLITSERVE_AVX512_BF16 && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define SPLITSERVE_AMX_DECODE 1

#include <c10/util/Exception.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace splitserve {

// Linux hands out the tile state on request, once per process (oneDNN asks too).
inline bool amx_tiles_enabled() {
  static const bool enabled = [] {
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return enabled;
}

constexpr int64_t kAmxDim = 64;
constexpr int64_t kAmxQueries = 16;  // query vectors per tile
constexpr int64_t kAmxMaxTiles = 8;  // query tiles per task (KV heads x tiles per head)
// Tasks of at most 64 query vectors from at most 4 KV heads need at most 4 + 4 tiles.
constexpr int64_t kAmxMaxQueryHeads = 64;
constexpr int64_t kAmxMaxKvHeads = 4;
// Largest query code: 256 high + low with both in int8 (127 * 256 + 127).
constexpr float kAmxMaxQueryCode = 32639.f;
constexpr float kAmxMaxWeightCode = 65535.f;

constexpr int64_t kAmxStepBlocks = 4;  // blocks of 16 tokens a step

// Every tile is 16 rows of 64 bytes. Scores: 0 / 1 query codes high / low (A), 2 keys (B), 3 / 4
// sums high / low (C). Values: 5 / 6 weights high / low (A), 2 and 7 value chunks (B), 3 / 4
// and 0 / 1 sums high / low (C).
struct alignas(64) AmxDecodeConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// One tile of query vectors of one KV head and its running softmax state.
struct AmxQueryTile {
  alignas(64) int8_t high[kAmxQueries][kAmxDim];  // codes = 256 high + low
  alignas(64) int8_t low[kAmxQueries][kAmxDim];
  alignas(64) float acc[kAmxQueries][kAmxDim];
  float unit[kAmxQueries];  // score per unit of the integer sum (softmax scale included)
  float m[kAmxQueries];
  float l[kAmxQueries];
  int64_t row_ctx[kAmxQueries];  // tokens the query sees
  int64_t heads[kAmxQueries];    // the query's head in q / out
  int64_t count = 0;
};

// Fills a tile with queries ``heads`` of ``q`` (rows of 64 floats); row r sees ctx + r tokens.
inline void fill_query_tile(AmxQueryTile& tile, const float* q, const int64_t* heads,
                            const int64_t* query_rows, int64_t count, int64_t ctx, float scale) {
  std::memset(tile.high, 0, sizeof(tile.high));
  std::memset(tile.low, 0, sizeof(tile.low));
  tile.count = count;
  for (int64_t n = 0; n < count; ++n) {
    const float* qh = q + heads[n] * kAmxDim;
    tile.heads[n] = heads[n];
    tile.row_ctx[n] = ctx + query_rows[n];
    tile.m[n] = -std::numeric_limits<float>::infinity();
    tile.l[n] = 0.f;
    float absmax = 0.f;
    for (int64_t d = 0; d < kAmxDim; ++d) absmax = std::max(absmax, std::fabs(qh[d]));
    const float step = absmax > 0.f ? absmax / kAmxMaxQueryCode : 1.f;
    tile.unit[n] = step * scale;
    for (int64_t d = 0; d < kAmxDim; ++d) {
      const int32_t code = static_cast<int32_t>(
          std::clamp(std::nearbyint(qh[d] / step), -kAmxMaxQueryCode, kAmxMaxQueryCode));
      const int32_t high = (code + 128) >> 8;  // arithmetic shift: to the nearest
      tile.high[n][d] = static_cast<int8_t>(high);
      tile.low[n][d] = static_cast<int8_t>(code - 256 * high);
      tile.acc[n][d] = 0.f;
    }
  }
}

// [A0 A1 A2 A3], [B..], [C..], [D..] (128-bit lanes) to [A0 B0 C0 D0], [A1 B1 C1 D1], ...
inline void transpose_lanes(const __m512i& a, const __m512i& b, const __m512i& c,
                            const __m512i& d, __m512i* out) {
  const __m512i ab_low = _mm512_shuffle_i32x4(a, b, 0x44);
  const __m512i ab_high = _mm512_shuffle_i32x4(a, b, 0xEE);
  const __m512i cd_low = _mm512_shuffle_i32x4(c, d, 0x44);
  const __m512i cd_high = _mm512_shuffle_i32x4(c, d, 0xEE);
  out[0] = _mm512_shuffle_i32x4(ab_low, cd_low, 0x88);
  out[1] = _mm512_shuffle_i32x4(ab_low, cd_low, 0xDD);
  out[2] = _mm512_shuffle_i32x4(ab_high, cd_high, 0x88);
  out[3] = _mm512_shuffle_i32x4(ab_high, cd_high, 0xDD);
}

// The B tile of a block's keys: row g holds bytes 4g .. 4g + 3 of every token's codes.
inline void transpose_keys(const uint8_t* k, int64_t row_bytes, uint8_t (*out)[64]) {
  __m512i r[16], t[16], u[16];
  for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k + i * row_bytes);
  for (int64_t i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // u[4 i + k], lane L: group 4L + k of tokens 4i .. 4i + 3.
  for (int64_t i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int64_t k = 0; k < 4; ++k) {
    __m512i rows[4];  // groups k, 4 + k, 8 + k, 12 + k
    transpose_lanes(u[k], u[4 + k], u[8 + k], u[12 + k], rows);
    for (int64_t lane = 0; lane < 4; ++lane) _mm512_store_si512(out[4 * lane + k], rows[lane]);
  }
}

// A block's rows of the B tiles of values: chunk c, row g holds dims 16c .. 16c + 15 of tokens
// 4g .. 4g + 3, interleaved (dim d's four tokens are bytes 4d' .. 4d' + 3); out[c] is the
// block's first row in chunk c's tile.
inline void interleave_values(const uint8_t* v, int64_t row_bytes, uint8_t (*out[4])[64]) {
  for (int64_t g = 0; g < 4; ++g) {
    const uint8_t* rows = v + 4 * g * row_bytes;
    const __m512i a = _mm512_loadu_si512(rows), b = _mm512_loadu_si512(rows + row_bytes);
    const __m512i c = _mm512_loadu_si512(rows + 2 * row_bytes);
    const __m512i d = _mm512_loadu_si512(rows + 3 * row_bytes);
    const __m512i ab_low = _mm512_unpacklo_epi8(a, b), ab_high = _mm512_unpackhi_epi8(a, b);
    const __m512i cd_low = _mm512_unpacklo_epi8(c, d), cd_high = _mm512_unpackhi_epi8(c, d);
    // q[j], lane L: dims 16L + 4j .. 16L + 4j + 3, four tokens each.
    const __m512i q0 = _mm512_unpacklo_epi16(ab_low, cd_low);
    const __m512i q1 = _mm512_unpackhi_epi16(ab_low, cd_low);
    const __m512i q2 = _mm512_unpacklo_epi16(ab_high, cd_high);
    const __m512i q3 = _mm512_unpackhi_epi16(ab_high, cd_high);
    __m512i chunks[4];
    transpose_lanes(q0, q1, q2, q3, chunks);
    for (int64_t chunk = 0; chunk < 4; ++chunk) _mm512_store_si512(out[chunk][g], chunks[chunk]);
  }
}

// A step's keys, values and row scales for one KV head. Past num_blocks they hold zeros or what
// an earlier step left: those tokens' weights are 0, and integer products of 0 are 0.
struct AmxStepKv {
  alignas(64) uint8_t keys[kAmxStepBlocks][16][64];
  alignas(64) uint8_t values[kAmxDim / 16][16][64];  // [chunk][token quad][dims x 4 tokens]
  alignas(64) float k_scale[kAmxStepBlocks * 16];
  alignas(64) float v_scale[kAmxStepBlocks * 16];
  int64_t num_blocks = 0;
};

// One step of up to 64 tokens (from token step_start) for one query tile: scores, online
// softmax and the weighted values, accumulated into the tile.
inline void amx_step(AmxQueryTile& tile, const AmxStepKv& kv, int64_t step_start) {
  alignas(64) int32_t sums_high[kAmxStepBlocks][kAmxQueries][16];
  alignas(64) int32_t sums_low[kAmxStepBlocks][kAmxQueries][16];
  _tile_loadd(0, tile.high, kAmxDim);
  _tile_loadd(1, tile.low, kAmxDim);
  for (int64_t b = 0; b < kv.num_blocks; ++b) {
    _tile_loadd(2, kv.keys[b], 64);
    _tile_zero(3);
    _tile_zero(4);
    _tile_dpbssd(3, 0, 2);
    _tile_dpbssd(4, 1, 2);
    _tile_stored(3, sums_high[b], 64);
    _tile_stored(4, sums_low[b], 64);
  }

  alignas(64) uint8_t weights_high[kAmxQueries][64] = {};
  alignas(64) uint8_t weights_low[kAmxQueries][64] = {};
  float correction[kAmxQueries];
  float weight_unit[kAmxQueries];
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t n = 0; n < tile.count; ++n) {
    correction[n] = 1.f;
    weight_unit[n] = 0.f;
    __m512 s[kAmxStepBlocks];
    __mmask16 valid[kAmxStepBlocks] = {};
    __m512 s_max = neg_inf;
    for (int64_t b = 0; b < kv.num_blocks; ++b) {
      const auto [t0, t1] = row_tokens_in_block(tile.row_ctx[n], 0, step_start + 16 * b, 16);
      if (t1 <= t0) continue;  // this query sees none of the block
      valid[b] = static_cast<__mmask16>(((1u << t1) - 1) & ~((1u << t0) - 1));
      const __m512i sum =
          _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(sums_high[b][n]), 8),
                           _mm512_load_si512(sums_low[b][n]));
      const __m512 raw = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(tile.unit[n]));
      s[b] = _mm512_mask_mul_ps(neg_inf, valid[b], raw, _mm512_load_ps(kv.k_scale + 16 * b));
      s_max = _mm512_max_ps(s_max, s[b]);
    }
    const float m_step = _mm512_reduce_max_ps(s_max);
    if (m_step == -std::numeric_limits<float>::infinity()) continue;
    const float m_new = std::max(tile.m[n], m_step);
    correction[n] = exp_scalar(tile.m[n] - m_new);
    tile.m[n] = m_new;
    __m512 w[kAmxStepBlocks];
    __m512 total = _mm512_setzero_ps();
    __m512 w_max = _mm512_setzero_ps();
    for (int64_t b = 0; b < kAmxStepBlocks; ++b) {
      if (!valid[b]) {
        w[b] = _mm512_setzero_ps();
        continue;
      }
      const __m512 e =
          _mm512_maskz_mov_ps(valid[b], exp512(_mm512_sub_ps(s[b], _mm512_set1_ps(m_new))));
      total = _mm512_add_ps(total, e);
      // Dead lanes stay exactly 0 whatever their scale bytes hold.
      w[b] = _mm512_maskz_mul_ps(valid[b], e, _mm512_load_ps(kv.v_scale + 16 * b));
      w_max = _mm512_max_ps(w_max, w[b]);
    }
    tile.l[n] = tile.l[n] * correction[n] + _mm512_reduce_add_ps(total);
    const float top = _mm512_reduce_max_ps(w_max);
    if (!(top > 0.f)) continue;
    weight_unit[n] = top / kAmxMaxWeightCode;
    const __m512 to_code = _mm512_set1_ps(kAmxMaxWeightCode / top);
    for (int64_t b = 0; b < kAmxStepBlocks; ++b) {
      const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(w[b], to_code));
      _mm_store_si128(reinterpret_cast<__m128i*>(weights_high[n] + 16 * b),
                      _mm512_cvtepi32_epi8(_mm512_srli_epi32(codes, 8)));
      _mm_store_si128(reinterpret_cast<__m128i*>(weights_low[n] + 16 * b),
                      _mm512_cvtepi32_epi8(_mm512_and_si512(codes, _mm512_set1_epi32(255))));
    }
  }

  alignas(64) int32_t out_high[2][kAmxQueries][16];
  alignas(64) int32_t out_low[2][kAmxQueries][16];
  _tile_loadd(5, weights_high, 64);
  _tile_loadd(6, weights_low, 64);
  for (int64_t c = 0; c < kAmxDim / 16; c += 2) {
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(0);
    _tile_zero(1);
    _tile_loadd(2, kv.values[c], 64);
    _tile_loadd(7, kv.values[c + 1], 64);
    _tile_dpbusd(3, 5, 2);
    _tile_dpbusd(4, 6, 2);
    _tile_dpbusd(0, 5, 7);
    _tile_dpbusd(1, 6, 7);
    _tile_stored(3, out_high[0], 64);
    _tile_stored(4, out_low[0], 64);
    _tile_stored(0, out_high[1], 64);
    _tile_stored(1, out_low[1], 64);
    for (int64_t n = 0; n < tile.count; ++n) {
      const __m512 corr = _mm512_set1_ps(correction[n]);
      const __m512 unit = _mm512_set1_ps(weight_unit[n]);
      for (int64_t half = 0; half < 2; ++half) {
        const __m512i sum =
            _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512(out_high[half][n]), 8),
                             _mm512_load_si512(out_low[half][n]));
        float* a = tile.acc[n] + 16 * (c + half);
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_load_ps(a), corr,
                                           _mm512_mul_ps(_mm512_cvtepi32_ps(sum), unit)));
      }
    }
  }
}

// The task: rows consecutive query positions of one sequence (row r sees ctx + r tokens), every
// KV head; q and out are [rows * kv_heads * group][64] floats, q scaled to the keys' rotation.
// At most kAmxMaxQueryHeads query vectors from at most kAmxMaxKvHeads KV heads; no sliding
// window.
inline void decode_seq_amx(const float* q, const uint8_t* cache, const int64_t* table,
                           int64_t ctx, int64_t rows, int64_t layer_offset, int64_t block_stride,
                           int64_t kv_heads, int64_t group, float scale, float* out) {
  constexpr int64_t bs = 16;
  const int64_t row_bytes = kAmxDim + 4;
  const int64_t per_head = rows * group;
  const int64_t tiles_per_head = (per_head + kAmxQueries - 1) / kAmxQueries;
  TORCH_CHECK(kv_heads * tiles_per_head <= kAmxMaxTiles, "decode_seq_amx: too many queries");
  const int64_t seq_heads = kv_heads * group;
  AmxQueryTile tiles[kAmxMaxTiles];
  for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
    for (int64_t i = 0; i < tiles_per_head; ++i) {
      int64_t heads[kAmxQueries], query_rows[kAmxQueries];
      const int64_t count = std::min(kAmxQueries, per_head - i * kAmxQueries);
      for (int64_t n = 0; n < count; ++n) {
        const int64_t qi = i * kAmxQueries + n;
        query_rows[n] = qi / group;
        heads[n] = query_rows[n] * seq_heads + kvh * group + qi % group;
      }
      fill_query_tile(tiles[kvh * tiles_per_head + i], q, heads, query_rows, count, ctx, scale);
    }
  }
  AmxDecodeConfig config;
  _tile_loadconfig(&config);
  const int64_t end_blk = (ctx + rows - 1 + bs - 1) / bs;
  const int64_t tile_bytes = bs * row_bytes;
  const int64_t layer_bytes = 2 * kv_heads * tile_bytes;
  AmxStepKv kv{};
  for (int64_t first_blk = 0; first_blk < end_blk; first_blk += kAmxStepBlocks) {
    kv.num_blocks = std::min(kAmxStepBlocks, end_blk - first_blk);
    const int64_t next_blk = first_blk + kv.num_blocks;
    for (int64_t blk = next_blk; blk < std::min(next_blk + kAmxStepBlocks, end_blk); ++blk) {
      const uint8_t* ahead = cache + table[blk] * block_stride + layer_offset;
      for (int64_t off = 0; off < layer_bytes; off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
      }
    }
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh) {
      for (int64_t b = 0; b < kv.num_blocks; ++b) {
        const uint8_t* block = cache + table[first_blk + b] * block_stride + layer_offset;
        const uint8_t* k = block + kvh * tile_bytes;
        const uint8_t* v = block + (kv_heads + kvh) * tile_bytes;
        transpose_keys(k, row_bytes, kv.keys[b]);
        uint8_t (*value_rows[4])[64];
        for (int64_t c = 0; c < 4; ++c) value_rows[c] = &kv.values[c][4 * b];
        interleave_values(v, row_bytes, value_rows);
        for (int64_t t = 0; t < bs; ++t) {
          std::memcpy(kv.k_scale + 16 * b + t, k + t * row_bytes + kAmxDim, sizeof(float));
          std::memcpy(kv.v_scale + 16 * b + t, v + t * row_bytes + kAmxDim, sizeof(float));
        }
      }
      for (int64_t i = 0; i < tiles_per_head; ++i) {
        amx_step(tiles[kvh * tiles_per_head + i], kv, first_blk * bs);
      }
    }
  }
  _tile_release();
  for (int64_t i = 0; i < kv_heads * tiles_per_head; ++i) {
    const AmxQueryTile& tile = tiles[i];
    for (int64_t n = 0; n < tile.count; ++n) {
      const __m512 inv = _mm512_set1_ps(1.f / tile.l[n]);
      for (int64_t c = 0; c < kAmxDim / 16; ++c) {
        _mm512_storeu_ps(out + tile.heads[n] * kAmxDim + 16 * c,
                         _mm512_mul_ps(_mm512_load_ps(tile.acc[n] + 16 * c), inv));
      }
    }
  }
}

}  // namespace splitserve

#endif
