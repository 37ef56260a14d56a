// Checks of the top-K ops from hidden states: xs [N, D] and ws [V, D] of one floating dtype, the
// lm_head bias and logit scale, the teacher's ids and log-probabilities (divergence/topk_params.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "../divergence/topk_params.h"

namespace nitrobrew {

TopKParams make_topk_linear_params(const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& teacher_ids,
                                   const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels,
                                   const c10::optional<at::Tensor>& bias_s, int64_t ignore_index, double temperature,
                                   double logit_scale_s, bool renormalize, int64_t chunk_v,
                                   c10::string_view divergence, double weight, bool check_ids_on_host = true);

}  // namespace nitrobrew
