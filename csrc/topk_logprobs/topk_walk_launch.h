// Host interface of topk_logprobs' pass over the vocabulary walk (topk_walk_pass.cuh).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "../engine/cuda/vocab_walk.h"
#include "topk_logprobs_params.h"

namespace nitrobrew {
namespace cuda {

// Columns of the walk's per-row, per-split partial sums: the row's maximum m of the logits over the temperature,
// the sum of exp(s - m) and that of exp(s - m) (s - m).
enum TopKWalkSum : int { kWalkMax = 0, kWalkSum, kWalkCentered, kNumTopKWalkSums };

class TopKWalk {
 public:
  // x [rows, D] (rows <= p.num_rows), w [>= vocab_size, D] with unit-stride rows; bias contiguous, w's dtype.
  // (The walk takes float32 too, its products on CUDA cores; topk_logprobs_cuda.cu sends it 16-bit inputs.)
  TopKWalk(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
           const TopKLogprobsParams& p);

  // How many vocabulary splits the pass uses: the rows of its partial sums.
  int64_t splits() const { return walk_.forward_splits(); }

  // Each row's sums into partial [splits, rows, kNumTopKWalkSums] (float64), and its entries at or above tau [rows]
  // (float32) into keys [rows, cap] (int64 order keys) and count [rows] (int32, zeroed by the caller).
  void run(at::Tensor& partial, const at::Tensor& tau, at::Tensor& count, at::Tensor& keys) const;

 private:
  at::Tensor x_, w_;
  c10::optional<at::Tensor> bias_;
  TopKLogprobsParams p_;
  VocabWalk walk_;
};

}  // namespace cuda
}  // namespace nitrobrew
