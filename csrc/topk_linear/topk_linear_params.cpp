#include "topk_linear_params.h"

#include <c10/util/Exception.h>

#include "../divergence/distill_params.h"

namespace nitrobrew {

TopKParams make_topk_linear_params(const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& teacher_ids,
                                   const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels,
                                   const c10::optional<at::Tensor>& bias_s, int64_t ignore_index, double temperature,
                                   double logit_scale_s, bool renormalize, int64_t chunk_v,
                                   c10::string_view divergence, double weight, bool check_ids_on_host) {
  TORCH_CHECK(xs.dim() == 2 && ws.dim() == 2 && ws.size(1) == xs.size(1),
              "xs must be [N, D] and ws [V, D], got ", xs.sizes(), " and ", ws.sizes());
  check_floating_matrix(xs, "xs");
  TORCH_CHECK(ws.scalar_type() == xs.scalar_type(), "xs and ws must share one dtype, got ", xs.scalar_type(),
              " and ", ws.scalar_type());
  TORCH_CHECK(ws.device() == xs.device(), "xs and ws must be on one device, got ", xs.device(), " and ",
              ws.device());
  TORCH_CHECK(ws.size(0) >= 1, "ws must have at least one row");
  TORCH_CHECK(chunk_v >= 0, "chunk_v must be positive (or 0 for automatic), got ", chunk_v);
  check_bias(bias_s, ws, "bias_s", "ws");
  TopKParams p = topk_teacher_params(xs, "xs", ws.size(0), teacher_ids, teacher_logprobs, labels, ignore_index,
                                     temperature, renormalize, divergence, weight, check_ids_on_host);
  p.logit_scale = checked_logit_scale(logit_scale_s, "logit_scale_s");
  p.hidden = xs.size(1);
  p.chunk_v = chunk_v;
  return p;
}

}  // namespace nitrobrew
