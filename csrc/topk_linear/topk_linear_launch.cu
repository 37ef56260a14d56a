// The student-only passes (passes.cuh) launched over the vocabulary walk (launch.h).
#include "topk_linear_launch.h"

#include "../engine/cuda/cuda_types.h"
#include "topk_linear_passes.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

// The fused-linear kernels' options for the student-only passes: student = teacher = (xs, ws).
DistillParams student_pass_params(const TopKParams& p, bool has_labels) {
  DistillParams f{};
  f.kind = Divergence::kForwardKL;
  f.beta = 0.0;
  f.inv_temperature = p.inv_temperature;
  f.logit_scale_s = f.logit_scale_t = p.logit_scale;
  f.ignore_index = p.ignore_index;
  f.num_rows = p.num_rows;
  f.hidden_s = f.hidden_t = p.hidden;
  f.vocab_size = p.vocab_size;
  f.chunk_v = p.chunk_v;
  f.has_labels = has_labels;
  return f;
}

}  // namespace

StudentPasses::StudentPasses(const at::Tensor& xs, const at::Tensor& ws, const c10::optional<at::Tensor>& labels,
                             const c10::optional<at::Tensor>& bias, const TopKParams& p)
    : in_{xs, xs, ws, ws, labels, bias, bias}, p_(student_pass_params(p, labels.has_value())),
      walk_(xs, xs, ws, ws, p.num_rows, p.vocab_size) {}

// The passes' arguments `a` for the inputs' dtype.
#define NITROBREW_DISPATCH_16_32(NAME, ...)                     \
  NITROBREW_DISPATCH_CUDA_FLOATS(in_.xs.scalar_type(), NAME, {  \
    const FusedLinearArgs<T> a = make_args<T>(in_, p_);         \
    __VA_ARGS__                                                 \
  })

void StudentPasses::student_norm_pass(at::Tensor& partial, const at::Tensor& sorted_ids, const at::Tensor& id_order,
                                        at::Tensor& picked) const {
  TORCH_CHECK(sorted_ids.is_contiguous() && id_order.is_contiguous() && picked.is_contiguous() &&
              sorted_ids.scalar_type() == at::kLong && id_order.scalar_type() == at::kLong &&
              picked.scalar_type() == at::kFloat && sorted_ids.sizes() == picked.sizes() &&
              id_order.sizes() == picked.sizes() && picked.dim() == 2 && picked.size(0) == p_.num_rows);
  const LaunchPlan plan = walk_.forward_plan();
  NITROBREW_DISPATCH_16_32("nitrobrew_student_norm_pass", {
    const typename StudentNormPass<T>::Params params{partial.data_ptr<double>(), sorted_ids.data_ptr<int64_t>(),
                                                     id_order.data_ptr<int64_t>(), picked.data_ptr<float>(),
                                                     picked.size(1)};
    walk_.launch<T, StudentNormPass<T>>(a, plan, params);
  });
}

void StudentPasses::student_grad_pass(const at::Tensor& grad_rows, int64_t chunk_begin, int64_t chunk_cols,
                                        at::Tensor& grad_chunk) const {
  TORCH_CHECK(grad_rows.is_contiguous() && grad_rows.scalar_type() == at::kFloat &&
              grad_rows.size(0) == p_.num_rows && grad_rows.size(1) == kNumStudentGradRow);
  const LaunchPlan plan = walk_.grad_plan(chunk_begin, chunk_cols, grad_chunk);
  if (p_.num_rows == 0 || chunk_cols == 0) return;
  NITROBREW_DISPATCH_16_32("nitrobrew_student_grad_pass", {
    const typename StudentGradPass<T>::Params params{grad_rows.data_ptr<float>(),
                                                     grad_chunk_of<T>(chunk_begin, chunk_cols, grad_chunk)};
    walk_.launch<T, StudentGradPass<T>>(a, plan, params);
  });
}

}  // namespace cuda
}  // namespace nitrobrew
