#include "logits_params.h"

#include <c10/util/Exception.h>

namespace nitrobrew {

DistillParams make_logits_params(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                 int64_t ignore_index, c10::string_view divergence, double beta, double temperature) {
  check_floating_matrix(zs, "zs");
  check_floating_matrix(zt, "zt");
  TORCH_CHECK(zs.sizes() == zt.sizes(), "zs and zt must have the same shape [..., V], got ", zs.sizes(), " and ",
              zt.sizes());
  TORCH_CHECK(zs.size(1) >= 1, "the vocabulary (the last dimension of zs and zt) must not be empty");
  TORCH_CHECK(zt.scalar_type() == zs.scalar_type(), "zs and zt must share one dtype, got ", zs.scalar_type(),
              " and ", zt.scalar_type());
  TORCH_CHECK(zt.device() == zs.device(), "zs and zt must be on one device, got ", zs.device(), " and ",
              zt.device());
  check_labels(labels, zs, "zs");
  DistillParams p = divergence_options(labels, ignore_index, divergence, beta, temperature);
  p.num_rows = zs.size(0);
  p.vocab_size = zs.size(1);
  return p;
}

TopKParams make_topk_logits_params(const at::Tensor& zs, const at::Tensor& teacher_ids,
                                   const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, double temperature, bool renormalize,
                                   c10::string_view divergence, double weight, bool check_ids_on_host) {
  TORCH_CHECK(zs.dim() == 2, "zs must be [N, V], got ", zs.sizes());
  check_floating_matrix(zs, "zs");
  return topk_teacher_params(zs, "zs", zs.size(1), teacher_ids, teacher_logprobs, labels, ignore_index, temperature,
                             renormalize, divergence, weight, check_ids_on_host);
}

}  // namespace nitrobrew
