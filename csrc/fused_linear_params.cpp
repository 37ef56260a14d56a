#include "fused_linear_params.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace nitrobrew {

namespace {

void check_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be a 2-D tensor, got ", t.dim(), " dimensions");
  TORCH_CHECK(
      t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ||
          t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
      name, " must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
}

double checked_softcap(c10::optional<double> cap, const char* name) {
  if (!cap.has_value()) return 0.0;
  TORCH_CHECK(std::isfinite(*cap) && *cap > 0.0, name, " must be a positive number or None, got ", *cap);
  return *cap;
}

void check_divergence_options(double beta, double temperature) {
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0,
              "temperature must be a positive number, got ", temperature);
  TORCH_CHECK(beta >= 0.0 && beta <= 1.0, "beta must be in [0, 1], got ", beta);
}

// The options every op shares; the caller fills in the shapes and the fused-linear extras.
FusedLinearParams divergence_only_params(const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                         double beta, double temperature) {
  FusedLinearParams p;
  p.kind = beta == 0.0 ? LossKind::kForwardKL : beta == 1.0 ? LossKind::kReverseKL : LossKind::kJSD;
  p.beta = beta;
  p.inv_temperature = 1.0 / temperature;
  p.ce_weight = 0.0;
  p.softcap_s = p.softcap_t = 0.0;
  p.ignore_index = ignore_index;
  p.hidden_s = p.hidden_t = 0;
  p.chunk_v = 0;
  p.has_labels = labels.has_value();
  return p;
}

}  // namespace

void check_labels(const c10::optional<at::Tensor>& labels, const at::Tensor& rows_of, const char* name) {
  if (!labels.has_value()) return;
  TORCH_CHECK(labels->scalar_type() == at::kLong, "labels must be int64, got ", labels->scalar_type());
  TORCH_CHECK(labels->dim() == 1 && labels->size(0) == rows_of.size(0), "labels must hold one entry per row of ",
              name, " (", rows_of.size(0), "), got ", labels->sizes());
  TORCH_CHECK(labels->device() == rows_of.device(), "labels must be on ", rows_of.device(), ", got ",
              labels->device());
}

FusedLinearParams make_logit_params(const at::Tensor& zs, const at::Tensor& zt,
                                    const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
                                    double temperature) {
  check_matrix(zs, "zs");
  check_matrix(zt, "zt");
  TORCH_CHECK(zs.sizes() == zt.sizes(), "zs and zt must have the same shape [..., V], got ", zs.sizes(), " and ",
              zt.sizes());
  TORCH_CHECK(zs.size(1) >= 1, "the vocabulary (the last dimension of zs and zt) must not be empty");
  TORCH_CHECK(zt.scalar_type() == zs.scalar_type(), "zs and zt must share one dtype, got ", zs.scalar_type(),
              " and ", zt.scalar_type());
  TORCH_CHECK(zt.device() == zs.device(), "zs and zt must be on one device, got ", zs.device(), " and ",
              zt.device());
  check_divergence_options(beta, temperature);
  check_labels(labels, zs, "zs");
  FusedLinearParams p = divergence_only_params(labels, ignore_index, beta, temperature);
  p.num_rows = zs.size(0);
  p.vocab_size = zs.size(1);
  return p;
}

FusedLinearParams make_fused_linear_params(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, int64_t ignore_index, double beta,
    double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, int64_t vocab_size, int64_t chunk_v) {
  check_matrix(xs, "xs");
  check_matrix(xt, "xt");
  check_matrix(ws, "ws");
  check_matrix(wt, "wt");
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
  check_divergence_options(beta, temperature);
  TORCH_CHECK(std::isfinite(ce_weight) && ce_weight >= 0.0,
              "ce_weight must be a non-negative number, got ", ce_weight);
  TORCH_CHECK(chunk_v >= 0, "chunk_v must be positive (or 0 for automatic), got ", chunk_v);
  check_labels(labels, xs, "xs");
  TORCH_CHECK(ce_weight == 0.0 || labels.has_value(), "ce_weight > 0 needs labels");

  FusedLinearParams p = divergence_only_params(labels, ignore_index, beta, temperature);
  p.ce_weight = ce_weight;
  p.softcap_s = checked_softcap(softcap_s, "softcap_s");
  p.softcap_t = checked_softcap(softcap_t, "softcap_t");
  p.num_rows = xs.size(0);
  p.hidden_s = xs.size(1);
  p.hidden_t = xt.size(1);
  p.vocab_size = vocab_size;
  p.chunk_v = chunk_v;
  return p;
}

}  // namespace nitrobrew
