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

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_linear_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
    const at::Tensor& wt, const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const at::Tensor& row_stats_in, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v,
    bool compute_dxs, bool compute_dws, bool compute_dbias_s) {
  const DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence,
                                                   beta, temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
                                                   logit_scale_t, vocab_size, chunk_v);
  TORCH_CHECK(xs.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == p.num_rows, "grad_loss must be [N] = [", p.num_rows,
              "], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats_in.dim() == 2 && row_stats_in.size(0) == p.num_rows && row_stats_in.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] as the forward returns it, got ", row_stats_in.sizes());
  TORCH_CHECK(grad_loss.device() == xs.device() && row_stats_in.device() == xs.device(),
              "grad_loss and row_stats must be on ", xs.device());
  const c10::cuda::CUDAGuard guard(xs.device());
  const FusedLinearOperands in = prepare_operands(xs, xt, ws, wt, labels, bias_s, bias_t);
  const at::Tensor row_stats = row_stats_in.to(at::kFloat).contiguous();
  const FusedLinearPasses passes(in, p);
  // The chunk holds dLoss/d(scale * (x . w^T + bias)); the scale's factor rides on g.
  const at::Tensor g = p.logit_scale_s == 1.0 ? grad_loss : grad_loss * p.logit_scale_s;
  const int64_t chunk_cols =
      passes.grad_chunk_cols(grad_chunk_cap(p.num_rows, in.xs.element_size(), p.vocab_size, /*max_chunk_cols=*/0));
  return chunked_matrix_grads(g, in.xs, in.ws, p.vocab_size, chunk_cols, compute_dxs, compute_dws,
                              compute_dbias_s && bias_s.has_value(),
                              [&](int64_t c0, int64_t cols, at::Tensor& dz) { passes.grad_pass(row_stats, c0, cols, dz); });
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_bwd", &fused_linear_bwd_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
