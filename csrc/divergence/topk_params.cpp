#include "topk_params.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "distill_params.h"

namespace nitrobrew {

TopKParams topk_teacher_params(const at::Tensor& rows_of, const char* name, int64_t vocab,
                               const at::Tensor& teacher_ids, const at::Tensor& teacher_logprobs,
                               const c10::optional<at::Tensor>& labels, int64_t ignore_index, double temperature,
                               bool renormalize, c10::string_view divergence, double weight,
                               bool check_ids_on_host) {
  TORCH_CHECK(teacher_ids.scalar_type() == at::kLong, "teacher_ids must be int64, got ", teacher_ids.scalar_type());
  TORCH_CHECK(at::isFloatingType(teacher_logprobs.scalar_type()), "teacher_logprobs must be floating point, got ",
              teacher_logprobs.scalar_type());
  TORCH_CHECK(teacher_ids.dim() == 2 && teacher_ids.size(0) == rows_of.size(0) &&
                  teacher_ids.sizes() == teacher_logprobs.sizes(),
              "teacher_ids and teacher_logprobs must both be [N, K] with N = ", rows_of.size(0), ", got ",
              teacher_ids.sizes(), " and ", teacher_logprobs.sizes());
  // K > V is legal (ids repeat), and a vocabulary shard may hold fewer rows than K (nitrobrew.distributed).
  TORCH_CHECK(teacher_ids.size(1) >= 1, "K must be at least 1, got ", teacher_ids.size(1));
  for (const at::Tensor* t : {&teacher_ids, &teacher_logprobs}) {
    TORCH_CHECK(t->device() == rows_of.device(), name, ", teacher_ids and teacher_logprobs must be on one device");
  }
  if (check_ids_on_host && teacher_ids.numel() > 0) {
    const auto [lo, hi] = at::aminmax(teacher_ids);
    const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
    TORCH_CHECK(min_id >= 0 && max_id < vocab, "teacher_ids must be in [0, V = ", vocab, "), got ids from ", min_id,
                " to ", max_id);
  }
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, "temperature must be a positive number, got ",
              temperature);
  check_labels(labels, rows_of, name);
  TopKParams p;
  p.renormalize = renormalize;
  set_topk_divergence(p, divergence, weight);
  p.inv_temperature = 1.0 / temperature;
  p.logit_scale = 1.0;
  p.ignore_index = ignore_index;
  p.num_rows = rows_of.size(0);
  p.vocab_size = vocab;
  p.k = teacher_ids.size(1);
  p.hidden = 0;
  p.chunk_v = 0;
  return p;
}

void set_topk_divergence(TopKParams& p, c10::string_view divergence, double weight) {
  TORCH_CHECK(std::isfinite(weight), "the divergence's weight (beta or alpha) must be a number, got ", weight);
  p.kind = parse_divergence(divergence, weight);
  p.weight = weight;
  // Without renormalizing, the student's side is the whole vocabulary and the teacher's only K ids: the
  // divergences other than forward KL need the teacher's tail (its mass where the student has some).
  TORCH_CHECK_VALUE(p.renormalize || p.kind == Divergence::kForwardKL, "normalize='full' takes forward_kl only, got '",
                    divergence, "': the other divergences need the teacher's whole distribution; use "
                    "normalize='topk'");
}

const char* divergence_name(Divergence kind) {
  switch (kind) {
    case Divergence::kForwardKL: return "forward_kl";
    case Divergence::kReverseKL: return "reverse_kl";
    case Divergence::kJSD: return "jsd";
    case Divergence::kSkewForwardKL: return "skew_forward_kl";
    case Divergence::kSkewReverseKL: return "skew_reverse_kl";
    default: return "tvd";
  }
}

GuardedTopK guard_topk_ids(const at::Tensor& teacher_ids, const at::Tensor& teacher_logprobs, int64_t vocab) {
  const at::Tensor outside = (teacher_ids < 0).logical_or_(teacher_ids >= vocab);
  return {teacher_ids.masked_fill(outside, 0),
          teacher_logprobs.masked_fill(outside, std::numeric_limits<double>::quiet_NaN())};
}

void check_topk_backward_inputs(const at::Tensor& grad_loss, const at::Tensor& row_stats, int64_t columns,
                                const TopKParams& p, const at::Device& device) {
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == p.num_rows, "grad_loss must be [N] = [", p.num_rows,
              "], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == p.num_rows && row_stats.size(1) == columns,
              "row_stats must be [N, ", columns, "] as the forward returns it, got ", row_stats.sizes());
  TORCH_CHECK(grad_loss.device() == device && row_stats.device() == device, "grad_loss and row_stats must be on ",
              device);
}

}  // namespace nitrobrew
