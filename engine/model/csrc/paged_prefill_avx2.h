// The float32 AVX2 path of paged prefill (paged_prefill_avx2.cpp), declared where avx2.h says it
// is built.
#pragma once

#include <cstdint>
#include <vector>

#include "avx2.h"
#include "prefill_tasks.h"

#if SPLITSERVE_AVX2
namespace splitserve {

// Runs every task (in parallel, dynamically) for head_dim `dim` (32, 64 or 128).
void run_prefill_f32_avx2(const std::vector<PrefillTask>& tasks,
                          const std::vector<PrefillChunk>& chunks, const PrefillLayout<float>& lay,
                          int64_t dim);

}  // namespace splitserve
#endif
