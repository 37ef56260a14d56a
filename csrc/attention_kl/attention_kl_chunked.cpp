// The attention-KL ops in plain ATen, block by block (attention_kl_chunked.h), and their
// test-only entry points.
#include "attention_kl_chunked.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <utility>

#include "../divergence/row_stats.h"
#include "attention_kl_exact_matmul.h"

namespace nitrobrew {
namespace chunked {
namespace {

// A block: batches [b0, b0 + batches) x query rows [i0, i0 + rows), against keys [0, keys).
struct Block {
  int64_t b0, batches, i0, rows, keys;
};

// How many rows (and, where a batch's rows all fit, batches) a block takes: one model's scores
// of a block, [batches, H, rows, N_k], stay within `budget` bytes, or a block is one row.
struct BlockShape {
  int64_t batches, rows;
};

BlockShape block_shape(const AttentionKLParams& p, int64_t element_size, int64_t budget) {
  const int64_t row_bytes = std::max<int64_t>(1, p.heads * p.n_keys * element_size);
  const int64_t rows = budget / row_bytes;
  if (rows < p.n_queries) return {1, std::max<int64_t>(1, rows)};
  return {std::clamp<int64_t>(rows / std::max<int64_t>(1, p.n_queries), 1, p.batch), p.n_queries};
}

// Calls f(block) for every block in which some row may see a key.
template <typename F>
void for_each_block(const AttentionKLParams& p, const BlockShape& shape, F f) {
  for (int64_t b0 = 0; b0 < p.batch; b0 += shape.batches) {
    for (int64_t i0 = 0; i0 < p.n_queries; i0 += shape.rows) {
      const int64_t rows = std::min(shape.rows, p.n_queries - i0);
      // Under the causal mask no row of the block sees past its last row's last key.
      const int64_t keys = std::clamp<int64_t>(p.last_key(i0 + rows - 1) + 1, 0, p.n_keys);
      if (keys == 0) continue;  // no row sees a key: loss, statistics and gradients stay 0
      f(Block{b0, std::min(shape.batches, p.batch - b0), i0, rows, keys});
    }
  }
}

// One model's side of the products: its queries as given, [B, N_q, H, D], and its keys as
// [B, H_k, N_k, D] (a copy, unless they are a [B, H_k, N_k, D] tensor viewed as [B, N_k, H_k, D]).
struct Model {
  at::Tensor q, keys;
  int64_t key_heads, group;  // group: query heads per key head
  double c;                  // score = c * q.k

  Model(const at::Tensor& q_in, const at::Tensor& k_in, double scale, const AttentionKLParams& p,
        at::ScalarType dtype)
      : q(q_in.to(dtype)),
        keys(k_in.to(dtype).transpose(1, 2).contiguous()),
        key_heads(k_in.size(2)),
        group(p.heads / k_in.size(2)),
        c(scale * p.inv_temperature) {}

  // The block's queries grouped by key head (query head h = key head * group + g):
  // [batches * H_k, group * rows, D]. A copy of the block's rows.
  at::Tensor queries(const Block& b) const {
    return q.narrow(0, b.b0, b.batches)
        .narrow(1, b.i0, b.rows)
        .transpose(1, 2)
        .reshape({b.batches * key_heads, group * b.rows, q.size(3)});
  }

  // The block's keys, [batches * H_k, keys, D] (a view).
  at::Tensor key_rows(const Block& b) const {
    return keys.narrow(0, b.b0, b.batches).narrow(2, 0, b.keys).view({b.batches * key_heads, b.keys, keys.size(3)});
  }

