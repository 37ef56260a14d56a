// CUDA forward of the fused-linear losses.
//
// Pass 1 (KLPass, on either kernel family of the vocabulary walk) folds every logit tile into
// per-row online states, one per vocabulary split; merge_kl_kernel merges the splits per row
// into the loss and the row statistics. JSD runs a second pass (MixturePass) with the merged
// log-normalizers, and finish_jsd_kernel sums its splits.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../divergence/nonfinite.h"
#include "../engine/cuda/cuda_types.h"
#include "fused_linear_args.cuh"
#include "fused_linear_launch.h"
#include "fused_linear_params.h"

namespace nitrobrew {
namespace cuda {
namespace {

// Merges the splits of each row (in split order: deterministic) into loss and row_stats.
template <typename T>
__global__ void merge_kl_kernel(FusedLinearArgs<T> a, int splits, const float* __restrict__ partial,
                                const float* __restrict__ label_logit, float* __restrict__ loss,
                                float* __restrict__ row_stats) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= a.n_rows) return;
  if (a.labels != nullptr && a.labels[n] == a.ignore_index) return;  // outputs stay 0
  KLState<float> st;
  SoftmaxState<float> ce;
  for (int s = 0; s < splits; ++s) {
    const float* in = partial + (int64_t(s) * a.n_rows + n) * kPartialFields;
    KLState<float> part;
    part.w = {in[0], in[1]};
    part.o = {in[2], in[3]};
    part.a = in[4];
    merge(st, part);
    merge(ce, SoftmaxState<float>{in[5], in[6]});
  }
  float* row = row_stats + n * kNumRowStats;
  float value = store_kl_row(finish_kl_row(st, a.div.kind == Divergence::kReverseKL), row);
  if (a.ce_weight != 0.f) {
    const int64_t y = a.labels[n];
    LogNormalizer<float> norm_ce = log_normalizer(ce);
    // A label outside [0, V) (eager calls raise in Python first): the cross-entropy is undefined,
    // NaN here and, through the NaN log-normalizer, in the row's gradient (nonfinite.h); no
    // device-side assertion.
    if (y < 0 || y >= a.vocab_size) norm_ce.max = kNaN<float>;
    row[kMaxCE] = norm_ce.max;
    row[kLogSumCE] = norm_ce.log_sum;
    value -= a.ce_weight * log_prob(label_logit[n], norm_ce);
  }
  loss[n] = value;
}

template <typename T>
__global__ void finish_jsd_kernel(FusedLinearArgs<T> a, int splits, const float* __restrict__ partial,
                                  const float* __restrict__ label_logit, float* __restrict__ loss,
                                  float* __restrict__ row_stats) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= a.n_rows) return;
  if (a.labels != nullptr && a.labels[n] == a.ignore_index) return;
  float kl_q_m = 0.f, kl_p_m = 0.f;
  for (int s = 0; s < splits; ++s) {
    kl_q_m += partial[(int64_t(s) * a.n_rows + n) * 2];
    kl_p_m += partial[(int64_t(s) * a.n_rows + n) * 2 + 1];
  }
  float* row = row_stats + n * kNumRowStats;
  row[kGradCenter] = kl_p_m;
  float value = a.div.beta * kl_q_m + a.div.one_minus_beta * kl_p_m;
  if (a.ce_weight != 0.f) {
    value -= a.ce_weight * log_prob(label_logit[n], LogNormalizer<float>{row[kMaxCE], row[kLogSumCE]});
  }
  loss[n] = value;
}

void launch_forward(const FusedLinearPasses& passes, const FusedLinearOperands& in, const DistillParams& p,
                    at::Tensor& loss, at::Tensor& row_stats) {
  const int64_t splits = passes.forward_splits();
  const auto options = loss.options();
  at::Tensor partial = at::empty({splits, p.num_rows, kPartialFields}, options);
  at::Tensor label_logit = at::zeros({p.num_rows}, options);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int row_blocks = static_cast<int>((p.num_rows + 255) / 256);
  passes.kl_pass(partial, label_logit);
  NITROBREW_DISPATCH_CUDA_FLOATS(in.xs.scalar_type(), "nitrobrew_merge_splits",
    const FusedLinearArgs<T> a = make_args<T>(in, p);
    merge_kl_kernel<T><<<row_blocks, 256, 0, stream>>>(a, static_cast<int>(splits), partial.data_ptr<float>(),
                                                       label_logit.data_ptr<float>(), loss.data_ptr<float>(),
                                                       row_stats.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (a.div.kind == Divergence::kJSD) {
      passes.mixture_pass(row_stats, partial);
      finish_jsd_kernel<T><<<row_blocks, 256, 0, stream>>>(a, static_cast<int>(splits), partial.data_ptr<float>(),
                                                           label_logit.data_ptr<float>(), loss.data_ptr<float>(),
                                                           row_stats.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  );
}

std::tuple<at::Tensor, at::Tensor> fused_linear_fwd_cuda(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, int64_t ignore_index, c10::string_view divergence, double beta,
    double temperature, double ce_weight, c10::optional<double> softcap_s, c10::optional<double> softcap_t,
    double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v) {
  const DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence,
                                                   beta, temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
                                                   logit_scale_t, vocab_size, chunk_v);
  TORCH_CHECK(xs.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  const c10::cuda::CUDAGuard guard(xs.device());
  const FusedLinearOperands in = prepare_operands(xs, xt, ws, wt, labels, bias_s, bias_t);
  const auto options = xs.options().dtype(at::kFloat);
  at::Tensor loss = at::zeros({p.num_rows}, options);
  at::Tensor row_stats = at::zeros({p.num_rows, kNumRowStats}, options);
  if (p.num_rows == 0) return {loss, row_stats};
  const FusedLinearPasses passes(in, p);
  launch_forward(passes, in, p, loss, row_stats);
  return {loss, row_stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_fwd", &fused_linear_fwd_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
