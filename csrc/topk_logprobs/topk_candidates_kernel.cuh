// The second kernel of topk_logprobs' walk path (topk_logprobs_cuda.cu): one block per row merges the walk's
// per-split sums into the row's log-normalizer and entropy, checks that its candidate list holds its k best (at
// least k entries at or above the threshold, none dropped past the list's capacity, finite sums), and selects
// and sorts them with the row kernel's radix select (topk_rows_kernel.cuh). A row that fails the check is
// flagged for the row kernel's path instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "topk_rows_kernel.cuh"
#include "topk_walk_launch.h"

namespace nitrobrew {
namespace cuda {

struct TopKCandidateArgs {
  const double* partial;  // [splits, rows, kNumTopKWalkSums] (topk_walk_launch.h)
  int64_t splits, rows;
  const int32_t* count;   // [rows]
  const uint64_t* keys;   // [rows, cap] order keys
  int64_t cap;
  int k;
  float* logprobs;        // [rows, k]
  int64_t* ids;           // [rows, k]
  float* stats;           // [rows, kNumTopKLogprobsStats]
  uint8_t* fallback;      // [rows], zeroed: set for the rows left to the row kernel's path
};

static __global__ void __launch_bounds__(kTopKRowThreads) topk_candidates_kernel(TopKCandidateArgs a) {
  using namespace topk_rows;
  __shared__ Shared sh;
  const int64_t row = blockIdx.x;
  RowSums sums{kNegInf<float>, 0.0, 0.0};
  for (int64_t split = 0; split < a.splits; ++split) {
    const double* s = a.partial + (split * a.rows + row) * kNumTopKWalkSums;
    sums = merge(sums, RowSums{static_cast<float>(s[kWalkMax]), s[kWalkSum], s[kWalkCentered]});
  }
  const int count = a.count[row];
  const double log_sum = log(sums.sum), lse = sums.max + log_sum, entropy = log_sum - sums.centered / sums.sum;
  if (count < a.k || count > a.cap || !isfinite(lse) || !isfinite(entropy)) {  // the same in every thread
    if (threadIdx.x == 0) a.fallback[row] = 1;
    return;
  }
  if (threadIdx.x == 0) {
    sh.kept_count = 0;
    sh.min_kept = 0xffffffffu;
  }
  // The list in pieces that fit behind the k kept, each followed by a selection where the next would not fit.
  const uint64_t* keys = a.keys + row * a.cap;
  const int piece = kBuffer - a.k;
  int held = 0;
  for (int base = 0; base < count; base += piece) {
    const int n = min(piece, count - base);
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const uint64_t key = keys[base + i];
      sh.value[held + i] = float_of_order(static_cast<uint32_t>(key >> 32));
      sh.id[held + i] = static_cast<int32_t>(~static_cast<uint32_t>(key));
    }
    held += n;
    __syncthreads();
    if (held > a.k && (base + n == count || held + min(piece, count - base - n) > kBuffer)) {
      select_k(sh, held, a.k);  // ends with a barrier
      held = a.k;
    }
  }
  int n2 = 1;
  while (n2 < a.k) n2 <<= 1;
  for (int i = a.k + threadIdx.x; i < n2; i += kThreads) {  // padding after every real entry
    sh.value[i] = kNegInf<float>;
    sh.id[i] = INT32_MAX;
  }
  __syncthreads();
  sort_candidates(sh.value, sh.id, n2);
  float* lp = a.logprobs + row * a.k;
  int64_t* ids = a.ids + row * a.k;
  for (int j = threadIdx.x; j < a.k; j += kThreads) {
    lp[j] = static_cast<float>(sh.value[j] - lse);
    ids[j] = sh.id[j];
  }
  if (threadIdx.x == 0) {
    a.stats[row * kNumTopKLogprobsStats + kLogNormalizer] = static_cast<float>(lse);
    a.stats[row * kNumTopKLogprobsStats + kEntropy] = static_cast<float>(entropy);
  }
}

static inline void launch_topk_candidates(const TopKCandidateArgs& a, cudaStream_t stream) {
  if (a.rows > 0) topk_candidates_kernel<<<static_cast<unsigned>(a.rows), kTopKRowThreads, 0, stream>>>(a);
}

}  // namespace cuda
}  // namespace nitrobrew
