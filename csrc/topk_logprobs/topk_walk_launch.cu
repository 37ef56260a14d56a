// topk_logprobs' pass (topk_walk_pass.cuh) launched over the vocabulary walk.
#include "topk_walk_launch.h"

#include "../engine/cuda/cuda_types.h"
#include "topk_walk_pass.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

// The walk's options for one model: student = teacher = (x, w).
DistillParams walk_params(const TopKLogprobsParams& p, int64_t rows) {
  DistillParams f{};
  f.kind = Divergence::kForwardKL;
  f.inv_temperature = p.inv_temperature;
  f.logit_scale_s = f.logit_scale_t = p.logit_scale;
  f.softcap_s = f.softcap_t = p.softcap;
  f.ignore_index = -100;
  f.num_rows = rows;
  f.hidden_s = f.hidden_t = p.hidden;
  f.vocab_size = p.vocab_size;
  return f;
}

}  // namespace

TopKWalk::TopKWalk(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                   const TopKLogprobsParams& p)
    : x_(x), w_(w), bias_(bias), p_(p), walk_(x, x, w, w, x.size(0), p.vocab_size) {}

void TopKWalk::run(at::Tensor& partial, const at::Tensor& tau, at::Tensor& count, at::Tensor& keys) const {
  const int64_t rows = x_.size(0);
  TORCH_CHECK(partial.is_contiguous() && partial.scalar_type() == at::kDouble && partial.dim() == 3 &&
              partial.size(0) == splits() && partial.size(1) == rows && partial.size(2) == kNumTopKWalkSums);
  TORCH_CHECK(tau.is_contiguous() && tau.scalar_type() == at::kFloat && tau.numel() == rows);
  TORCH_CHECK(count.is_contiguous() && count.scalar_type() == at::kInt && count.numel() == rows);
  TORCH_CHECK(keys.is_contiguous() && keys.scalar_type() == at::kLong && keys.dim() == 2 && keys.size(0) == rows);
  if (rows == 0) return;
  const FusedLinearOperands in{x_, x_, w_, w_, c10::nullopt, bias_, bias_};
  const DistillParams f = walk_params(p_, rows);
  const LaunchPlan plan = walk_.forward_plan();
  NITROBREW_DISPATCH_CUDA_FLOATS(x_.scalar_type(), "nitrobrew_topk_walk_pass", {
    const FusedLinearArgs<T> a = make_args<T>(in, f);
    const typename TopKWalkPass<T>::Params params{partial.data_ptr<double>(), tau.data_ptr<float>(),
                                                  count.data_ptr<int32_t>(),
                                                  reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>()), keys.size(1)};
    walk_.launch<T, TopKWalkPass<T>>(a, plan, params);
  });
}

}  // namespace cuda
}  // namespace nitrobrew
