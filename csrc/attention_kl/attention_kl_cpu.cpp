// CPU kernels of the attention-distribution KL (csrc/registration.cpp has the schemas).
//
// Per (batch, query head) the query rows are cut into tiles of kQueryTile and the keys into
// tiles of kKeyTile; each [query tile x key tile] block of student and teacher scores is
// computed with ATen's BLAS in the accumulation type, folded into per-row online KL states
// (online_state.h, the same state the fused-linear losses use), and dropped: nothing of size
// [N_q x N_k] is ever allocated. Under the causal mask, key tiles past a query tile's last
// visible key are skipped. The backward recomputes the blocks from the saved per-row
// statistics; it runs per (batch, student key head), so the gradient of each key head is
// accumulated by one thread over the query heads of its GQA group. The products are exact float32
// (or float64) even where the user allowed oneDNN's reduced-precision float32 matmuls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../divergence/row_stats.h"
#include "attention_kl_exact_matmul.h"
#include "attention_kl_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

constexpr int64_t kQueryTile = 64;
constexpr int64_t kKeyTile = 256;

// The [rows x keys] scores scale * q . k^T / temperature of one head; q, k in acc dtype.
at::Tensor score_tile(const at::Tensor& q, const at::Tensor& k, double scale) {
  return at::mm(q, k.t()).mul_(scale);
}

// One query tile of one head: the rows, the student and teacher query rows and key heads,
// and the keys any of its rows may see.
struct QueryTile {
  int64_t b, h, i0, i1, key_end;
};

template <typename acc_t>
struct AttentionInputs {
  at::Tensor qs, ks, qt, kt;  // acc dtype, [B, N, H, D]
  const bool* mask;           // [B, N_k] or nullptr

  AttentionInputs(const at::Tensor& q_s, const at::Tensor& k_s, const at::Tensor& q_t, const at::Tensor& k_t,
                  const c10::optional<at::Tensor>& key_mask, at::Tensor& mask_storage) {
    const auto acc = c10::CppTypeToScalarType<acc_t>::value;
    qs = q_s.to(acc);
    ks = k_s.to(acc);
    qt = q_t.to(acc);
    kt = k_t.to(acc);
    mask = nullptr;
    if (key_mask.has_value()) {
      mask_storage = key_mask->contiguous();
      mask = mask_storage.data_ptr<bool>();
    }
  }

  // Student and teacher score blocks of a query tile against keys [j0, j1).
  std::pair<at::Tensor, at::Tensor> scores(const AttentionKLParams& p, const QueryTile& t, int64_t j0,
                                           int64_t j1) const {
    const auto rows = [&](const at::Tensor& x, int64_t head, int64_t lo, int64_t hi) {
      return x.select(0, t.b).select(1, head).slice(0, lo, hi);
    };
    at::Tensor s = score_tile(rows(qs, t.h, t.i0, t.i1), rows(ks, p.key_head_s(t.h), j0, j1), p.scale_s * p.inv_temperature);
    at::Tensor u = score_tile(rows(qt, t.h, t.i0, t.i1), rows(kt, p.key_head_t(t.h), j0, j1), p.scale_t * p.inv_temperature);
    return {s.contiguous(), u.contiguous()};
  }

  bool visible(const AttentionKLParams& p, int64_t b, int64_t i, int64_t j) const {
    return j <= p.last_key(i) && (mask == nullptr || mask[b * p.n_keys + j]);
  }
};

// Key tiles a query tile [i0, i1) has to visit: all keys, or under the causal mask only up to
// the last key its last row sees.
int64_t key_end(const AttentionKLParams& p, int64_t i1) {
  return std::max<int64_t>(0, std::min(p.n_keys, p.last_key(i1 - 1) + 1));
}

