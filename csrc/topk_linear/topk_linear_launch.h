// Host interface of the student-only passes (passes.cuh) over the vocabulary walk: the top-K loss
// from hidden states multiplies xs . ws^T alone (its teacher is K log-probabilities).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "../divergence/distill_params.h"
#include "../divergence/topk_params.h"
#include "../engine/cuda/vocab_walk.h"
#include "../fused_linear/fused_linear_launch.h"

namespace nitrobrew {
namespace cuda {

class StudentPasses {
 public:
  // xs, ws with unit-stride rows (unit_stride_rows), bias (the student's lm_head bias) contiguous.
  StudentPasses(const at::Tensor& xs, const at::Tensor& ws, const c10::optional<at::Tensor>& labels,
                const c10::optional<at::Tensor>& bias, const TopKParams& p);

  // How many vocabulary splits the forward pass uses: the rows of its partial results.
  int64_t forward_splits() const { return walk_.forward_splits(); }

  // The softmax state per row and split into partial [forward_splits, N, 2] (float64) and the logits
  // at the teacher's ids into picked [N, K] (float32; each row's ids sorted ascending in sorted_ids,
  // their positions in id_order, both int64 [N, K]; entries of rows that are masked are not written).
  void student_norm_pass(at::Tensor& partial, const at::Tensor& sorted_ids, const at::Tensor& id_order,
                         at::Tensor& picked) const;
  // The dense part of dLoss/dz (grad_rows [N, 3] float32: StudentGradRow in passes.cuh) for vocabulary entries
  // [chunk_begin, chunk_begin + chunk_cols) into grad_chunk, as FusedLinearPasses::grad_pass.
  void student_grad_pass(const at::Tensor& grad_rows, int64_t chunk_begin, int64_t chunk_cols,
                         at::Tensor& grad_chunk) const;
  // The backward's chunk width for a cap of max_cols (VocabWalk::grad_chunk_cols).
  int64_t grad_chunk_cols(int64_t max_cols) const { return walk_.grad_chunk_cols(max_cols); }

 private:
  FusedLinearOperands in_;
  DistillParams p_;
  VocabWalk walk_;
};

}  // namespace cuda
}  // namespace nitrobrew
