// Checks of the fused-linear ops' inputs (raising with the argument's name) into DistillParams.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "../divergence/distill_params.h"

namespace nitrobrew {

DistillParams make_fused_linear_params(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                       const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                       const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                                       int64_t ignore_index, c10::string_view divergence, double beta,
                                       double temperature, double ce_weight, c10::optional<double> softcap_s,
                                       c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t,
                                       int64_t vocab_size, int64_t chunk_v);

// The same options for ops on stored products zs, zt ([N, V] in the accumulation dtype: float32, float64
// for float64 inputs): vocab_size is their column count, the biases [>= V] entries on their device.
DistillParams make_product_params(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                  const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                                  int64_t ignore_index, c10::string_view divergence, double beta, double temperature,
                                  double ce_weight, c10::optional<double> softcap_s, c10::optional<double> softcap_t,
                                  double logit_scale_s, double logit_scale_t);

}  // namespace nitrobrew
