// CPU implementation of the top-K teacher ops from logits (nitrobrew.logits.topk_kl). normalize="full":
// forward KL over the K ids a teacher kept, sum_k q_k (log q_k - log p_{id_k}), the student's
// log-probabilities normalized over the whole vocabulary (one pass over the row, in lane sums) and the
// teacher's q_k = exp(logprob_k) used as given. Gradient w.r.t. the scaled student logits s
// (docs/design.md section 5): (sum_k q_k) p_v - sum_k q_k [id_k = v]. normalize="topk" (any divergence)
// is the K gathered logits' row math (divergence/topk_rows.h), shared with the CUDA op.
// The row math runs in double whatever the inputs (outputs are float32, float64 for float64): a
// KL between nearly equal distributions is a difference of O(log K) terms, and float32 sums lost
// it (relative error 0.5 at loss 1e-6 against float32 PyTorch's 0.07).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <vector>

#include "../divergence/nonfinite.h"
#include "../divergence/online_state.h"
#include "../divergence/topk_rows.h"
#include "logits_params.h"
#include "../engine/cpu/tile_walk.h"

namespace nitrobrew {
namespace cpu {
namespace {

// A row's log-normalizers: the student's over V and the teacher's kept mass
// (max -inf when the teacher kept no mass; NaN when it holds a NaN or +inf: nonfinite.h).
template <typename acc_t>
struct TopKNorms {
  LogNormalizer<acc_t> student, teacher;
};

// A row of the student's logits, read in place at any stride (never copied whole).
template <typename scalar_t>
struct Row {
  const scalar_t* data;
  int64_t stride;
  scalar_t operator[](int64_t v) const { return data[v * stride]; }
};

template <typename acc_t, typename scalar_t>
TopKNorms<acc_t> row_norms(const Row<scalar_t>& z, const acc_t* lp, const TopKParams& p) {
  const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);
  auto s = [&](int64_t v) { return scale_logit(static_cast<acc_t>(z[v]), inv_t); };
  TopKNorms<acc_t> r;
  acc_t lp_key = kNegInf<acc_t>;
  for (int64_t k = 0; k < p.k; ++k) lp_key = std::max(lp_key, teacher_max_key(lp[k]));
  const acc_t lp_max = teacher_row_max(lp_key);
  acc_t mass = 0;  // relative to lp_max
  if (lp_max != kNegInf<acc_t>) {
    for (int64_t k = 0; k < p.k; ++k) mass += exp_(lp[k] - lp_max);
  }
  r.teacher = {lp_max, log_(mass)};
  acc_t m = kNegInf<acc_t>;
  for (int64_t v = 0; v < p.vocab_size; ++v) m = nan_max(m, s(v));
  const acc_t sum = lane_sums<acc_t, 1>(p.vocab_size, [&](int64_t v) {
    return std::array<acc_t, 1>{m == kNegInf<acc_t> ? acc_t(0) : exp_(s(v) - m)};
  })[0];
  r.student = {m, log_(sum)};
  return r;
}

std::vector<uint8_t> valid_rows(const c10::optional<at::Tensor>& labels, const TopKParams& p) {
  std::vector<uint8_t> valid(p.num_rows, 1);
  if (labels.has_value()) {
    const at::Tensor l = labels->contiguous();
    const int64_t* label = l.data_ptr<int64_t>();
    for (int64_t n = 0; n < p.num_rows; ++n) valid[n] = label[n] != p.ignore_index;
  }
  return valid;
}

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& zs, const at::Tensor& ids, const at::Tensor& lps,
                                                const c10::optional<at::Tensor>& labels, const TopKParams& p) {
  using out_t = at::opmath_type<scalar_t>;
  using acc_t = double;
  const auto out_options = zs.options().dtype(c10::CppTypeToScalarType<out_t>::value);
  const at::Tensor ids_c = ids.contiguous(), lp_c = lps.to(at::kDouble).contiguous();
  const std::vector<uint8_t> valid = valid_rows(labels, p);
  at::Tensor loss = at::zeros({p.num_rows}, out_options.dtype(at::kDouble));
  // The row statistics, then the K raw logits at the ids (kTopKLogitsColumn), as the CUDA op keeps them.
  const int64_t columns = kTopKLogitsColumn + p.k;
  at::Tensor stats = at::zeros({p.num_rows, columns}, out_options.dtype(at::kDouble));
  const scalar_t* z = zs.data_ptr<scalar_t>();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const acc_t* lp = lp_c.data_ptr<acc_t>();
  acc_t* loss_ = loss.data_ptr<acc_t>();
  acc_t* stats_ = stats.data_ptr<acc_t>();
  const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);
  at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (!valid[n]) continue;
      const Row<scalar_t> zn{z + n * zs.stride(0), zs.stride(1)};
      const int64_t* idn = id + n * p.k;
      const acc_t* lpn = lp + n * p.k;
      const TopKNorms<acc_t> norms = row_norms<acc_t>(zn, lpn, p);
      acc_t* row = stats_ + n * columns;
      for (int64_t k = 0; k < p.k; ++k) row[kTopKLogitsColumn + k] = static_cast<acc_t>(zn[idn[k]]);
      row[kTopKMax] = norms.student.max;
      row[kTopKLogSum] = norms.student.log_sum;
      row[kTopKTeacherMax] = norms.teacher.max;
      row[kTopKTeacherLogSum] = norms.teacher.log_sum;
      if (topk_row_undefined(norms.teacher.max)) {
        loss_[n] = kNaN<acc_t>;
        continue;
      }
      if (norms.teacher.max == kNegInf<acc_t>) continue;  // no mass kept: loss 0
      acc_t total = 0;
      for (int64_t k = 0; k < p.k; ++k) {
        if (lpn[k] == kNegInf<acc_t>) continue;  // q_k = 0: 0 log 0 = 0
        const acc_t log_p = log_prob(scale_logit(static_cast<acc_t>(zn[idn[k]]), inv_t), norms.student);
        total += exp_(lpn[k]) * (lpn[k] - log_p);
      }
      loss_[n] = total;
    }
  });
  return {loss.to(out_options.dtype()), stats};  // the statistics stay float64: the backward recomputes with them
}

