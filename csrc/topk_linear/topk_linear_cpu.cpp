// CPU implementation of the top-K teacher ops from hidden states (nitrobrew.topk_kl): the same
// algorithm as the CUDA ops. For normalize="full" the student's log-normalizer over the vocabulary
// is an online log-sum-exp over vocabulary chunks of xs . ws^T, and the K student logits are picked
// from those chunks; for "topk" they are dot products of xs[n] with the K gathered rows of ws. The
// rest is the per-row math of rows.h.
// The backward of "full" walks the same chunks: dLoss/dz of a chunk (the dense part, then the K
// ids' sparse terms added) and its products with ws and xs; "topk" has only the K ids' terms, so
// dxs gathers K rows of ws per token and dws sums xs rows per id. Memory beyond the inputs: one
// [N x chunk] block of logits (at most kMaxChunkElements), never [N x V]. Accumulation: float32
// (float64 for float64).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>
#include <tuple>

#include "../engine/cpu/tile_walk.h"
#include "topk_linear_params.h"
#include "../divergence/topk_rows.h"

namespace nitrobrew {
namespace cpu {
namespace {

constexpr int64_t kMaxChunkElements = int64_t(1) << 22;  // 16 MiB of float32 logits per chunk

int64_t chunk_width(const TopKParams& p) {
  if (p.chunk_v > 0) return std::min(p.chunk_v, p.vocab_size);
  return std::max<int64_t>(1, std::min(p.vocab_size, kMaxChunkElements / std::max<int64_t>(p.num_rows, 1)));
}

// The rows of ws at its strides: the gathers read a non-contiguous ws in place instead of copying
// the whole [V x D] matrix for the K rows per token they need.
template <typename scalar_t>
struct WsRows {
  const scalar_t* base;
  int64_t row_stride, col_stride;
  explicit WsRows(const at::Tensor& ws)
      : base(ws.data_ptr<scalar_t>()), row_stride(ws.stride(0)), col_stride(ws.stride(1)) {}

  template <typename acc_t>
  acc_t dot(int64_t v, const acc_t* x, int64_t d) const {  // ws[v] . x
    const scalar_t* w = base + v * row_stride;
    acc_t sum = 0;
    if (col_stride == 1) {
      for (int64_t j = 0; j < d; ++j) sum += x[j] * static_cast<acc_t>(w[j]);
    } else {
      for (int64_t j = 0; j < d; ++j) sum += x[j] * static_cast<acc_t>(w[j * col_stride]);
    }
    return sum;
  }

  template <typename acc_t>
  void add_scaled(int64_t v, acc_t c, acc_t* out, int64_t d) const {  // out += c * ws[v]
    const scalar_t* w = base + v * row_stride;
    if (col_stride == 1) {
      for (int64_t j = 0; j < d; ++j) out[j] += c * static_cast<acc_t>(w[j]);
    } else {
      for (int64_t j = 0; j < d; ++j) out[j] += c * static_cast<acc_t>(w[j * col_stride]);
    }
  }
};

// z[n, k] = xs[n] . ws[ids[n, k]] in acc_t.
template <typename scalar_t, typename acc_t>
at::Tensor gather_logits(const at::Tensor& xs_acc, const at::Tensor& ws, const at::Tensor& ids, const TopKParams& p) {
  const at::Tensor ids_c = ids.contiguous();
  at::Tensor z = at::empty({p.num_rows, p.k}, xs_acc.options());
  const acc_t* x = xs_acc.data_ptr<acc_t>();
  const WsRows<scalar_t> w(ws);
  const int64_t* id = ids_c.data_ptr<int64_t>();
  acc_t* out = z.data_ptr<acc_t>();
  at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t k = 0; k < p.k; ++k) out[n * p.k + k] = w.dot(id[n * p.k + k], x + n * p.hidden, p.hidden);
    }
  });
  return z;
}

// The student's logits scale * (xs . ws^T + bias) over vocabulary entries [c0, c0 + cols), [N, cols]
// in xs_acc's dtype (bias_acc: the bias in that dtype, or undefined).
at::Tensor chunk_logits(const at::Tensor& xs_acc, const at::Tensor& ws, const at::Tensor& bias_acc, int64_t c0,
                        int64_t cols, const TopKParams& p) {
  at::Tensor z = at::mm(xs_acc, ws.narrow(0, c0, cols).to(xs_acc.scalar_type()).t());
  if (bias_acc.defined()) z.add_(bias_acc.narrow(0, c0, cols));
  if (p.logit_scale != 1.0) z.mul_(p.logit_scale);
  return z;
}