  // The block's scores c * q.k, [batches, H, rows, keys].
  at::Tensor scores(const Block& b) const {
    return at::bmm(queries(b), key_rows(b).transpose(1, 2)).mul_(c).view({b.batches, -1, b.rows, b.keys});
  }
};

// The keys each row of the block sees, [batches or 1, 1, rows, keys] bool, or an undefined tensor
// when every row sees every key of the block.
at::Tensor visible_keys(const AttentionKLParams& p, const at::Tensor& key_mask, const Block& b,
                        const at::Device& device) {
  at::Tensor visible;
  if (p.causal && p.last_key(b.i0) < b.keys - 1) {  // the block's first row sees fewer keys than its last
    const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
    const at::Tensor last = at::arange(b.i0, b.i0 + b.rows, longs).add_(p.n_keys - p.n_queries);
    visible = at::arange(b.keys, longs).view({1, b.keys}).le(last.view({b.rows, 1})).view({1, 1, b.rows, b.keys});
  }
  if (key_mask.defined()) {
    const at::Tensor attended = key_mask.narrow(0, b.b0, b.batches).narrow(1, 0, b.keys).unsqueeze(1).unsqueeze(1);
    visible = visible.defined() ? visible.logical_and(attended) : attended;
  }
  return visible;
}

// Each row's (max, sum of exp(x - max)) over its keys, [..., 1] each, with x overwritten by
// exp(x - max). A row that sees no key (all -inf) gets max 0 and sum 0.
std::pair<at::Tensor, at::Tensor> exp_in_place(at::Tensor& x) {
  at::Tensor max = x.amax(-1, /*keepdim=*/true);
  max.masked_fill_(max.eq(-std::numeric_limits<double>::infinity()), 0);
  x.sub_(max).exp_();
  return {max, x.sum(-1, /*keepdim=*/true)};
}

// One block of the forward: writes its rows' losses and statistics.
void forward_block(const AttentionKLParams& p, const Model& student, const Model& teacher, const at::Tensor& key_mask,
                   const Block& b, at::Tensor& loss, at::Tensor& row_stats) {
  at::Tensor s = student.scores(b), t = teacher.scores(b);
  at::Tensor& w = p.reverse ? s : t;  // the distribution that weights the KL
  at::Tensor& o = p.reverse ? t : s;
  at::Tensor diff = w - o;
  const at::Tensor visible = visible_keys(p, key_mask, b, s.device());
  if (visible.defined()) {
    const at::Tensor hidden = visible.logical_not();
    diff.masked_fill_(hidden, 0);  // hidden keys add nothing, whatever their scores
    w.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
    o.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  }
  const auto [max_w, sum_w] = exp_in_place(w);
  const at::Tensor a = diff.mul_(w).sum(-1, /*keepdim=*/true);  // sum_j e^(w_j - max_w) (w_j - o_j)
  const auto [max_o, sum_o] = exp_in_place(o);
  // As online_state.h's finish_kl_row: KL(w || o) = a / l_w - (m_w - m_o) - (log l_w - log l_o),
  // the large terms of the two log-normalizers cancelled first; E_w[w - o] is the gradient's centre.
  const at::Tensor center = a / sum_w;
  const at::Tensor log_sum_w = sum_w.log(), log_sum_o = sum_o.log();
  at::Tensor kl = center - (max_w - max_o) - (log_sum_w - log_sum_o);
  at::Tensor stats = p.reverse ? at::cat({max_w, log_sum_w, max_o, log_sum_o, center}, -1)
                               : at::cat({max_o, log_sum_o, max_w, log_sum_w, center}, -1);
  if (visible.defined()) {  // rows that see no key: zeros (their sums are 0, so the above is nan)
    const at::Tensor sees = visible.any(-1, /*keepdim=*/true);
    kl = at::where(sees, kl, at::zeros({}, kl.options()));
    stats = at::where(sees, stats, at::zeros({}, stats.options()));
  }
  loss.narrow(0, b.b0, b.batches).narrow(2, b.i0, b.rows).copy_(kl.squeeze(-1));
  row_stats.narrow(0, b.b0, b.batches).narrow(2, b.i0, b.rows).copy_(stats);
}

// exp(log p) with log p = (x - max) - log_sum (two subtractions: rounding max + log_sum first would
// cost up to an ulp of the lse), in place.
at::Tensor& probabilities_in_place(at::Tensor& x, const at::Tensor& max, const at::Tensor& log_sum) {
  return x.sub_(max).sub_(log_sum).exp_();
}

// One block of the backward: writes its rows of dq and adds its share of dk (float accumulator
// [B, H_ks, N_k, D_s]).
void backward_block(const AttentionKLParams& p, const Model& student, const Model& teacher,
                    const at::Tensor& key_mask, const at::Tensor& grad_loss, const at::Tensor& row_stats,
                    const Block& b, at::Tensor& dq, at::Tensor& dk_acc) {
  at::Tensor s = student.scores(b), t = teacher.scores(b);
  const at::Tensor stats = row_stats.narrow(0, b.b0, b.batches).narrow(2, b.i0, b.rows);
  const auto column = [&](int c) { return stats.narrow(-1, c, 1); };  // [batches, H, rows, 1]
  // dLoss/ds (docs/design.md section 5): p - q for forward KL, p ((s - t) - E_p[s - t]) for reverse.
  at::Tensor ds;
  if (p.reverse) {
    ds = s - t;
    ds.sub_(column(kGradCenter)).mul_(probabilities_in_place(s, column(kMaxS), column(kLogSumS)));
  } else {
    ds = probabilities_in_place(s, column(kMaxS), column(kLogSumS))
             .sub_(probabilities_in_place(t, column(kMaxT), column(kLogSumT)));
  }
  const at::Tensor visible = visible_keys(p, key_mask, b, s.device());
  if (visible.defined()) ds.masked_fill_(visible.logical_not(), 0);  // also any inf or nan computed there
  const at::Tensor grad = grad_loss.narrow(0, b.b0, b.batches).narrow(2, b.i0, b.rows).unsqueeze(-1);
  ds.mul_(grad * (p.scale_s * p.inv_temperature));  // dS = g * c_s * dLoss/ds
  // dq = dS . K_s, and dk += dS^T . Q_s summed over each key head's query heads (GQA).
  const at::Tensor ds_grouped = ds.view({b.batches * student.key_heads, student.group * b.rows, b.keys});
  const int64_t d = student.q.size(3);
  dq.narrow(0, b.b0, b.batches)
      .narrow(1, b.i0, b.rows)
      .copy_(at::bmm(ds_grouped, student.key_rows(b)).view({b.batches, p.heads, b.rows, d}).transpose(1, 2));
  dk_acc.narrow(0, b.b0, b.batches)
      .narrow(2, 0, b.keys)
      .view({b.batches * student.key_heads, b.keys, d})
      .baddbmm_(ds_grouped.transpose(1, 2), student.queries(b));
}

at::ScalarType compute_dtype(const at::Tensor& q_s) {
  TORCH_CHECK(q_s.scalar_type() == at::kFloat || q_s.scalar_type() == at::kDouble,
              "attention_kl: the chunked path takes float32 or float64 inputs, got ", q_s.scalar_type());
  return q_s.scalar_type();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_kl_forward(const AttentionKLParams& p, const at::Tensor& q_s,
                                                        const at::Tensor& k_s, const at::Tensor& q_t,
                                                        const at::Tensor& k_t,
                                                        const c10::optional<at::Tensor>& key_mask,
                                                        int64_t score_block_bytes) {
  const at::ScalarType dtype = compute_dtype(q_s);
  at::Tensor loss = at::zeros({p.batch, p.heads, p.n_queries}, q_s.options().dtype(dtype));
  at::Tensor row_stats = at::zeros({p.batch, p.heads, p.n_queries, kNumAttentionRowStats}, loss.options());
  if (loss.numel() == 0 || p.n_keys == 0) return {loss, row_stats};
  const ExactFloat32Matmuls exact;
  const Model student(q_s, k_s, p.scale_s, p, dtype), teacher(q_t, k_t, p.scale_t, p, dtype);
  const at::Tensor mask = key_mask.has_value() ? *key_mask : at::Tensor();
  for_each_block(p, block_shape(p, loss.element_size(), score_block_bytes), [&](const Block& b) {
    forward_block(p, student, teacher, mask, b, loss, row_stats);
  });
  return {loss, row_stats};
}

std::tuple<at::Tensor, at::Tensor> attention_kl_backward(const AttentionKLParams& p, const at::Tensor& grad_loss,
                                                         const at::Tensor& q_s, const at::Tensor& k_s,
                                                         const at::Tensor& q_t, const at::Tensor& k_t,
                                                         const c10::optional<at::Tensor>& key_mask,
                                                         const at::Tensor& row_stats, int64_t score_block_bytes) {
  const at::ScalarType dtype = compute_dtype(q_s);
  check_attention_kl_backward_inputs(grad_loss, row_stats, p, q_s.device());
  at::Tensor dq = at::zeros(q_s.sizes(), q_s.options().dtype(dtype));
  at::Tensor dk_acc = at::zeros({p.batch, p.key_heads_s, p.n_keys, p.dim_s}, dq.options());
  if (grad_loss.numel() > 0 && p.n_keys > 0) {
    const ExactFloat32Matmuls exact;
    const Model student(q_s, k_s, p.scale_s, p, dtype), teacher(q_t, k_t, p.scale_t, p, dtype);
    const at::Tensor mask = key_mask.has_value() ? *key_mask : at::Tensor();
    const at::Tensor grad = grad_loss.to(dtype), stats = row_stats.to(dtype);
    for_each_block(p, block_shape(p, dq.element_size(), score_block_bytes), [&](const Block& b) {
      backward_block(p, student, teacher, mask, grad, stats, b, dq, dk_acc);
    });
  }
  return {dq.to(q_s.scalar_type()), dk_acc.transpose(1, 2).contiguous().to(k_s.scalar_type())};
}

namespace {

// Test-only entry points (tests/attention_kl/test_attention_kl_chunked.py): the chunked path on any
// device, with its block budget as an argument so that small problems take several blocks.
std::tuple<at::Tensor, at::Tensor> chunked_fwd_op(const at::Tensor& q_s, const at::Tensor& k_s, const at::Tensor& q_t,
                                                  const at::Tensor& k_t, const c10::optional<at::Tensor>& key_mask,
                                                  c10::string_view divergence, bool causal, double scale_s,
                                                  double scale_t, double temperature, int64_t score_block_bytes) {
  const AttentionKLParams p =
      make_attention_kl_params(q_s, k_s, q_t, k_t, key_mask, divergence, causal, scale_s, scale_t, temperature);
  TORCH_CHECK(score_block_bytes > 0, "attention_kl: score_block_bytes must be positive");
  const c10::OptionalDeviceGuard guard(q_s.device());
  return attention_kl_forward(p, q_s, k_s, q_t, k_t, key_mask, score_block_bytes);
}

std::tuple<at::Tensor, at::Tensor> chunked_bwd_op(const at::Tensor& grad_loss, const at::Tensor& q_s,
                                                  const at::Tensor& k_s, const at::Tensor& q_t, const at::Tensor& k_t,
                                                  const c10::optional<at::Tensor>& key_mask,
                                                  const at::Tensor& row_stats, c10::string_view divergence,
                                                  bool causal, double scale_s, double scale_t, double temperature,
                                                  int64_t score_block_bytes) {
  const AttentionKLParams p =
      make_attention_kl_params(q_s, k_s, q_t, k_t, key_mask, divergence, causal, scale_s, scale_t, temperature);
  TORCH_CHECK(score_block_bytes > 0, "attention_kl: score_block_bytes must be positive");
  const c10::OptionalDeviceGuard guard(q_s.device());
  return attention_kl_backward(p, grad_loss, q_s, k_s, q_t, k_t, key_mask, row_stats, score_block_bytes);
}

}  // namespace

// Not part of the public operators (csrc/registration.cpp): schemas and kernels of a test hook,
// defined next to what they expose.
TORCH_LIBRARY_FRAGMENT(nitrobrew, m) {
  m.def(
      "_attention_kl_chunked_fwd(Tensor q_s, Tensor k_s, Tensor q_t, Tensor k_t, Tensor? key_mask, str divergence, "
      "bool causal, float scale_s, float scale_t, float temperature, int score_block_bytes) -> (Tensor, Tensor)");
  m.def(
      "_attention_kl_chunked_bwd(Tensor grad_loss, Tensor q_s, Tensor k_s, Tensor q_t, Tensor k_t, "
      "Tensor? key_mask, Tensor row_stats, str divergence, bool causal, float scale_s, float scale_t, "
      "float temperature, int score_block_bytes) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nitrobrew, CompositeExplicitAutograd, m) {
  m.impl("_attention_kl_chunked_fwd", &chunked_fwd_op);
  m.impl("_attention_kl_chunked_bwd", &chunked_bwd_op);
}

}  // namespace chunked
}  // namespace nitrobrew