template <typename acc_t>
void forward_impl(const AttentionKLParams& p, const AttentionInputs<acc_t>& in, at::Tensor& loss,
                  at::Tensor& row_stats) {
  const int64_t q_tiles = (p.n_queries + kQueryTile - 1) / kQueryTile;
  acc_t* loss_ptr = loss.data_ptr<acc_t>();
  acc_t* stats_ptr = row_stats.data_ptr<acc_t>();
  at::parallel_for(0, p.batch * p.heads * q_tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<KLState<acc_t>> states;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / (p.heads * q_tiles), h = (w / q_tiles) % p.heads, qt = w % q_tiles;
      const int64_t i0 = qt * kQueryTile, i1 = std::min(i0 + kQueryTile, p.n_queries);
      const QueryTile tile{b, h, i0, i1, key_end(p, i1)};
      states.assign(i1 - i0, KLState<acc_t>{});
      for (int64_t j0 = 0; j0 < tile.key_end; j0 += kKeyTile) {
        const int64_t j1 = std::min(j0 + kKeyTile, tile.key_end);
        const auto [s_tile, t_tile] = in.scores(p, tile, j0, j1);
        const acc_t* s_all = s_tile.template data_ptr<acc_t>();
        const acc_t* t_all = t_tile.template data_ptr<acc_t>();
        for (int64_t r = 0; r < i1 - i0; ++r) {
          const acc_t* s = s_all + r * (j1 - j0);
          const acc_t* t = t_all + r * (j1 - j0);
          // The weighting distribution w is the teacher's for forward KL, the student's for reverse.
          const acc_t* w = p.reverse ? s : t;
          const acc_t* o = p.reverse ? t : s;
          KLState<acc_t> part;
          for (int64_t j = j0; j < j1; ++j) {
            if (!in.visible(p, b, i0 + r, j)) continue;
            part.w.m = std::max(part.w.m, w[j - j0]);
            part.o.m = std::max(part.o.m, o[j - j0]);
          }
          if (part.w.m == kNegInf<acc_t>) continue;  // nothing visible here
          for (int64_t j = j0; j < j1; ++j) {
            if (!in.visible(p, b, i0 + r, j)) continue;
            const acc_t ew = exp_(w[j - j0] - part.w.m);
            part.w.l += ew;
            part.a += ew * (w[j - j0] - o[j - j0]);
            part.o.l += exp_(o[j - j0] - part.o.m);
          }
          merge(states[r], part);
        }
      }
      for (int64_t r = 0; r < i1 - i0; ++r) {
        const int64_t row = (b * p.heads + h) * p.n_queries + i0 + r;
        if (states[r].w.m == kNegInf<acc_t>) continue;  // no visible key: zeros
        loss_ptr[row] = store_kl_row(finish_kl_row(states[r], p.reverse), stats_ptr + row * kNumAttentionRowStats);
      }
    }
  });
}

