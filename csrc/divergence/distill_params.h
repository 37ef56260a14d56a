// Options of the student-vs-teacher divergence ops over [N x V] logits, whether the logits are
// products of hidden states and unembeddings (fused_linear) or given (logits): validated once by
// each family's params.cpp and handed to the kernels as a plain struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <cmath>

#include "online_state.h"
#include "row_stats.h"

namespace nitrobrew {

struct DistillParams {
  Divergence kind;
  double beta;             // the mixture weight of M = (1 - beta) p + beta q (mixture_beta); 0 for forward KL
                           // and TVD, 1 for reverse KL
  double inv_temperature;  // 1 / tau, applied after the softcap
  double ce_weight;        // weight of the hard-label cross-entropy add-on (0 = off)
  double softcap_s;        // 0 = no soft-capping
  double softcap_t;
  double logit_scale_s;    // multiplier of the model's logits before the soft-cap (1 = none)
  double logit_scale_t;
  int64_t ignore_index;
  int64_t num_rows;    // N
  int64_t hidden_s;    // D_s (0 for given logits)
  int64_t hidden_t;    // D_t
  int64_t vocab_size;  // V: real vocabulary rows of ws and wt; padded rows past it are ignored
  int64_t chunk_v;     // vocabulary tile width requested by the caller (0 = automatic)
  bool has_labels;
  bool entropy;  // also each row's student entropy (RowStat kEntropyS): the fused-linear forwards, when asked
};

// The divergence named by an op's `divergence` argument: "forward_kl", "reverse_kl", "jsd",
// "skew_forward_kl", "skew_reverse_kl" or "tvd". `weight` is the op's `beta` argument: JSD's beta, or the
// skew KLs' alpha, in [0, 1]. JSD(0) and the skew KLs at alpha = 0 are forward KL, JSD(1) and the skew
// reverse KL at alpha = 0 reverse KL (the mixture formula is discontinuous there), so they run as those.
// It is not read for the two KLs and TVD.
Divergence parse_divergence(c10::string_view name, double weight);

// The mixture weight beta of M = (1 - beta) p + beta q for a divergence and the op's weight (above).
double mixture_beta(Divergence kind, double weight);

// The options every divergence op shares (divergence, beta, temperature, labels); the family's
// params.cpp fills in the shapes and its extras.
DistillParams divergence_options(const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                 c10::string_view divergence, double beta, double temperature);

// A multiplier of a model's logits (logit_scale_s / logit_scale_t): finite and > 0.
double checked_logit_scale(double scale, const char* name);

// An lm_head bias `name`, if given: [w.size(0)], w's dtype and device (w named `w_name` in the error).
void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& w, const char* name, const char* w_name);

// A 2-D float32, float64, bfloat16 or float16 tensor named `name`.
void check_floating_matrix(const at::Tensor& t, const char* name);

// labels, if given: int64, one per row of `rows_of` (named `name` in the error), on its device.
void check_labels(const c10::optional<at::Tensor>& labels, const at::Tensor& rows_of, const char* name);

template <typename T>
DivergenceParams<T> divergence_params(const DistillParams& p) {
  DivergenceParams<T> d;
  d.kind = p.kind;
  d.beta = static_cast<T>(p.beta);
  d.one_minus_beta = static_cast<T>(1.0 - p.beta);
  return d;
}

}  // namespace nitrobrew
