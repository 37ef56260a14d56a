// Host entry points of the CUDA kernels that other translation units call.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "../fused_linear_params.h"

namespace nitrobrew {
namespace cuda {

// Writes dLoss/dz (without the per-row upstream gradient) for vocabulary entries
// [chunk_begin, chunk_begin + grad_chunk.size(1)) into grad_chunk ([N, >= cols], row-major,
// the inputs' dtype), recomputing the logit tiles; masked rows and padded entries get 0.
void launch_logit_grad(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
                       const c10::optional<at::Tensor>& labels, const FusedLinearParams& p,
                       const at::Tensor& row_stats, int64_t chunk_begin, int64_t chunk_cols, at::Tensor& grad_chunk);

// Rows must be unit-stride for the tile loads; anything else is copied once (O(rows x D)).
inline at::Tensor unit_stride_rows(const at::Tensor& t) {
  return t.stride(1) == 1 && t.stride(0) >= t.size(1) ? t : t.contiguous();
}

}  // namespace cuda
}  // namespace nitrobrew
