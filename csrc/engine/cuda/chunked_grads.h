// The matrix gradients of a loss over x . w^T logits, from dLoss/dz written one vocabulary chunk
// at a time: shared by the CUDA backwards of the fused-linear and the top-K losses.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <tuple>

namespace nitrobrew {
namespace cuda {

// Writes dLoss/dz without the per-row upstream gradient for vocabulary entries
// [chunk_begin, chunk_begin + chunk_cols) into dz ([N, >= chunk_cols], row-major, xs's dtype).
using FillGradChunk = std::function<void(int64_t chunk_begin, int64_t chunk_cols, at::Tensor& dz)>;

// The widest backward chunk within the memory budget (~192 MiB of dz in xs's dtype) and
// max_chunk_cols when that is > 0, a multiple of kGradChunkAlign: at least one alignment and at
// most the vocabulary rounded up to it. What a pass's grad_chunk_cols may choose from.
int64_t grad_chunk_cap(int64_t n, int64_t elem, int64_t vocab_size, int64_t max_chunk_cols);

// Walks the first vocab_size rows of ws in chunks of chunk_cols (a multiple of kGradChunkAlign,
// at most grad_chunk_cap's; the last one may be narrower) and returns
//   dxs = g * sum_chunks dz_chunk . ws_chunk       (accumulated in float32)
//   dws[chunk] = dz_chunk^T . (g * xs)             (rows past vocab_size are 0)
//   dbias[chunk] = dz_chunk^T . g                  (an lm_head bias's; float32 sums, g rounded to
//                                                   xs's dtype as g * xs is; rows past vocab_size 0)
// in xs's dtype, each an empty tensor when not requested. g = grad_loss [N] (a logit scale folded
// in by the caller). xs and ws must have unit-stride rows. Extra memory: the chunk buffer, the
// float32 dxs accumulator and g * xs.
std::tuple<at::Tensor, at::Tensor, at::Tensor> chunked_matrix_grads(const at::Tensor& grad_loss, const at::Tensor& xs,
                                                                    const at::Tensor& ws, int64_t vocab_size,
                                                                    int64_t chunk_cols, bool compute_dxs,
                                                                    bool compute_dws, bool compute_dbias,
                                                                    const FillGradChunk& fill);

}  // namespace cuda
}  // namespace nitrobrew
