// CUDA forward of the fused-linear losses.
//
// Pass 1 (KLPass, on either kernel family of the vocabulary walk) folds every logit tile into
// per-row online states, one per vocabulary split; merge_rows_kernel merges the splits per row
// into the loss and the row statistics. JSD, the skew KLs and TVD run a second pass (MixturePass) with the
// merged log-normalizers, and merge_rows_kernel again adds its splits' sums into the loss.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../divergence/merge_rows.cuh"
#include "../divergence/nonfinite.h"
#include "../engine/cuda/cuda_types.h"
#include "fused_linear_args.cuh"
#include "fused_linear_launch.h"
#include "fused_linear_params.h"

namespace nitrobrew {
namespace cuda {
namespace {

template <typename T>
MergeRowsArgs merge_args(const FusedLinearArgs<T>& a, int64_t splits) {
  return {a.n_rows, static_cast<int>(splits), a.labels, a.ignore_index,
          RowFinish{a.div.kind == Divergence::kReverseKL, a.ce_weight, a.vocab_size}};
}

// Pass 1 over every split, and its splits merged per row: into the finished (loss, row_stats), or,
// for a shard, into the unfinished states `merged` [N, kNumPartialFields].
void forward_pass1(const FusedLinearPasses& passes, const FusedLinearOperands& in, const DistillParams& p,
                   at::Tensor& partial, at::Tensor& label_logit, float* merged, float* loss, float* row_stats) {
  passes.kl_pass(partial, label_logit);
  const int row_blocks = static_cast<int>((p.num_rows + 255) / 256);
  NITROBREW_DISPATCH_CUDA_FLOATS(in.xs.scalar_type(), "nitrobrew_merge_splits",
    const FusedLinearArgs<T> a = make_args<T>(in, p);
    merge_rows_kernel<float, float><<<row_blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        merge_args(a, passes.forward_splits()), a.div, partial.data_ptr<float>(), label_logit.data_ptr<float>(),
        nullptr, merged, loss, row_stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  );
}

void launch_forward(const FusedLinearPasses& passes, const FusedLinearOperands& in, const DistillParams& p,
                    at::Tensor& loss, at::Tensor& row_stats) {
  const int64_t splits = passes.forward_splits();
  const auto options = loss.options();
  at::Tensor partial = at::empty({splits, p.num_rows, kNumPartialFields}, options);
  at::Tensor label_logit = at::zeros({p.num_rows}, options);
  forward_pass1(passes, in, p, partial, label_logit, nullptr, loss.data_ptr<float>(), row_stats.data_ptr<float>());
  if (!has_second_pass(p.kind)) return;
  at::Tensor mixture = at::empty({splits, p.num_rows, 2}, options);
  passes.mixture_pass(row_stats, mixture);
  const int row_blocks = static_cast<int>((p.num_rows + 255) / 256);
  NITROBREW_DISPATCH_CUDA_FLOATS(in.xs.scalar_type(), "nitrobrew_finish_second_pass",
    const FusedLinearArgs<T> a = make_args<T>(in, p);
    merge_rows_kernel<float, float><<<row_blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        merge_args(a, splits), a.div, partial.data_ptr<float>(), label_logit.data_ptr<float>(),
        mixture.data_ptr<float>(), nullptr, loss.data_ptr<float>(), row_stats.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  );
}

std::tuple<at::Tensor, at::Tensor> fused_linear_fwd_cuda(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, int64_t ignore_index, c10::string_view divergence, double beta,
    double temperature, double ce_weight, c10::optional<double> softcap_s, c10::optional<double> softcap_t,
    double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v, bool entropy) {
  DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                             temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t,
                                             vocab_size, chunk_v);
  p.entropy = entropy;
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

// A vocabulary shard's forward (nitrobrew.distributed): pass 1's unfinished row states [N, 11] (with
// entropy, the student's entropy states too), or with row_stats (the whole vocabulary's) the second pass's
// sums over this shard [N, 2] in float64.
at::Tensor fused_linear_shard_cuda(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const c10::optional<at::Tensor>& row_stats, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v,
    bool entropy) {
  DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                             temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t,
                                             vocab_size, chunk_v);
  p.entropy = entropy && !row_stats.has_value();  // the partials' pass only, not the second pass
  TORCH_CHECK(xs.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  if (row_stats.has_value()) {
    TORCH_CHECK(row_stats->dim() == 2 && row_stats->size(0) == p.num_rows && row_stats->size(1) == kNumRowStats &&
                    row_stats->device() == xs.device(),
                "row_stats must be [N, ", int(kNumRowStats), "] on ", xs.device(), " as merge_shards returns it");
    TORCH_CHECK(has_second_pass(p.kind), "row_stats are given only to a second pass (jsd, the skew KLs, tvd)");
  }
  const c10::cuda::CUDAGuard guard(xs.device());
  const FusedLinearOperands in = prepare_operands(xs, xt, ws, wt, labels, bias_s, bias_t);
  const auto options = xs.options().dtype(at::kFloat);
  if (p.num_rows == 0) return at::zeros({0, row_stats.has_value() ? 2 : int64_t(kNumPartialFields)}, options);
  const FusedLinearPasses passes(in, p);
  const int64_t splits = passes.forward_splits();
  if (row_stats.has_value()) {
    at::Tensor mixture = at::zeros({splits, p.num_rows, 2}, options);  // masked rows: 0
    passes.mixture_pass(row_stats->to(at::kFloat).contiguous(), mixture);
    return mixture.to(at::kDouble).sum(0);
  }
  at::Tensor partial = at::empty({splits, p.num_rows, kNumPartialFields}, options);
  at::Tensor label_logit = at::zeros({p.num_rows}, options);
  at::Tensor merged = at::empty({p.num_rows, kNumPartialFields}, options);
  forward_pass1(passes, in, p, partial, label_logit, merged.data_ptr<float>(), nullptr, nullptr);
  return merged;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("fused_linear_fwd", &fused_linear_fwd_cuda);
  m.impl("fused_linear_shard", &fused_linear_shard_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
