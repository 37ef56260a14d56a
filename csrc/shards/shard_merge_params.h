// Checks of merge_shards' inputs (raising with the argument's name) into DistillParams.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "../divergence/distill_params.h"

namespace nitrobrew {

// partials [R, N, kNumPartialFields] (float32 or float64), mixture [R, N, 2] or none, labels [N] or
// none, all on one device; vocab_size is the whole vocabulary's.
DistillParams make_merge_params(const at::Tensor& partials, const c10::optional<at::Tensor>& mixture,
                                const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                c10::string_view divergence, double beta, double ce_weight, int64_t vocab_size);

}  // namespace nitrobrew