// normalize="full": the student's logits at the ids [N, K] (acc_t), picked from the chunks of its
// logits scale * (xs . ws^T + bias), and their log-normalizer at temperature tau as [N, 2] (max,
// log-sum), online over the same chunks. The exponentials are the accumulation dtype's, their sums float64: the loss takes the
// log-normalizer times the teacher's kept mass, and a float32 sum's rounding showed at logit
// scales ~1e-3.
std::tuple<at::Tensor, at::Tensor> student_logits_and_log_normalizer(const at::Tensor& xs_acc, const at::Tensor& ws,
                                                                     const at::Tensor& bias_acc, const at::Tensor& ids,
                                                                     const TopKParams& p) {
  const int64_t chunk = chunk_width(p);
  const auto f64 = xs_acc.options().dtype(at::kDouble);
  at::Tensor max = at::full({p.num_rows, 1}, kNegInf<double>, f64);
  at::Tensor sum = at::zeros({p.num_rows, 1}, f64);
  at::Tensor z = at::zeros({p.num_rows, p.k}, xs_acc.options());
  for (int64_t c0 = 0; c0 < p.vocab_size; c0 += chunk) {
    const int64_t cols = std::min(chunk, p.vocab_size - c0);
    const at::Tensor logits = chunk_logits(xs_acc, ws, bias_acc, c0, cols, p);
    const at::Tensor in_chunk = (ids >= c0) & (ids < c0 + cols);
    z = at::where(in_chunk, logits.gather(1, (ids - c0).clamp(0, cols - 1)), z);
    const at::Tensor s = logits * p.inv_temperature;
    const at::Tensor new_max = at::maximum(max, s.amax(1, /*keepdim=*/true).to(at::kDouble));
    sum = sum * (max - new_max).exp() + (s - new_max.to(s.scalar_type())).exp().sum(1, /*keepdim=*/true, at::kDouble);
    max = new_max;
  }
  return {z, at::cat({max, sum.log()}, 1)};
}

// Adds each id's sparse term to its entry of the chunk [c0, c0 + cols) (divergence/topk_rows.h).
template <typename acc_t>
void add_id_terms(at::Tensor& dz, const TopKGradTerms& terms, int64_t c0, int64_t cols, const TopKParams& p) {
  const at::Tensor ids = terms.write_ids.contiguous(), values = terms.id_sparse.to(dz.scalar_type()).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const acc_t* value = values.data_ptr<acc_t>();
  acc_t* out = dz.data_ptr<acc_t>();
  for (int64_t i = 0; i < p.num_rows * p.k; ++i) {
    const int64_t v = id[i] - c0;  // repeated occurrences (-1) fall outside every chunk
    if (v >= 0 && v < cols) out[(i / p.k) * cols + v] += value[i];
  }
}

