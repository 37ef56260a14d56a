// Checks of the ops from logits (nitrobrew.logits): zs, zt are the [N, V] student and teacher logits
// (no matrices, soft-caps or cross-entropy add-on), or zs and a teacher's top-K.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "../divergence/distill_params.h"
#include "../divergence/topk_params.h"

namespace nitrobrew {

DistillParams make_logits_params(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                 int64_t ignore_index, c10::string_view divergence, double beta, double temperature);

// The logits [N, V], ids [N, K] (int64, in [0, V): read on the host unless told not to),
// log-probabilities [N, K] and labels.
TopKParams make_topk_logits_params(const at::Tensor& zs, const at::Tensor& teacher_ids,
                                   const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels,
                                   int64_t ignore_index, double temperature, bool renormalize,
                                   c10::string_view divergence, double weight, bool check_ids_on_host = true);

}  // namespace nitrobrew
