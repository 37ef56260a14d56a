// Host interface of the CUDA logit-tile kernels, shared by the forward and backward ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "../fused_linear_params.h"

namespace nitrobrew {
namespace cuda {

// The two kernel families: mma.sync (sm_80 and later, and the only one for float32 inputs or
// rows that TMA cannot address) and TMA-fed wgmma (sm_90a). NITROBREW_FORCE_SM80=1 in the
// environment selects mma.sync everywhere, so the sm_80 kernels can be tested on Hopper.
enum class KernelPath { kMmaSync, kWgmma };

// Runs the passes of the fused-linear losses (fused_linear_passes.cuh) over the vocabulary
// with the fastest kernel family that serves these inputs on the current device. The
// operands must have unit-stride rows (unit_stride_rows).
class LogitTilePasses {
 public:
  LogitTilePasses(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
                  const c10::optional<at::Tensor>& labels, const FusedLinearParams& p);

  KernelPath path() const { return path_; }
  // How many vocabulary splits the forward passes use: the rows of their partial results.
  int64_t forward_splits() const { return forward_splits_; }

  // Forward pass 1: writes partial [forward_splits, N, 8] and the label logits [N].
  void kl_pass(at::Tensor& partial, at::Tensor& label_logit) const;
  // Forward pass 2 of JSD: writes partial [forward_splits, N, 2] from pass 1's row_stats.
  void mixture_pass(const at::Tensor& row_stats, at::Tensor& partial) const;
  // Backward: dLoss/dz (without the per-row upstream gradient) for vocabulary entries
  // [chunk_begin, chunk_begin + chunk_cols) into grad_chunk ([N, >= chunk_cols], row-major,
  // the inputs' dtype); masked rows and padded entries get 0. chunk_begin must be a multiple
  // of kGradChunkAlign.
  void grad_pass(const at::Tensor& row_stats, int64_t chunk_begin, int64_t chunk_cols, at::Tensor& grad_chunk) const;

  // The student-only passes (student_passes.cuh) of the top-K loss, which multiply xs . ws^T
  // alone: the softmax state per row and split into partial [forward_splits, N, 2] (float64) and
  // the logits at the teacher's ids into picked [N, K] (float32; each row's ids sorted ascending in
  // sorted_ids, their positions in id_order, both int64 [N, K]; entries of rows that are masked
  // are not written), and the dense part of dLoss/dz (grad_rows [N, 3] float32, StudentGradRow)
  // for a chunk as grad_pass.
  void student_norm_pass(at::Tensor& partial, const at::Tensor& sorted_ids, const at::Tensor& id_order,
                         at::Tensor& picked) const;
  void student_grad_pass(const at::Tensor& grad_rows, int64_t chunk_begin, int64_t chunk_cols,
                         at::Tensor& grad_chunk) const;

 private:
  at::Tensor xs_, xt_, ws_, wt_;
  c10::optional<at::Tensor> labels_;
  FusedLinearParams p_;
  KernelPath path_;
  bool vectorized_;  // mma.sync path: 16-byte cp.async loads
  int64_t tile_cols_, forward_tiles_per_split_, forward_splits_;
};

// Vocabulary chunks of the backward start at multiples of this (a whole number of tiles of
// either kernel family).
constexpr int64_t kGradChunkAlign = 768;

// Rows must be unit-stride for the tile loads; anything else is copied once (O(rows x D)).
inline at::Tensor unit_stride_rows(const at::Tensor& t) {
  return t.stride(1) == 1 && t.stride(0) >= t.size(1) ? t : t.contiguous();
}

}  // namespace cuda
}  // namespace nitrobrew
