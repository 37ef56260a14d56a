// Options of the attention-KL ops, validated once and handed to the device kernels as a
// plain struct. Layout [B, N, H, D] (as FlashAttention); student and teacher have their
// own head dims and key-head counts (GQA: query heads a multiple of key heads).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "../divergence/online_state.h"

namespace nitrobrew {

// Columns of the attention forward's per-row statistics: the RowStat columns kMaxS ..
// kGradCenter of row_stats.h (store_kl_row writes them).
constexpr int kNumAttentionRowStats = 5;

struct AttentionKLParams {
  bool reverse;  // KL(student || teacher) instead of KL(teacher || student)
  bool causal;   // bottom-right aligned: query i sees keys j <= i + n_keys - n_queries
  double scale_s, scale_t;  // score scales; scores are scale * q.k / temperature
  double inv_temperature;
  int64_t batch, n_queries, n_keys, heads, key_heads_s, key_heads_t, dim_s, dim_t;

  // The last key query row i may see (inclusive), before the key mask.
  int64_t last_key(int64_t i) const { return causal ? i + n_keys - n_queries : n_keys - 1; }
  int64_t key_head_s(int64_t h) const { return h / (heads / key_heads_s); }
  int64_t key_head_t(int64_t h) const { return h / (heads / key_heads_t); }
};

// Checks shapes, dtypes and devices of the op's inputs (raising with the argument's name).
AttentionKLParams make_attention_kl_params(const at::Tensor& q_s, const at::Tensor& k_s, const at::Tensor& q_t,
                                           const at::Tensor& k_t, const c10::optional<at::Tensor>& key_mask,
                                           c10::string_view divergence, bool causal, double scale_s, double scale_t,
                                           double temperature);

// The backward's grad_loss [B, H, N_q] and the forward's row_stats [B, H, N_q, 5], on the inputs' device.
void check_attention_kl_backward_inputs(const at::Tensor& grad_loss, const at::Tensor& row_stats,
                                        const AttentionKLParams& p, const at::Device& device);

}  // namespace nitrobrew
