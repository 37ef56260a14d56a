// Merge of vocabulary shards' top-K row parts (nitrobrew.distributed): ATen math on [N, K] tensors
// (divergence/topk_rows.h), one kernel for every device.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "../divergence/distill_params.h"
#include "../divergence/topk_rows.h"

namespace nitrobrew {
namespace {

std::tuple<at::Tensor, at::Tensor> topk_merge_shards_any(const at::Tensor& partials, const at::Tensor& teacher_logprobs,
                                                         const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                                         double temperature, bool renormalize,
                                                         c10::string_view divergence, double beta,
                                                         bool float64_logits) {
  TORCH_CHECK(partials.dim() == 3 && partials.size(0) >= 1 && partials.size(2) >= 3,
              "partials must be [R >= 1, N, 2 + K] as the shards' top-K parts, got ", partials.sizes());
  TORCH_CHECK(teacher_logprobs.dim() == 2 && teacher_logprobs.size(0) == partials.size(1) &&
                  teacher_logprobs.size(1) == partials.size(2) - 2,
              "teacher_logprobs must be [N, K] = [", partials.size(1), ", ", partials.size(2) - 2, "], got ",
              teacher_logprobs.sizes());
  TORCH_CHECK(teacher_logprobs.device() == partials.device(), "teacher_logprobs must be on ", partials.device());
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, "temperature must be a positive number, got ",
              temperature);
  check_labels(labels, partials.select(0, 0), "partials[0]");
  TopKParams p;
  p.renormalize = renormalize;
  set_topk_divergence(p, divergence, beta);
  p.inv_temperature = 1.0 / temperature;
  p.logit_scale = 1.0;
  p.ignore_index = ignore_index;
  p.num_rows = partials.size(1);
  p.vocab_size = 0;
  p.k = partials.size(2) - 2;
  p.hidden = 0;
  p.chunk_v = 0;
  const at::Tensor valid = labels.has_value() ? *labels != ignore_index
                                              : at::ones({p.num_rows}, partials.options().dtype(at::kBool));
  auto [loss, row_stats] =
      topk_merge_shards(partials, teacher_logprobs, valid, p, float64_logits ? at::kDouble : at::kFloat);
  return {loss.to(float64_logits ? at::kDouble : at::kFloat), row_stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CompositeExplicitAutograd, m) { m.impl("topk_merge_shards", &topk_merge_shards_any); }

}  // namespace nitrobrew
