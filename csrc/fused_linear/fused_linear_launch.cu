// The fused-linear passes (passes.cuh) launched over the vocabulary walk (launch.h).
#include "fused_linear_launch.h"

#include "../engine/cuda/cuda_types.h"
#include "fused_linear_passes.cuh"

namespace nitrobrew {
namespace cuda {

namespace {

c10::optional<at::Tensor> contiguous_or_none(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(t->contiguous()) : c10::nullopt;
}

}  // namespace

FusedLinearOperands prepare_operands(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                     const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                     const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t) {
  return {unit_stride_rows(xs), unit_stride_rows(xt), unit_stride_rows(ws), unit_stride_rows(wt),
          contiguous_or_none(labels), contiguous_or_none(bias_s), contiguous_or_none(bias_t)};
}

FusedLinearPasses::FusedLinearPasses(const FusedLinearOperands& in, const DistillParams& p)
    : in_(in), p_(p), walk_(in.xs, in.xt, in.ws, in.wt, p.num_rows, p.vocab_size) {}

// The passes' arguments `a` for the inputs' dtype.
#define NITROBREW_DISPATCH_16_32(NAME, ...)                     \
  NITROBREW_DISPATCH_CUDA_FLOATS(in_.xs.scalar_type(), NAME, {  \
    const FusedLinearArgs<T> a = make_args<T>(in_, p_);         \
    __VA_ARGS__                                                 \
  })

void FusedLinearPasses::kl_pass(at::Tensor& partial, at::Tensor& label_logit) const {
  const LaunchPlan plan = walk_.forward_plan();
  NITROBREW_DISPATCH_16_32("nitrobrew_kl_pass", {
    if (p_.entropy) {  // the variant that also folds the student's entropy
      walk_.launch<T, KLPass<T, true>>(a, plan, {partial.data_ptr<float>(), label_logit.data_ptr<float>()});
    } else {
      walk_.launch<T, KLPass<T>>(a, plan, {partial.data_ptr<float>(), label_logit.data_ptr<float>()});
    }
  });
}

void FusedLinearPasses::mixture_pass(const at::Tensor& row_stats, at::Tensor& partial) const {
  const LaunchPlan plan = walk_.forward_plan();
  NITROBREW_DISPATCH_16_32("nitrobrew_mixture_pass", {
    const typename MixturePass<T>::Params params{row_stats.data_ptr<float>(), partial.data_ptr<float>()};
    walk_.launch<T, MixturePass<T>>(a, plan, params);
  });
}

void FusedLinearPasses::grad_pass(const at::Tensor& row_stats, int64_t chunk_begin, int64_t chunk_cols,
                                at::Tensor& grad_chunk) const {
  const LaunchPlan plan = walk_.grad_plan(chunk_begin, chunk_cols, grad_chunk);
  if (p_.num_rows == 0 || chunk_cols == 0) return;
  NITROBREW_DISPATCH_16_32("nitrobrew_grad_pass", {
    const typename GradPass<T>::Params params{row_stats.data_ptr<float>(), grad_chunk_of<T>(chunk_begin, chunk_cols,
                                                                                           grad_chunk)};
    walk_.launch<T, GradPass<T>>(a, plan, params);
  });
}

}  // namespace cuda
}  // namespace nitrobrew
