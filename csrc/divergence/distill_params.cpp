#include "distill_params.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace nitrobrew {
namespace {

// A mixture weight in (0, float32's smallest normal) is refused: the kernels hold it in float32, and the CUDA
// kernels' special-function log of 16-bit inputs flushes it to 0 (log u = -inf: an infinite loss).
void check_not_denormal(double weight, const char* name) {
  constexpr double kTiny = std::numeric_limits<float>::min();
  TORCH_CHECK(!(weight > 0.0 && weight < kTiny), name, " must be 0 or at least ", kTiny,
              " (float32's smallest normal number: the kernels hold it in float32), got ", weight);
}

}  // namespace

Divergence parse_divergence(c10::string_view name, double weight) {
  if (name == "forward_kl") return Divergence::kForwardKL;
  if (name == "reverse_kl") return Divergence::kReverseKL;
  if (name == "tvd") return Divergence::kTVD;
  const bool skew_forward = name == "skew_forward_kl", skew_reverse = name == "skew_reverse_kl";
  TORCH_CHECK(name == "jsd" || skew_forward || skew_reverse,
              "divergence must be 'forward_kl', 'reverse_kl', 'jsd', 'skew_forward_kl', 'skew_reverse_kl' or 'tvd', "
              "got '", name, "'");
  if (skew_forward || skew_reverse) {
    TORCH_CHECK(weight >= 0.0 && weight <= 1.0, "alpha must be in [0, 1], got ", weight);
    check_not_denormal(weight, "alpha");
    if (weight == 0.0) return skew_forward ? Divergence::kForwardKL : Divergence::kReverseKL;
    return skew_forward ? Divergence::kSkewForwardKL : Divergence::kSkewReverseKL;
  }
  TORCH_CHECK(weight >= 0.0 && weight <= 1.0, "beta must be in [0, 1], got ", weight);
  check_not_denormal(weight, "beta");
  return weight == 0.0 ? Divergence::kForwardKL : weight == 1.0 ? Divergence::kReverseKL : Divergence::kJSD;
}

double mixture_beta(Divergence kind, double weight) {
  switch (kind) {
    case Divergence::kForwardKL: return 0.0;
    case Divergence::kReverseKL: return 1.0;
    case Divergence::kSkewForwardKL: return weight;         // M = alpha q + (1 - alpha) p
    case Divergence::kSkewReverseKL: return 1.0 - weight;   // M = alpha p + (1 - alpha) q
    case Divergence::kTVD: return 0.0;                      // no mixture
    default: return weight;
  }
}

DistillParams divergence_options(const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                 c10::string_view divergence, double beta, double temperature) {
  TORCH_CHECK(std::isfinite(beta), "the divergence's weight (beta or alpha) must be a number, got ", beta);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0,
              "temperature must be a positive number, got ", temperature);
  DistillParams p;
  p.kind = parse_divergence(divergence, beta);
  p.beta = mixture_beta(p.kind, beta);
  p.inv_temperature = 1.0 / temperature;
  p.ce_weight = 0.0;
  p.softcap_s = p.softcap_t = 0.0;
  p.logit_scale_s = p.logit_scale_t = 1.0;
  p.ignore_index = ignore_index;
  p.hidden_s = p.hidden_t = 0;
  p.chunk_v = 0;
  p.has_labels = labels.has_value();
  p.entropy = false;
  return p;
}

double checked_logit_scale(double scale, const char* name) {
  TORCH_CHECK(std::isfinite(scale) && scale > 0.0, name, " must be a positive number, got ", scale);
  return scale;
}

void check_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& w, const char* name, const char* w_name) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), name, " must be [V] with one entry per row of ",
              w_name, " (", w.size(0), "), got ", bias->sizes());
  TORCH_CHECK(bias->scalar_type() == w.scalar_type(), name, " must have ", w_name, "'s dtype ", w.scalar_type(),
              ", got ", bias->scalar_type());
  TORCH_CHECK(bias->device() == w.device(), name, " must be on ", w_name, "'s device ", w.device(), ", got ",
              bias->device());
}

void check_floating_matrix(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be a 2-D tensor, got ", t.dim(), " dimensions");
  TORCH_CHECK(
      t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ||
          t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
      name, " must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
}

void check_labels(const c10::optional<at::Tensor>& labels, const at::Tensor& rows_of, const char* name) {
  if (!labels.has_value()) return;
  TORCH_CHECK(labels->scalar_type() == at::kLong, "labels must be int64, got ", labels->scalar_type());
  TORCH_CHECK(labels->dim() == 1 && labels->size(0) == rows_of.size(0), "labels must hold one entry per row of ",
              name, " (", rows_of.size(0), "), got ", labels->sizes());
  TORCH_CHECK(labels->device() == rows_of.device(), "labels must be on ", rows_of.device(), ", got ",
              labels->device());
}

}  // namespace nitrobrew
