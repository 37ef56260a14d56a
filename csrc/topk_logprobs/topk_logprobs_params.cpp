#include "topk_logprobs_params.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

#include "../divergence/distill_params.h"

namespace nitrobrew {

TopKLogprobsParams make_topk_logprobs_params(const at::Tensor& x, const at::Tensor& w, int64_t k,
                                             const c10::optional<at::Tensor>& bias, double temperature,
                                             c10::optional<double> softcap, double logit_scale, int64_t vocab_size,
                                             int64_t chunk_v) {
  check_floating_matrix(x, "x");
  check_floating_matrix(w, "w");
  TORCH_CHECK(w.size(1) == x.size(1), "w must be [V, D] with D = x.size(-1) = ", x.size(1), ", got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "x and w must share one dtype, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(w.device() == x.device(), "x and w must be on one device, got ", x.device(), " and ", w.device());
  TORCH_CHECK(vocab_size >= 1 && vocab_size <= w.size(0), "vocab_size must be in [1, w.size(0)] = [1, ", w.size(0),
              "], got ", vocab_size);
  TORCH_CHECK(k >= 1 && k <= std::min(vocab_size, kMaxTopKLogprobsK), "k must be in [1, min(vocab_size, ",
              kMaxTopKLogprobsK, ")] = [1, ", std::min(vocab_size, kMaxTopKLogprobsK), "], got ", k);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0.0, "temperature must be a positive number, got ",
              temperature);
  TORCH_CHECK(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0.0),
              "softcap must be a positive number or None, got ", *softcap);
  TORCH_CHECK(chunk_v >= 0, "chunk_v must be positive (or 0 for automatic), got ", chunk_v);
  check_bias(bias, w, "bias", "w");
  TopKLogprobsParams p;
  p.num_rows = x.size(0);
  p.hidden = x.size(1);
  p.vocab_size = vocab_size;
  p.k = k;
  p.inv_temperature = 1.0 / temperature;
  p.logit_scale = checked_logit_scale(logit_scale, "logit_scale");
  p.softcap = softcap.value_or(0.0);
  p.chunk_v = chunk_v;
  return p;
}

}  // namespace nitrobrew
