#include "topk_params.h"

#include "fused_linear_params.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace nitrobrew {

TopKParams make_topk_logit_params(const at::Tensor& zs, const at::Tensor& teacher_ids,
                                  const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels,
                                  int64_t ignore_index, double temperature, bool renormalize,
                                  bool check_ids_on_host) {
  TORCH_CHECK(zs.dim() == 2, "zs must be [N, V], got ", zs.sizes());
  TORCH_CHECK(zs.scalar_type() == at::kFloat || zs.scalar_type() == at::kDouble || zs.scalar_type() == at::kBFloat16 ||
                  zs.scalar_type() == at::kHalf,
              "zs must be float32, float64, bfloat16 or float16, got ", zs.scalar_type());
  TORCH_CHECK(teacher_ids.scalar_type() == at::kLong, "teacher_ids must be int64, got ", teacher_ids.scalar_type());
  TORCH_CHECK(at::isFloatingType(teacher_logprobs.scalar_type()), "teacher_logprobs must be floating point, got ",
              teacher_logprobs.scalar_type());
  TORCH_CHECK(teacher_ids.dim() == 2 && teacher_ids.size(0) == zs.size(0) && teacher_ids.sizes() == teacher_logprobs.sizes(),
              "teacher_ids and teacher_logprobs must both be [N, K] with N = ", zs.size(0), ", got ",
              teacher_ids.sizes(), " and ", teacher_logprobs.sizes());
  TORCH_CHECK(teacher_ids.size(1) >= 1 && teacher_ids.size(1) <= zs.size(1), "K must be in [1, V = ", zs.size(1),
              "], got ", teacher_ids.size(1));
  for (const at::Tensor* t : {&teacher_ids, &teacher_logprobs}) {
    TORCH_CHECK(t->device() == zs.device(), "zs, teacher_ids and teacher_logprobs must be on one device");
  }
  // The range check reads the ids on the host: fine for the CPU op; the CUDA op checks on the
  // device instead (check_ids_on_host = false), without synchronizing.
  if (check_ids_on_host && teacher_ids.numel() > 0) {
    const auto [lo, hi] = at::aminmax(teacher_ids);
    const int64_t min_id = lo.item<int64_t>(), max_id = hi.item<int64_t>();
    TORCH_CHECK(min_id >= 0 && max_id < zs.size(1), "teacher_ids must be in [0, V = ", zs.size(1), "), got ids from ",
                min_id, " to ", max_id);
  }
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, "temperature must be a positive number, got ",
              temperature);
  check_labels(labels, zs, "zs");
  TopKParams p;
  p.renormalize = renormalize;
  p.inv_temperature = 1.0 / temperature;
  p.ignore_index = ignore_index;
  p.num_rows = zs.size(0);
  p.vocab_size = zs.size(1);
  p.k = teacher_ids.size(1);
  return p;
}

}  // namespace nitrobrew