template <typename acc_t>
void backward_impl(const AttentionKLParams& p, const AttentionInputs<acc_t>& in, const at::Tensor& grad_loss,
                   const at::Tensor& row_stats, at::Tensor& dq, at::Tensor& dk) {
  const int64_t group = p.heads / p.key_heads_s;
  const int64_t q_tiles = (p.n_queries + kQueryTile - 1) / kQueryTile;
  const acc_t* g_ptr = grad_loss.data_ptr<acc_t>();
  const acc_t* stats_ptr = row_stats.data_ptr<acc_t>();
  DivergenceParams<acc_t> div{};
  div.kind = p.reverse ? Divergence::kReverseKL : Divergence::kForwardKL;
  const acc_t ds_dscore = static_cast<acc_t>(p.scale_s * p.inv_temperature);
  at::parallel_for(0, p.batch * p.key_heads_s, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = w / p.key_heads_s, kh = w % p.key_heads_s;
      at::Tensor ks = in.ks.select(0, b).select(1, kh);  // [N_k, D_s]
      at::Tensor dk_head = dk.select(0, b).select(1, kh);
      for (int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        at::Tensor qs = in.qs.select(0, b).select(1, h);  // [N_q, D_s]
        at::Tensor dq_head = dq.select(0, b).select(1, h);
        for (int64_t qt = 0; qt < q_tiles; ++qt) {
          const int64_t i0 = qt * kQueryTile, i1 = std::min(i0 + kQueryTile, p.n_queries);
          const QueryTile tile{b, h, i0, i1, key_end(p, i1)};
          for (int64_t j0 = 0; j0 < tile.key_end; j0 += kKeyTile) {
            const int64_t j1 = std::min(j0 + kKeyTile, tile.key_end);
            const auto [s_tile, t_tile] = in.scores(p, tile, j0, j1);
            at::Tensor grad = at::zeros_like(s_tile);  // dLoss / dscore of the block
            acc_t* gs = grad.template data_ptr<acc_t>();
            const acc_t* s_all = s_tile.template data_ptr<acc_t>();
            const acc_t* t_all = t_tile.template data_ptr<acc_t>();
            for (int64_t r = 0; r < i1 - i0; ++r) {
              const int64_t row = (b * p.heads + h) * p.n_queries + i0 + r;
              const acc_t g = g_ptr[row];
              const acc_t* st = stats_ptr + row * kNumAttentionRowStats;
              const LogNormalizer<acc_t> norm_s{st[kMaxS], st[kLogSumS]}, norm_t{st[kMaxT], st[kLogSumT]};
              for (int64_t j = j0; j < j1; ++j) {
                if (!in.visible(p, b, i0 + r, j)) continue;
                const acc_t s = s_all[r * (j1 - j0) + j - j0], t = t_all[r * (j1 - j0) + j - j0];
                gs[r * (j1 - j0) + j - j0] =
                    g * ds_dscore *
                    divergence_grad(div, s, t, norm_s, norm_t, st[kGradCenter]);
              }
            }
            dq_head.slice(0, i0, i1).add_(at::mm(grad, ks.slice(0, j0, j1)));
            dk_head.slice(0, j0, j1).add_(at::mm(grad.t(), qs.slice(0, i0, i1)));
          }
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> attention_kl_fwd_cpu(const at::Tensor& q_s, const at::Tensor& k_s,
                                                        const at::Tensor& q_t, const at::Tensor& k_t,
                                                        const c10::optional<at::Tensor>& key_mask, c10::string_view divergence,
                                                        bool causal, double scale_s, double scale_t,
                                                        double temperature, bool /*deterministic: always*/) {
  const AttentionKLParams p =
      make_attention_kl_params(q_s, k_s, q_t, k_t, key_mask, divergence, causal, scale_s, scale_t, temperature);
  const auto acc = q_s.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor loss = at::zeros({p.batch, p.heads, p.n_queries}, q_s.options().dtype(acc));
  at::Tensor row_stats = at::zeros({p.batch, p.heads, p.n_queries, kNumAttentionRowStats}, q_s.options().dtype(acc));
  if (loss.numel() == 0 || p.n_keys == 0) return {loss, row_stats};
  const ExactFloat32Matmuls exact;
  at::Tensor mask_storage;
  AT_DISPATCH_FLOATING_TYPES(acc, "attention_kl_fwd_cpu", [&] {
    const AttentionInputs<scalar_t> in(q_s, k_s, q_t, k_t, key_mask, mask_storage);
    forward_impl<scalar_t>(p, in, loss, row_stats);
  });
  return {loss, row_stats};
}

std::tuple<at::Tensor, at::Tensor> attention_kl_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& q_s,
                                                        const at::Tensor& k_s, const at::Tensor& q_t,
                                                        const at::Tensor& k_t,
                                                        const c10::optional<at::Tensor>& key_mask,
                                                        const at::Tensor& row_stats, c10::string_view divergence, bool causal,
                                                        double scale_s, double scale_t, double temperature,
                                                        bool /*deterministic: always*/) {
  const AttentionKLParams p =
      make_attention_kl_params(q_s, k_s, q_t, k_t, key_mask, divergence, causal, scale_s, scale_t, temperature);
  check_attention_kl_backward_inputs(grad_loss, row_stats, p, q_s.device());
  const auto acc = q_s.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor dq = at::zeros(q_s.sizes(), q_s.options().dtype(acc));
  at::Tensor dk = at::zeros(k_s.sizes(), k_s.options().dtype(acc));
  if (grad_loss.numel() > 0 && p.n_keys > 0) {
    const ExactFloat32Matmuls exact;
    at::Tensor mask_storage;
    AT_DISPATCH_FLOATING_TYPES(acc, "attention_kl_bwd_cpu", [&] {
      const AttentionInputs<scalar_t> in(q_s, k_s, q_t, k_t, key_mask, mask_storage);
      backward_impl<scalar_t>(p, in, grad_loss.to(acc).contiguous(), row_stats.to(acc).contiguous(), dq, dk);
    });
  }
  return {dq.to(q_s.scalar_type()), dk.to(k_s.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) {
  m.impl("attention_kl_fwd", &attention_kl_fwd_cpu);
  m.impl("attention_kl_bwd", &attention_kl_bwd_cpu);
}

}  // namespace cpu
}  // namespace nitrobrew
