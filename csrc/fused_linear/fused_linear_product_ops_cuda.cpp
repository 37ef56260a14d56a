// CUDA implementation of product_partials and product_grads (registration.cpp): a vocabulary shard's
// stages of the training path's step (nitrobrew/_training_shards.py), on the caller's stored products,
// with the single-device step's row kernels (fused_linear_product_rows.cu) cut at the merge.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "../divergence/row_partial.h"
#include "../divergence/row_stats.h"
#include "fused_linear_params.h"
#include "fused_linear_product_rows.h"

namespace nitrobrew {
namespace cuda {
namespace {

// The launch of the row kernels over zs, zt (float32 rows with a stride the kernels' vector loads take).
ProductRowsLaunch rows_launch(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                              const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                              at::ScalarType dtype, at::Tensor& labels_c) {
  TORCH_CHECK(zs.is_cuda(), "zs must be a CUDA tensor here, got ", zs.device());
  TORCH_CHECK(zs.scalar_type() == at::kFloat, "zs must be float32 products on CUDA, got ", zs.scalar_type());
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat,
              "dtype must be the inputs' bfloat16, float16 or float32 on CUDA, got ", dtype);
  TORCH_CHECK(zs.stride(0) == zt.stride(0) && zs.stride(0) == product_row_stride(zs.stride(0)) &&
                  reinterpret_cast<uintptr_t>(zs.data_ptr()) % 16 == 0 &&
                  reinterpret_cast<uintptr_t>(zt.data_ptr()) % 16 == 0,
              "zs and zt must be rows of one stride that the row kernels' vector loads take, 16-byte aligned (as "
              "nitrobrew::products returns them), got strides ", zs.stride(0), " and ", zt.stride(0));
  for (const auto* b : {&bias_s, &bias_t}) {
    TORCH_CHECK(!b->has_value() || ((*b)->scalar_type() == dtype && (*b)->is_contiguous()),
                "bias_s and bias_t must be contiguous in the inputs' dtype ", dtype, " on CUDA");
  }
  ProductRowsLaunch l{};
  l.zs = zs.data_ptr<float>();
  l.zt = zt.data_ptr<float>();
  l.ld = zs.stride(0);
  l.rows = zs.size(0);
  if (labels.has_value()) labels_c = labels->contiguous();
  l.labels = labels.has_value() ? labels_c.data_ptr<int64_t>() : nullptr;
  l.bias_s = bias_s.has_value() ? bias_s->data_ptr() : nullptr;
  l.bias_t = bias_t.has_value() ? bias_t->data_ptr() : nullptr;
  return l;
}

// The whole vocabulary's row statistics, as merge_shards returns them, on the products' device.
void check_row_stats(const at::Tensor& row_stats, const DistillParams& p, const at::Tensor& zs) {
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == p.num_rows && row_stats.size(1) == kNumRowStats &&
                  row_stats.device() == zs.device(),
              "row_stats must be [N, ", int(kNumRowStats), "] on ", zs.device(), " as merge_shards returns it, got ",
              row_stats.sizes());
}

at::Tensor product_partials_cuda(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                 const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                                 const c10::optional<at::Tensor>& row_stats, int64_t ignore_index,
                                 c10::string_view divergence, double beta, double temperature, double ce_weight,
                                 c10::optional<double> softcap_s, c10::optional<double> softcap_t,
                                 double logit_scale_s, double logit_scale_t, at::ScalarType dtype, bool entropy) {
  DistillParams p = make_product_params(zs, zt, labels, bias_s, bias_t, ignore_index, divergence, beta, temperature,
                                        ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t);
  p.entropy = entropy && !row_stats.has_value();  // the partials' pass only, not JSD's mixture pass
  const c10::cuda::CUDAGuard guard(zs.device());
  at::Tensor labels_c;
  ProductRowsLaunch l = rows_launch(zs, zt, labels, bias_s, bias_t, dtype, labels_c);
  if (row_stats.has_value()) {  // JSD's mixture sums from the whole vocabulary's statistics
    TORCH_CHECK(has_second_pass(p.kind), "row_stats are given only to a second pass (jsd, the skew KLs, tvd)");
    check_row_stats(*row_stats, p, zs);
    const at::Tensor stats = row_stats->to(at::kFloat).contiguous();
    l.row_stats = stats.data_ptr<float>();
    return launch_product_mixture(l, p, dtype).unsqueeze(0);
  }
  at::Tensor merged = at::empty({p.num_rows, kNumPartialFields}, zs.options());
  launch_product_partials(l, p, dtype, merged.data_ptr<float>());
  return merged.unsqueeze(0);  // one part: the shard's slices merged on the device
}

at::Tensor product_grads_cuda(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                              const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                              const at::Tensor& row_stats, const at::Tensor& row_scale, int64_t ignore_index,
                              c10::string_view divergence, double beta, double temperature, double ce_weight,
                              c10::optional<double> softcap_s, c10::optional<double> softcap_t, double logit_scale_s,
                              double logit_scale_t, at::ScalarType dtype) {
  const DistillParams p = make_product_params(zs, zt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                              temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
                                              logit_scale_t);
  const c10::cuda::CUDAGuard guard(zs.device());
  at::Tensor labels_c;
  ProductRowsLaunch l = rows_launch(zs, zt, labels, bias_s, bias_t, dtype, labels_c);
  check_row_stats(row_stats, p, zs);
  TORCH_CHECK(row_scale.dim() == 0 && row_scale.scalar_type() == at::kFloat && row_scale.device() == zs.device(),
              "row_scale must be a float32 scalar tensor on ", zs.device(), ", got ", row_scale.scalar_type(), " ",
              row_scale.sizes(), " on ", row_scale.device());
  const at::Tensor stats = row_stats.to(at::kFloat).contiguous();
  const at::Tensor scale = row_scale.contiguous();
  const int64_t ld = product_row_stride(p.vocab_size);
  at::Tensor grad = at::empty({p.num_rows, ld}, zs.options().dtype(dtype)).narrow(1, 0, p.vocab_size);
  l.row_stats = stats.data_ptr<float>();
  l.row_scale = scale.data_ptr<float>();
  l.grad = grad.data_ptr();
  l.ld_grad = ld;
  launch_product_grads(l, p, dtype);
  return grad;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("product_partials", &product_partials_cuda);
  m.impl("product_grads", &product_grads_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
