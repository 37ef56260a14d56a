// Options of topk_logprobs (the teacher's side of top-K distillation): a model's K most likely tokens
// and their log-probabilities over its whole vocabulary, from its hidden states and unembedding.
// Validated once, handed to the kernels as a struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>

#include "topk_logprobs_limits.h"

namespace nitrobrew {

struct TopKLogprobsParams {
  int64_t num_rows, hidden, vocab_size, k;
  double inv_temperature;
  double logit_scale;  // multiplier of the logits before the soft-cap (1 = none)
  double softcap;      // 0 = none
  int64_t chunk_v;     // vocabulary tile width requested by the caller (0 = automatic)
};

// x [N, D], w [V_rows, D] of one floating dtype and device, bias [V_rows] or None, 1 <= k <=
// min(vocab_size, kMaxTopKLogprobsK), vocab_size in [1, V_rows].
TopKLogprobsParams make_topk_logprobs_params(const at::Tensor& x, const at::Tensor& w, int64_t k,
                                             const c10::optional<at::Tensor>& bias, double temperature,
                                             c10::optional<double> softcap, double logit_scale, int64_t vocab_size,
                                             int64_t chunk_v);

}  // namespace nitrobrew
