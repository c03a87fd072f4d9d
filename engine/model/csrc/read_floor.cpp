// The memory floor of paged decode: read exactly the bytes a decode step's attention reads for
// one layer (each sequence's K and V tiles of every KV head, block by block through its table)
// and nothing else. loadtest/bench/cpu_kernels.py times it beside the decode kernels.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <vector>

// kv_cache: [NB, L, 2, KVH, BS, row] contiguous, any dtype; block_tables: [B, max_blocks]
// int64; context_lens: [B] int64. Returns a checksum of the bytes read, so they are read.
int64_t read_kv_blocks(at::Tensor kv_cache, at::Tensor block_tables, at::Tensor context_lens,
                       int64_t layer) {
  TORCH_CHECK(kv_cache.is_contiguous() && block_tables.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong);
  const int64_t layers = kv_cache.size(1), bs = kv_cache.size(4);
  const int64_t layer_bytes =
      kv_cache.numel() / kv_cache.size(0) / layers * kv_cache.element_size();
  const int64_t block_bytes = layer_bytes * layers;
  TORCH_CHECK(layer_bytes % 64 == 0, "read_kv_blocks: a layer's region is not whole cache lines");
  const auto* base = static_cast<const uint8_t*>(kv_cache.data_ptr());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  std::vector<uint64_t> sums(block_tables.size(0), 0);
  at::parallel_for(0, block_tables.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      uint64_t acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int64_t blk = 0; blk * bs < lens[b]; ++blk) {
        const int64_t* table = tables + b * max_blocks;
        const uint8_t* region = base + table[blk] * block_bytes + layer * layer_bytes;
        if ((blk + 1) * bs < lens[b]) {
          // Scattered blocks: fetch the next one while this one is read, as the kernels do.
          const uint8_t* next = base + table[blk + 1] * block_bytes + layer * layer_bytes;
          for (int64_t off = 0; off < layer_bytes; off += 64) __builtin_prefetch(next + off);
        }
        for (int64_t off = 0; off < layer_bytes; off += 64) {
          uint64_t words[8];
          std::memcpy(words, region + off, 64);
          for (int i = 0; i < 8; ++i) acc[i] ^= words[i];
        }
      }
      for (int i = 0; i < 8; ++i) sums[b] ^= acc[i];
    }
  });
  uint64_t total = 0;
  for (uint64_t s : sums) total ^= s;
  return static_cast<int64_t>(total);
}
