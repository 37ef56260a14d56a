#include "attention_kl_params.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace nitrobrew {

AttentionKLParams make_attention_kl_params(const at::Tensor& q_s, const at::Tensor& k_s, const at::Tensor& q_t,
                                           const at::Tensor& k_t, const c10::optional<at::Tensor>& key_mask,
                                           c10::string_view divergence, bool causal, double scale_s, double scale_t,
                                           double temperature) {
  const char* names[4] = {"q_s", "k_s", "q_t", "k_t"};
  const at::Tensor* ts[4] = {&q_s, &k_s, &q_t, &k_t};
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(ts[i]->dim() == 4, "attention_kl: ", names[i], " must be [B, N, H, D], got shape ", ts[i]->sizes());
    TORCH_CHECK(ts[i]->scalar_type() == q_s.scalar_type(), "attention_kl: ", names[i], " has dtype ",
                ts[i]->scalar_type(), ", q_s has ", q_s.scalar_type(), "; all four must match");
    TORCH_CHECK(ts[i]->device() == q_s.device(), "attention_kl: ", names[i], " is on ", ts[i]->device(),
                ", q_s on ", q_s.device());
  }
  TORCH_CHECK(at::isFloatingType(q_s.scalar_type()), "attention_kl: inputs must be floating point, got ",
              q_s.scalar_type());
  AttentionKLParams p;
  TORCH_CHECK(divergence == "forward_kl" || divergence == "reverse_kl",
              "attention_kl: divergence must be 'forward_kl' or 'reverse_kl', got '", divergence, "'");
  p.reverse = divergence == "reverse_kl";
  p.causal = causal;
  p.batch = q_s.size(0);
  p.n_queries = q_s.size(1);
  p.heads = q_s.size(2);
  p.dim_s = q_s.size(3);
  p.n_keys = k_s.size(1);
  p.key_heads_s = k_s.size(2);
  p.key_heads_t = k_t.size(2);
  p.dim_t = q_t.size(3);
  TORCH_CHECK(k_s.size(0) == p.batch && q_t.size(0) == p.batch && k_t.size(0) == p.batch,
              "attention_kl: q_s, k_s, q_t, k_t must have the same batch size");
  TORCH_CHECK(q_t.size(1) == p.n_queries && q_t.size(2) == p.heads,
              "attention_kl: q_t must be [B, N_q, H, D_t] with q_s's B, N_q and H = ", p.heads, ", got ", q_t.sizes());
  TORCH_CHECK(k_t.size(1) == p.n_keys, "attention_kl: k_s and k_t must have the same number of keys, got ",
              p.n_keys, " and ", k_t.size(1));
  TORCH_CHECK(k_s.size(3) == p.dim_s, "attention_kl: k_s's head dim ", k_s.size(3), " differs from q_s's ", p.dim_s);
  TORCH_CHECK(k_t.size(3) == p.dim_t, "attention_kl: k_t's head dim ", k_t.size(3), " differs from q_t's ", p.dim_t);
  TORCH_CHECK(p.key_heads_s > 0 && p.heads % p.key_heads_s == 0, "attention_kl: the student's query heads (",
              p.heads, ") must be a multiple of its key heads (", p.key_heads_s, ")");
  TORCH_CHECK(p.key_heads_t > 0 && p.heads % p.key_heads_t == 0, "attention_kl: the teacher's query heads (",
              p.heads, ") must be a multiple of its key heads (", p.key_heads_t, ")");
  if (key_mask.has_value()) {
    TORCH_CHECK(key_mask->scalar_type() == at::kBool, "attention_kl: attention_mask must be bool, got ",
                key_mask->scalar_type());
    TORCH_CHECK(key_mask->dim() == 2 && key_mask->size(0) == p.batch && key_mask->size(1) == p.n_keys,
                "attention_kl: attention_mask must be [B, N_k] = [", p.batch, ", ", p.n_keys, "], got ",
                key_mask->sizes());
    TORCH_CHECK(key_mask->device() == q_s.device(), "attention_kl: attention_mask is on ", key_mask->device(),
                ", the inputs on ", q_s.device());
  }
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0, "attention_kl: temperature must be positive, got ",
              temperature);
  TORCH_CHECK(std::isfinite(scale_s) && std::isfinite(scale_t), "attention_kl: scales must be finite");
  p.scale_s = scale_s;
  p.scale_t = scale_t;
  p.inv_temperature = 1.0 / temperature;
  return p;
}

void check_attention_kl_backward_inputs(const at::Tensor& grad_loss, const at::Tensor& row_stats,
                                        const AttentionKLParams& p, const at::Device& device) {
  TORCH_CHECK(grad_loss.dim() == 3 && grad_loss.size(0) == p.batch && grad_loss.size(1) == p.heads &&
                  grad_loss.size(2) == p.n_queries,
              "attention_kl: grad_loss must be [B, H, N_q], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats.dim() == 4 && row_stats.size(0) == p.batch && row_stats.size(1) == p.heads &&
                  row_stats.size(2) == p.n_queries && row_stats.size(3) == kNumAttentionRowStats,
              "attention_kl: row_stats must be [B, H, N_q, 5] as the forward returns it, got ", row_stats.sizes());
  TORCH_CHECK(grad_loss.device() == device && row_stats.device() == device,
              "attention_kl: grad_loss and row_stats must be on the inputs' device");
}

}  // namespace nitrobrew
