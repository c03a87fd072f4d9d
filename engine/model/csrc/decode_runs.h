// Runs of decode rows that are one sequence's consecutive query positions (a decode with draft
// tokens has one row per token): the decode kernels compute such a run in one task, reading
// each K/V block once for all of its rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace splitserve {

// Rows [firsts[i], firsts[i + 1]) of a batch have the same block table (over the blocks the
// last of them reads) and context lengths n, n + 1, ...; at most max_rows per run. The last
// entry is batch. Any rows that qualify may join, from one sequence or not: each row's result
// depends only on its table, its length and its query.
inline std::vector<int64_t> shared_table_runs(const int64_t* tables, const int64_t* lens,
                                              int64_t batch, int64_t max_blocks,
                                              int64_t block_size, int64_t max_rows) {
  std::vector<int64_t> firsts;
  firsts.reserve(batch + 1);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = firsts.empty() ? -1 : firsts.back();
    const bool joins =
        first >= 0 && b - first < max_rows && lens[b] == lens[b - 1] + 1 &&
        std::memcmp(tables + b * max_blocks, tables + first * max_blocks,
                    sizeof(int64_t) * ((lens[b] + block_size - 1) / block_size)) == 0;
    if (!joins) firsts.push_back(b);
  }
  firsts.push_back(batch);
  return firsts;
}

// The tokens [t0, t1) of the block starting at token blk_start that a query row seeing the
// first row_ctx tokens attends to (within sliding_window when it is > 0); empty when t1 <= t0.
inline std::pair<int64_t, int64_t> row_tokens_in_block(int64_t row_ctx, int64_t sliding_window,
                                                       int64_t blk_start, int64_t block_size) {
  const int64_t row_start =
      sliding_window > 0 ? std::max<int64_t>(0, row_ctx - sliding_window) : 0;
  return {std::max<int64_t>(row_start - blk_start, 0),
          std::min(block_size, row_ctx - blk_start)};
}

}  // namespace splitserve
