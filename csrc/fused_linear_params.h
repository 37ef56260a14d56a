// Options of the fused-linear distillation ops, validated once and handed to the
// device kernels as a plain struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "online_state.h"
#include "row_stats.h"

namespace nitrobrew {

struct FusedLinearParams {
  LossKind kind;
  double beta;             // JSD mixture weight; 0 for forward KL, 1 for reverse KL
  double inv_temperature;  // 1 / tau, applied after the softcap
  double ce_weight;        // weight of the hard-label cross-entropy add-on (0 = off)
  double softcap_s;        // 0 = no soft-capping
  double softcap_t;
  int64_t ignore_index;
  int64_t num_rows;    // N
  int64_t hidden_s;    // D_s
  int64_t hidden_t;    // D_t
  int64_t vocab_size;  // V: real vocabulary rows of ws and wt; padded rows past it are ignored
  int64_t chunk_v;     // vocabulary tile width requested by the caller (0 = automatic)
  bool has_labels;
};

// Checks shapes, dtypes and devices of the op's inputs (raising with the argument's
// name) and returns the options with the loss kind resolved from beta.
FusedLinearParams make_fused_linear_params(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
    double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, int64_t vocab_size, int64_t chunk_v);

// labels, if given: int64, one per row of `rows_of` (named `name` in the error), on its device.
void check_labels(const c10::optional<at::Tensor>& labels, const at::Tensor& rows_of, const char* name);

// The same options for the logit-level ops (nitrobrew.logits): zs, zt are the [N, V] student and
// teacher logits; there are no matrices, soft-caps or cross-entropy add-on.
FusedLinearParams make_logit_params(const at::Tensor& zs, const at::Tensor& zt,
                                    const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                    double temperature);

template <typename T>
DivergenceParams<T> divergence_params(const FusedLinearParams& p) {
  DivergenceParams<T> d;
  d.kind = p.kind;
  d.beta = static_cast<T>(p.beta);
  d.one_minus_beta = static_cast<T>(1.0 - p.beta);
  d.log_1m_beta = p.kind == LossKind::kJSD ? static_cast<T>(std::log1p(-p.beta)) : T(0);
  d.log_beta = p.kind == LossKind::kJSD ? static_cast<T>(std::log(p.beta)) : T(0);
  return d;
}

}  // namespace nitrobrew
