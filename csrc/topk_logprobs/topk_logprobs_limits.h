// topk_logprobs' limits and output layout, free of torch so that standalone CUDA programs
// (tools/experiments/topk_rows_bench.cu) can include the kernel.
#pragma once

#include <cstdint>

namespace nitrobrew {

// The largest K: each row keeps K running candidates (value and id) through the vocabulary walk.
constexpr int64_t kMaxTopKLogprobsK = 1024;

// Columns of topk_logprobs' per-row statistics.
enum TopKLogprobsStat : int { kLogNormalizer = 0, kEntropy, kNumTopKLogprobsStats };

}  // namespace nitrobrew
