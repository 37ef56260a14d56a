// Host interface of the fused-linear passes (passes.cuh) over the vocabulary walk, shared by the
// CUDA forward (fwd.cu) and backward (bwd.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "../divergence/distill_params.h"
#include "../engine/cuda/vocab_walk.h"

namespace nitrobrew {
namespace cuda {

// The tensors the passes read, as their kernels take them: unit-stride rows, contiguous labels and
// biases (the op's arguments bias_s, bias_t, or none). A student-only pass gives xs, ws and bias_s
// as both models'.
struct FusedLinearOperands {
  at::Tensor xs, xt, ws, wt;
  c10::optional<at::Tensor> labels, bias_s, bias_t;
};
FusedLinearOperands prepare_operands(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                     const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                     const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t);

// Runs the passes with the fastest kernel family that serves these inputs on the current device.
class FusedLinearPasses {
 public:
  FusedLinearPasses(const FusedLinearOperands& in, const DistillParams& p);

  KernelPath path() const { return walk_.path(); }
  // How many vocabulary splits the forward passes use: the rows of their partial results.
  int64_t forward_splits() const { return walk_.forward_splits(); }

  // Forward pass 1: writes partial [forward_splits, N, kNumPartialFields] (row_partial.h) and the label logits [N].
  void kl_pass(at::Tensor& partial, at::Tensor& label_logit) const;
  // Forward pass 2 of JSD: writes partial [forward_splits, N, 2] from pass 1's row_stats.
  void mixture_pass(const at::Tensor& row_stats, at::Tensor& partial) const;
  // Backward: dLoss/dz (without the per-row upstream gradient) for vocabulary entries
  // [chunk_begin, chunk_begin + chunk_cols) into grad_chunk ([N, >= chunk_cols], row-major,
  // the inputs' dtype); masked rows and padded entries get 0. chunk_begin must be a multiple
  // of kGradChunkAlign.
  void grad_pass(const at::Tensor& row_stats, int64_t chunk_begin, int64_t chunk_cols, at::Tensor& grad_chunk) const;
  // The backward's chunk width for a cap of max_cols (VocabWalk::grad_chunk_cols).
  int64_t grad_chunk_cols(int64_t max_cols) const { return walk_.grad_chunk_cols(max_cols); }

 private:
  FusedLinearOperands in_;
  DistillParams p_;
  VocabWalk walk_;
};

}  // namespace cuda
}  // namespace nitrobrew