// normalize="topk": the gradients from the K ids' terms alone (divergence/topk_rows.h), no vocabulary pass.
template <typename scalar_t, typename acc_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_backward(const at::Tensor& xs_acc, const at::Tensor& ws,
                                                               const TopKGradTerms& terms, const at::Tensor& grad_loss,
                                                               const TopKParams& p, bool compute_dxs, bool compute_dws,
                                                               bool compute_dbias) {
  const TopKSparseGrad sparse = topk_sparse_grad(terms, grad_loss, xs_acc.scalar_type());
  const at::Tensor ids = terms.write_ids.contiguous();
  const acc_t* coef = sparse.coef.data_ptr<acc_t>();
  const acc_t* x = xs_acc.data_ptr<acc_t>();
  const WsRows<scalar_t> w(ws);
  const int64_t d = p.hidden;
  at::Tensor dxs = at::empty({0}, ws.options()), dws = at::empty({0}, ws.options()), dbias = at::empty({0}, ws.options());
  if (compute_dbias) {  // dbias[v] = sum of coef over the pairs of id v, in order
    const at::Tensor flat_ids = ids.reshape(-1), kept = flat_ids >= 0;
    dbias = at::zeros({ws.size(0)}, xs_acc.options())
                .index_add_(0, flat_ids.masked_select(kept), sparse.coef.reshape(-1).masked_select(kept))
                .to(ws.scalar_type());
  }
  if (compute_dxs) {  // dxs[n] = sum_k coef[n, k] ws[id_k]
    at::Tensor acc = at::zeros_like(xs_acc);
    acc_t* out = acc.data_ptr<acc_t>();
    const int64_t* id = ids.data_ptr<int64_t>();
    at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        for (int64_t k = 0; k < p.k; ++k) {
          if (id[n * p.k + k] >= 0) w.add_scaled(id[n * p.k + k], coef[n * p.k + k], out + n * d, d);
        }
      }
    });
    dxs = acc.to(ws.scalar_type());
  }
  if (compute_dws) {  // dws[v] = sum over the run of id v in the sorted pairs of coef * xs[n]
    dws = at::zeros(ws.sizes(), ws.options());
    scalar_t* out = dws.data_ptr<scalar_t>();
    const int64_t* sorted = sparse.sorted_ids.data_ptr<int64_t>();
    const int64_t* order = sparse.order.data_ptr<int64_t>();
    const int64_t entries = sparse.sorted_ids.numel();
    // Each run of one id is summed in order and written by one task: the task that holds its
    // first entry (a task starting inside a run leaves that run to the task before it).
    at::parallel_for(0, entries, 256, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> row(d);
      int64_t i = begin;
      while (i > 0 && i < end && sorted[i] == sorted[i - 1]) ++i;
      while (i < end) {
        const int64_t v = sorted[i];
        std::fill(row.begin(), row.end(), acc_t(0));
        for (; i < entries && sorted[i] == v; ++i) {
          const acc_t c = coef[order[i]];
          const acc_t* x_row = x + (order[i] / p.k) * d;
          for (int64_t j = 0; j < d; ++j) row[j] += c * x_row[j];
        }
        if (v < 0) continue;  // the repeated occurrences
        for (int64_t j = 0; j < d; ++j) out[v * d + j] = static_cast<scalar_t>(row[j]);
      }
    });
  }
  return {dxs, dws, dbias};
}

at::Tensor to_or_undefined(const c10::optional<at::Tensor>& t, at::ScalarType dtype) {
  return t.has_value() ? t->to(dtype) : at::Tensor();
}

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& ids,
                                                const at::Tensor& lps, const c10::optional<at::Tensor>& labels,
                                                const c10::optional<at::Tensor>& bias, const TopKParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor xs_acc = xs.to(acc_dtype).contiguous();
  const at::Tensor bias_acc = to_or_undefined(bias, acc_dtype);
  at::Tensor z, norm;
  if (p.renormalize) {
    z = model_logits_at_ids(gather_logits<scalar_t, acc_t>(xs_acc, ws, ids, p), ids, bias_acc, p.logit_scale);
  } else {
    std::tie(z, norm) = student_logits_and_log_normalizer(xs_acc, ws, bias_acc, ids, p);
  }
  auto [loss, stats] = topk_rows_forward(z, norm, lps, topk_valid_rows(labels, p, xs), p, xs_acc.scalar_type());
  return {loss.to(xs_acc.scalar_type()), stats};
}

