// The CUDA kernel that merges each row's parts and finishes the row: the parts are a forward's
// vocabulary splits (fused_linear/fused_linear_fwd.cu) or the vocabulary shards of several devices
// (shards/merge_cuda.cu); the math is row_partial.h's, as on the CPU.
#pragma once

#include "row_partial.h"

namespace nitrobrew {
namespace cuda {

struct MergeRowsArgs {
  int64_t n_rows;
  int parts;              // R: partials are [R, N, kNumPartialFields], mixture [R, N, 2]
  const int64_t* labels;  // [N] over the whole vocabulary, or nullptr
  int64_t ignore_index;
  RowFinish finish;
};

// One thread per row, the parts merged in order (deterministic). Outputs, where given:
//   merged [N, kNumPartialFields]: the merged unfinished state (masked rows: empty states);
//   loss [N], row_stats [N, kNumRowStats]: the finished row (masked rows untouched: zero them);
//     a second pass's loss needs `mixture` (its sums, [R, N, 2]), without it only the row statistics'
//     log-normalizers are final.
// label_logit [N], if given, holds the label's logit in place of the parts' (a forward's splits
// write it there: one writer per row).
template <typename T, typename M>
__global__ void merge_rows_kernel(MergeRowsArgs a, DivergenceParams<M> div, const T* __restrict__ partials,
                                  const T* __restrict__ label_logit, const M* __restrict__ mixture,
                                  T* __restrict__ merged, T* __restrict__ loss, T* __restrict__ row_stats) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= a.n_rows) return;
  const bool valid = a.labels == nullptr || a.labels[n] != a.ignore_index;
  RowPartial<T> st;
  M sum_a = M(0), sum_b = M(0);  // the second pass's sums (second_pass_terms)
  for (int r = 0; valid && r < a.parts; ++r) {
    const int64_t at = int64_t(r) * a.n_rows + n;
    merge(st, load_partial<T>(partials + at * kNumPartialFields));
    if (mixture != nullptr) {
      sum_a += mixture[2 * at];
      sum_b += mixture[2 * at + 1];
    }
  }
  if (valid && label_logit != nullptr) st.label_logit = label_logit[n];
  if (merged != nullptr) store_partial(st, merged + n * kNumPartialFields);
  if (!valid || loss == nullptr) return;
  T* row = row_stats + n * kNumRowStats;
  T value = finish_row(st, a.finish, a.labels != nullptr ? a.labels[n] : 0, row);
  if (mixture != nullptr && has_second_pass(div.kind)) {
    value = finish_second_pass_row(sum_a, sum_b, div, a.finish, st.label_logit, row);
  }
  loss[n] = value;
}

}  // namespace cuda
}  // namespace nitrobrew
