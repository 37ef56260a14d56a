// CUDA backward of the fused-linear losses (host): walks the vocabulary in chunks
// (engine/cuda/chunked_grads.h); for each, the gradient pass (GradPass, passes.cuh, launched by launch.cu) recomputes the logit
// tiles on chip and writes dLoss/dz for the chunk, from which cuBLAS forms dxs and dws.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../engine/cuda/chunked_grads.h"
#include "fused_linear_launch.h"
#include "fused_linear_params.h"

namespace nitrobrew {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> fused_linear_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& xs_in, const at::Tensor& xt_in, const at::Tensor& ws_in,
    const at::Tensor& wt_in, const c10::optional<at::Tensor>& labels_in, const at::Tensor& row_stats_in,
    int64_t ignore_index, c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, int64_t vocab_size, int64_t chunk_v, bool compute_dxs, bool compute_dws) {
  const DistillParams p = make_fused_linear_params(xs_in, xt_in, ws_in, wt_in, labels_in, ignore_index, divergence, beta,
                                                       temperature, ce_weight, softcap_s, softcap_t, vocab_size,
                                                       chunk_v);
  TORCH_CHECK(xs_in.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == p.num_rows, "grad_loss must be [N] = [", p.num_rows,
              "], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats_in.dim() == 2 && row_stats_in.size(0) == p.num_rows && row_stats_in.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] as the forward returns it, got ", row_stats_in.sizes());
  TORCH_CHECK(grad_loss.device() == xs_in.device() && row_stats_in.device() == xs_in.device(),
              "grad_loss and row_stats must be on ", xs_in.device());
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const at::Tensor xs = unit_stride_rows(xs_in), xt = unit_stride_rows(xt_in);
  const at::Tensor ws = unit_stride_rows(ws_in), wt = unit_stride_rows(wt_in);
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  const at::Tensor row_stats = row_stats_in.to(at::kFloat).contiguous();
  const FusedLinearPasses passes(xs, xt, ws, wt, labels, p);
  return chunked_matrix_grads(grad_loss, xs, ws, p.vocab_size, /*max_chunk_cols=*/0, compute_dxs, compute_dws,
                              [&](int64_t c0, int64_t cols, at::Tensor& dz) { passes.grad_pass(row_stats, c0, cols, dz); });
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_bwd", &fused_linear_bwd_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