template <typename scalar_t>
at::Tensor backward_impl(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& ids,
                         const at::Tensor& lps, const c10::optional<at::Tensor>& labels, const at::Tensor& row_stats,
                         const TopKParams& p) {
  using acc_t = double;
  const auto acc_dtype = at::kDouble;
  const at::Tensor ids_c = ids.contiguous(), lp_c = lps.to(acc_dtype).contiguous();
  const at::Tensor g_c = grad_loss.to(acc_dtype).contiguous(), stats_c = row_stats.to(acc_dtype).contiguous();
  const std::vector<uint8_t> valid = valid_rows(labels, p);
  at::Tensor dzs = at::zeros(zs.sizes(), zs.options().memory_format(at::MemoryFormat::Contiguous));
  const scalar_t* z = zs.data_ptr<scalar_t>();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const acc_t* lp = lp_c.data_ptr<acc_t>();
  const acc_t* g = g_c.data_ptr<acc_t>();
  const acc_t* stats = stats_c.data_ptr<acc_t>();
  scalar_t* out = dzs.data_ptr<scalar_t>();
  const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);
  at::parallel_for(0, p.num_rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> row_grad(p.vocab_size);  // the row's gradient, rounded to the dtype once
    for (int64_t n = begin; n < end; ++n) {
      const acc_t* row = stats + n * (kTopKLogitsColumn + p.k);
      if (!valid[n]) continue;  // its gradient stays 0
      scalar_t* dn = out + n * p.vocab_size;
      if (topk_row_undefined(row[kTopKTeacherMax])) {
        std::fill(dn, dn + p.vocab_size, static_cast<scalar_t>(kNaN<acc_t>));
        continue;
      }
      if (row[kTopKTeacherMax] == kNegInf<acc_t>) continue;  // no mass kept: gradient 0
      const TopKNorms<acc_t> norms{{row[kTopKMax], row[kTopKLogSum]}, {row[kTopKTeacherMax], row[kTopKTeacherLogSum]}};
      const Row<scalar_t> zn{z + n * zs.stride(0), zs.stride(1)};
      const int64_t* idn = id + n * p.k;
      const acc_t* lpn = lp + n * p.k;
      const acc_t coef = g[n] * inv_t;
      auto p_of = [&](int64_t v) { return exp_(log_prob(scale_logit(static_cast<acc_t>(zn[v]), inv_t), norms.student)); };
      const acc_t mass = exp_(norms.teacher.max + norms.teacher.log_sum);
      for (int64_t v = 0; v < p.vocab_size; ++v) row_grad[v] = coef * mass * p_of(v);
      for (int64_t k = 0; k < p.k; ++k) {
        if (lpn[k] != kNegInf<acc_t>) row_grad[idn[k]] -= coef * exp_(lpn[k]);
      }
      for (int64_t v = 0; v < p.vocab_size; ++v) dn[v] = static_cast<scalar_t>(row_grad[v]);
    }
  });
  return dzs;
}

std::tuple<at::Tensor, at::Tensor> topk_logits_fwd_cpu(const at::Tensor& zs, const at::Tensor& teacher_ids,
                                                             const at::Tensor& teacher_logprobs,
                                                             const c10::optional<at::Tensor>& labels,
                                                             int64_t ignore_index, double temperature,
                                                             bool renormalize, c10::string_view divergence,
                                                             double beta) {
  const TopKParams p = make_topk_logits_params(zs, teacher_ids, teacher_logprobs, labels, ignore_index, temperature,
                                               renormalize, divergence, beta);
  TORCH_CHECK(zs.device().is_cpu(), "zs must be a CPU tensor here, got ", zs.device());
  if (p.renormalize) {
    return topk_gathered_forward(zs, teacher_ids, teacher_logprobs, topk_valid_rows(labels, p, zs), p, at::kDouble);
  }
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "topk_logits_fwd_cpu", [&] {
    out = forward_impl<scalar_t>(zs, teacher_ids, teacher_logprobs, labels, p);
  });
  return out;
}

at::Tensor topk_logits_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& teacher_ids,
                                      const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels,
                                      const at::Tensor& row_stats, int64_t ignore_index, double temperature,
                                      bool renormalize, c10::string_view divergence, double beta) {
  const TopKParams p = make_topk_logits_params(zs, teacher_ids, teacher_logprobs, labels, ignore_index, temperature,
                                               renormalize, divergence, beta);
  TORCH_CHECK(zs.device().is_cpu(), "zs must be a CPU tensor here, got ", zs.device());
  check_topk_backward_inputs(grad_loss, row_stats, kTopKLogitsColumn + p.k, p, zs.device());
  if (p.renormalize) {
    return topk_gathered_backward(grad_loss, zs, teacher_ids, teacher_logprobs, topk_valid_rows(labels, p, zs),
                                  row_stats, p, at::kDouble);
  }
  at::Tensor dzs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "topk_logits_bwd_cpu", [&] {
    dzs = backward_impl<scalar_t>(grad_loss, zs, teacher_ids, teacher_logprobs, labels, row_stats, p);
  });
  return dzs;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) {
  m.impl("topk_logits_fwd", &topk_logits_fwd_cpu);
  m.impl("topk_logits_bwd", &topk_logits_bwd_cpu);
}

}  // namespace cpu
}  // namespace nitrobrew
