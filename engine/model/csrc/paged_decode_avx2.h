// The AVX2 + FMA decode path (paged_decode_avx2.cpp), declared where avx2.h says it is built.
#pragma once

#include "avx2.h"

#if SPLITSERVE_AVX2
#include <ATen/core/Tensor.h>

#include <cstdint>

// True (and done) when the AVX2 path covers this call: float32 or bfloat16, block size 16,
// head_dim 32, 64 or 128, at most 64 query heads.
bool paged_decode_avx2(const at::Tensor& q, const at::Tensor& kv_cache, const int64_t* tables,
                       const int64_t* lens, int64_t max_blocks, int64_t layer, float scale,
                       int64_t sliding_window, at::Tensor& out);
#endif
