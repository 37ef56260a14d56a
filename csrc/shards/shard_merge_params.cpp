#include "shard_merge_params.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "../divergence/row_partial.h"

namespace nitrobrew {

DistillParams make_merge_params(const at::Tensor& partials, const c10::optional<at::Tensor>& mixture,
                                const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                c10::string_view divergence, double beta, double ce_weight, int64_t vocab_size) {
  TORCH_CHECK(partials.dim() == 3 && partials.size(0) >= 1 && partials.size(2) == kNumPartialFields,
              "partials must be [R >= 1, N, ", int(kNumPartialFields), "] as the shard forwards return them, got ",
              partials.sizes());
  TORCH_CHECK(partials.scalar_type() == at::kFloat || partials.scalar_type() == at::kDouble,
              "partials must be float32 or float64, got ", partials.scalar_type());
  if (mixture.has_value()) {
    TORCH_CHECK(mixture->dim() == 3 && mixture->size(0) == partials.size(0) && mixture->size(1) == partials.size(1) &&
                    mixture->size(2) == 2,
                "mixture must be [R, N, 2] = [", partials.size(0), ", ", partials.size(1), ", 2], got ",
                mixture->sizes());
    TORCH_CHECK(mixture->scalar_type() == at::kDouble, "mixture must be float64, got ", mixture->scalar_type());
    TORCH_CHECK(mixture->device() == partials.device(), "mixture must be on ", partials.device());
  }
  TORCH_CHECK(std::isfinite(ce_weight) && ce_weight >= 0.0, "ce_weight must be a non-negative number, got ",
              ce_weight);
  TORCH_CHECK(ce_weight == 0.0 || labels.has_value(), "ce_weight > 0 needs labels");
  TORCH_CHECK(vocab_size >= 1, "vocab_size must be positive, got ", vocab_size);
  const at::Tensor rows = partials.select(0, 0);
  check_labels(labels, rows, "partials[0]");
  DistillParams p = divergence_options(labels, ignore_index, divergence, beta, /*temperature=*/1.0);
  p.ce_weight = ce_weight;
  p.num_rows = partials.size(1);
  p.vocab_size = vocab_size;
  return p;
}

}  // namespace nitrobrew
