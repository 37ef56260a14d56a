#include "fused_linear_params.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace nitrobrew {
namespace {

double checked_softcap(c10::optional<double> cap, const char* name) {
  if (!cap.has_value()) return 0.0;
  TORCH_CHECK(std::isfinite(*cap) && *cap > 0.0, name, " must be a positive number or None, got ", *cap);
  return *cap;
}

// The options shared by both builders, after their own shape checks.
DistillParams with_options(const c10::optional<at::Tensor>& labels, int64_t ignore_index, c10::string_view divergence,
                           double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
                           c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t) {
  TORCH_CHECK(std::isfinite(ce_weight) && ce_weight >= 0.0,
              "ce_weight must be a non-negative number, got ", ce_weight);
  TORCH_CHECK(ce_weight == 0.0 || labels.has_value(), "ce_weight > 0 needs labels");
  DistillParams p = divergence_options(labels, ignore_index, divergence, beta, temperature);
  p.ce_weight = ce_weight;
  p.softcap_s = checked_softcap(softcap_s, "softcap_s");
  p.softcap_t = checked_softcap(softcap_t, "softcap_t");
  p.logit_scale_s = checked_logit_scale(logit_scale_s, "logit_scale_s");
  p.logit_scale_t = checked_logit_scale(logit_scale_t, "logit_scale_t");
  return p;
}

}  // namespace

DistillParams make_fused_linear_params(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                       const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                       const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                                       int64_t ignore_index, c10::string_view divergence, double beta,
                                       double temperature, double ce_weight, c10::optional<double> softcap_s,
                                       c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t,
                                       int64_t vocab_size, int64_t chunk_v) {
  check_floating_matrix(xs, "xs");
  check_floating_matrix(xt, "xt");
  check_floating_matrix(ws, "ws");
  check_floating_matrix(wt, "wt");
  TORCH_CHECK(xs.size(0) == xt.size(0), "xs and xt must have the same number of rows, got ",
              xs.size(0), " and ", xt.size(0));
  TORCH_CHECK(ws.size(1) == xs.size(1), "ws must be [V, D_s] with D_s = xs.size(-1) = ", xs.size(1),
              ", got ", ws.sizes());
  TORCH_CHECK(wt.size(1) == xt.size(1), "wt must be [V, D_t] with D_t = xt.size(-1) = ", xt.size(1),
              ", got ", wt.sizes());
  for (const at::Tensor* t : {&xt, &ws, &wt}) {
    TORCH_CHECK(t->scalar_type() == xs.scalar_type(),
                "xs, xt, ws and wt must share one dtype, got ", xs.scalar_type(), ", ",
                xt.scalar_type(), ", ", ws.scalar_type(), ", ", wt.scalar_type());
    TORCH_CHECK(t->device() == xs.device(), "xs, xt, ws and wt must be on one device, got ",
                xs.device(), ", ", xt.device(), ", ", ws.device(), ", ", wt.device());
  }
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= ws.size(0) && vocab_size <= wt.size(0),
              "vocab_size must be in [1, min(ws.size(0), wt.size(0))] = [1, ",
              std::min(ws.size(0), wt.size(0)), "], got ", vocab_size);
  TORCH_CHECK(chunk_v >= 0, "chunk_v must be positive (or 0 for automatic), got ", chunk_v);
  check_labels(labels, xs, "xs");
  check_bias(bias_s, ws, "bias_s", "ws");
  check_bias(bias_t, wt, "bias_t", "wt");

  DistillParams p = with_options(labels, ignore_index, divergence, beta, temperature, ce_weight, softcap_s, softcap_t,
                                 logit_scale_s, logit_scale_t);
  p.num_rows = xs.size(0);
  p.hidden_s = xs.size(1);
  p.hidden_t = xt.size(1);
  p.vocab_size = vocab_size;
  p.chunk_v = chunk_v;
  return p;
}

DistillParams make_product_params(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                  const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                                  int64_t ignore_index, c10::string_view divergence, double beta, double temperature,
                                  double ce_weight, c10::optional<double> softcap_s, c10::optional<double> softcap_t,
                                  double logit_scale_s, double logit_scale_t) {
  TORCH_CHECK(zs.dim() == 2 && zs.sizes() == zt.sizes(), "zs and zt must be [N, V] of one shape, got ", zs.sizes(),
              " and ", zt.sizes());
  TORCH_CHECK(zs.scalar_type() == zt.scalar_type() &&
                  (zs.scalar_type() == at::kFloat || zs.scalar_type() == at::kDouble),
              "zs and zt must be float32 (float64 for float64 inputs) products, got ", zs.scalar_type(), " and ",
              zt.scalar_type());
  TORCH_CHECK(zs.device() == zt.device(), "zs and zt must be on one device, got ", zs.device(), " and ", zt.device());
  TORCH_CHECK(zs.stride(1) == 1 && zt.stride(1) == 1, "zs and zt must have unit column strides");
  check_labels(labels, zs, "zs");
  for (const auto* b : {&bias_s, &bias_t}) {
    if (!b->has_value()) continue;
    TORCH_CHECK((*b)->dim() == 1 && (*b)->size(0) >= zs.size(1) && (*b)->device() == zs.device(),
                "bias_s and bias_t must be [>= V = ", zs.size(1), "] on ", zs.device(), ", got ", (*b)->sizes(), " on ",
                (*b)->device());
  }
  DistillParams p = with_options(labels, ignore_index, divergence, beta, temperature, ce_weight, softcap_s, softcap_t,
                                 logit_scale_s, logit_scale_t);
  p.num_rows = zs.size(0);
  p.hidden_s = p.hidden_t = 0;
  p.vocab_size = zs.size(1);
  p.chunk_v = 0;
  return p;
}

}  // namespace nitrobrew
