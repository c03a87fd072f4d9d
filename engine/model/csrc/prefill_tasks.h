// The work split of paged prefill, shared by its instruction-set paths (paged_prefill.cpp:
// bfloat16 on AVX-512 BF16; paged_prefill_avx2.cpp: float32 on AVX2).
//
// A task is (chunk, KV head, tile of up to tile_queries query positions); its rows are the
// tile's positions times the query heads of that KV head (GQA), and it reads the keys its
// tile can see: causal, and within the sliding window if any.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace splitserve {

constexpr int64_t kPrefillBlock = 16;    // tokens per cache block (the only size built)
constexpr int64_t kPrefillMaxRows = 64;  // query rows of one task

struct PrefillTask {
  int64_t seq;
  int64_t kv_head;
  int64_t q_begin;  // tile [q_begin, q_end) of the chunk's query positions
  int64_t q_end;
  int64_t key_begin;  // keys [key_begin, key_end) the tile reads (causal, windowed)
  int64_t key_end;
};

struct PrefillChunk {
  const int64_t* table;
  int64_t q_start;  // first row of the chunk in q / out
  int64_t q_len;
  int64_t first_pos;  // position of the chunk's first query token
};

// Chunk s is rows [starts[s], starts[s] + lens[s]) of q: the last lens[s] of its ctxs[s]
// context tokens, whose blocks are row s of tables ([num_seqs, max_blocks]). Fills chunks and
// tasks, tasks longest first: tiles late in a long context cost the most, and are handed out
// dynamically.
inline void build_prefill_tasks(const int64_t* tables, const int64_t* starts, const int64_t* lens,
                                const int64_t* ctxs, int64_t num_seqs, int64_t max_blocks,
                                int64_t kv_heads, int64_t group, int64_t sliding_window,
                                std::vector<PrefillChunk>& chunks,
                                std::vector<PrefillTask>& tasks) {
  const int64_t tile_queries = std::clamp<int64_t>(kPrefillMaxRows / group, 1, 16);
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= ctxs[s], "paged_prefill: bad chunk lengths");
    TORCH_CHECK((ctxs[s] + kPrefillBlock - 1) / kPrefillBlock <= max_blocks,
                "paged_prefill: block table too short");
    chunks.push_back({tables + s * max_blocks, starts[s], lens[s], ctxs[s] - lens[s]});
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t b = 0; b < lens[s]; b += tile_queries) {
        const int64_t e = std::min(lens[s], b + tile_queries);
        const int64_t key_end = ctxs[s] - lens[s] + e;
        const int64_t first = ctxs[s] - lens[s] + b;
        const int64_t key_begin =
            sliding_window > 0 ? std::max<int64_t>(0, first - sliding_window + 1) : 0;
        tasks.push_back({s, h, b, e, key_begin, key_end});
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const PrefillTask& a, const PrefillTask& b) {
    return a.key_end - a.key_begin > b.key_end - b.key_begin;
  });
}

// Where one step's query and output rows are and how to read the cache. Row r of a task is
// query position r / group of its tile, for query head r % group of its KV head.
template <typename T>
struct PrefillLayout {
  const T* q;
  int64_t q_stride_t, q_stride_h;
  T* out;
  int64_t out_stride_t, out_stride_h;
  const T* cache;
  int64_t block_stride, layer_offset, kv_heads, group;
  float scale;
  int64_t window;  // <= 0: none

  int64_t token(const PrefillTask& task, const PrefillChunk& chunk, int64_t r) const {
    return chunk.q_start + task.q_begin + r / group;
  }
  int64_t head(const PrefillTask& task, int64_t r) const {
    return task.kv_head * group + r % group;
  }
  const T* q_row(const PrefillTask& task, const PrefillChunk& chunk, int64_t r) const {
    return q + token(task, chunk, r) * q_stride_t + head(task, r) * q_stride_h;
  }
  T* out_row(const PrefillTask& task, const PrefillChunk& chunk, int64_t r) const {
    return out + token(task, chunk, r) * out_stride_t + head(task, r) * out_stride_h;
  }
  // The row's position in its sequence (what causality and the window compare).
  int32_t position(const PrefillTask& task, const PrefillChunk& chunk, int64_t r) const {
    return static_cast<int32_t>(chunk.first_pos + task.q_begin + r / group);
  }
};

}  // namespace splitserve