// The gradients of dLoss/d(scale * (xs . ws^T + bias)): the scale's factor rides on the upstream g.
template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(
    const at::Tensor& grad_loss_in, const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& ids,
    const at::Tensor& lps, const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias,
    const at::Tensor& row_stats, const TopKParams& p, bool compute_dxs, bool compute_dws, bool compute_dbias) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  compute_dbias = compute_dbias && bias.has_value();
  const at::Tensor grad_loss = grad_loss_in.to(acc_dtype) * p.logit_scale;
  const TopKGradTerms terms = topk_grad_terms(row_stats, ids, lps, topk_valid_rows(labels, p, xs), p, acc_dtype);
  const at::Tensor xs_acc = xs.to(acc_dtype).contiguous();
  if (p.renormalize) {
    return sparse_backward<scalar_t, acc_t>(xs_acc, ws, terms, grad_loss, p, compute_dxs, compute_dws, compute_dbias);
  }
  const at::Tensor bias_acc = to_or_undefined(bias, acc_dtype);
  const at::Tensor g = grad_loss.unsqueeze(1);
  const at::Tensor dense = terms.dense.to(acc_dtype).unsqueeze(1) * p.inv_temperature;
  const at::Tensor has_dense = terms.dense.unsqueeze(1) != 0;
  const at::Tensor s_max = row_stats.narrow(1, kTopKMax, 1).to(acc_dtype);
  const at::Tensor s_log_sum = row_stats.narrow(1, kTopKLogSum, 1).to(acc_dtype);
  at::Tensor dxs_acc = compute_dxs ? at::zeros_like(xs_acc) : at::Tensor();
  at::Tensor dws = compute_dws ? at::zeros(ws.sizes(), ws.options()) : at::empty({0}, ws.options());
  at::Tensor dbias_acc = compute_dbias ? at::zeros({ws.size(0)}, xs_acc.options()) : at::Tensor();
  const at::Tensor xs_scaled = compute_dws ? xs_acc * g : at::Tensor();
  const int64_t chunk = chunk_width(p);
  for (int64_t c0 = 0; p.num_rows > 0 && (compute_dxs || compute_dws || compute_dbias) && c0 < p.vocab_size;
       c0 += chunk) {
    const int64_t cols = std::min(chunk, p.vocab_size - c0);
    const at::Tensor ws_chunk = ws.narrow(0, c0, cols).to(acc_dtype);
    // dense * p_v / tau; rows without a dense part are 0 (their normalizer is a placeholder)
    const at::Tensor s = chunk_logits(xs_acc, ws, bias_acc, c0, cols, p) * p.inv_temperature;
    at::Tensor dz =
        at::where(has_dense, dense * ((s - s_max) - s_log_sum).exp(), at::zeros({}, s.options())).contiguous();
    add_id_terms<acc_t>(dz, terms, c0, cols, p);
    if (compute_dxs) dxs_acc.addmm_(dz, ws_chunk);
    if (compute_dws) dws.narrow(0, c0, cols).copy_(at::mm(dz.t(), xs_scaled));
    if (compute_dbias) dbias_acc.narrow(0, c0, cols).copy_(at::mv(dz.t(), grad_loss));
  }
  at::Tensor dxs = compute_dxs ? (dxs_acc * g).to(xs.scalar_type()) : at::empty({0}, xs.options());
  at::Tensor dbias = compute_dbias ? dbias_acc.to(ws.scalar_type()) : at::empty({0}, ws.options());
  return {dxs, dws, dbias};
}

void check_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "xs must be a CPU tensor here, got ", t.device());
}

std::tuple<at::Tensor, at::Tensor> topk_linear_fwd_cpu(const at::Tensor& xs, const at::Tensor& ws,
                                                       const at::Tensor& teacher_ids, const at::Tensor& teacher_logprobs,
                                                       const c10::optional<at::Tensor>& labels,
                                                       const c10::optional<at::Tensor>& bias_s, int64_t ignore_index,
                                                       double temperature, double logit_scale_s, bool renormalize,
                                                       int64_t chunk_v, c10::string_view divergence, double beta) {
  // The ATen calls below (products, row math) compute in the op's precision even under autocast.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const TopKParams p = make_topk_linear_params(xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, ignore_index,
                                               temperature, logit_scale_s, renormalize, chunk_v, divergence, beta);
  check_cpu(xs);
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "topk_linear_fwd_cpu", [&] {
    out = forward_impl<scalar_t>(xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, p);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_linear_bwd_cpu(
    const at::Tensor& grad_loss, const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& teacher_ids,
    const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const at::Tensor& row_stats, int64_t ignore_index, double temperature, double logit_scale_s, bool renormalize,
    int64_t chunk_v, c10::string_view divergence, double beta, bool compute_dxs, bool compute_dws,
    bool compute_dbias_s) {
  // The ATen calls below (products, row math) compute in the op's precision even under autocast.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const TopKParams p = make_topk_linear_params(xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, ignore_index,
                                               temperature, logit_scale_s, renormalize, chunk_v, divergence, beta);
  check_cpu(xs);
  check_topk_backward_inputs(grad_loss, row_stats, kTopKLogitsColumn + p.k, p, xs.device());
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "topk_linear_bwd_cpu", [&] {
    out = backward_impl<scalar_t>(grad_loss, xs, ws, teacher_ids, teacher_logprobs, labels, bias_s, row_stats, p,
                                  compute_dxs, compute_dws, compute_dbias_s);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) {
  m.impl("topk_linear_fwd", &topk_linear_fwd_cpu);
  m.impl("topk_linear_bwd", &topk_linear_bwd_cpu);
}

}  // namespace cpu
}  // namespace nitrobrew
