#include "topk_rows.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <limits>

#include "nonfinite.h"
#include "row_stats.h"

namespace nitrobrew {

namespace {

// Each row's terms summed over the entries that share an id, at the id's first occurrence, and
// the ids with their repeated occurrences replaced by -1. (A stable sort of each row's ids makes a
// run of equal ids one segment, led by its first occurrence.)
std::tuple<at::Tensor, at::Tensor> sum_over_repeated_ids(const at::Tensor& c, const at::Tensor& ids) {
  if (ids.size(1) == 1) return {c, ids};
  const auto [sorted, order] = at::sort(ids, /*stable=*/c10::optional<bool>(true), /*dim=*/1, /*descending=*/false);
  const int64_t k = sorted.size(1);
  at::Tensor starts = at::ones_like(sorted, sorted.options().dtype(at::kBool));
  starts.narrow(1, 1, k - 1).copy_(sorted.narrow(1, 1, k - 1) != sorted.narrow(1, 0, k - 1));
  const at::Tensor segment = starts.cumsum(1) - 1;  // the run each sorted entry belongs to
  const at::Tensor totals = at::zeros_like(c).scatter_add_(1, segment, c.gather(1, order));
  const at::Tensor first = at::empty_like(starts).scatter_(1, order, starts);
  const at::Tensor summed = at::empty_like(c).scatter_(1, order, totals.gather(1, segment));
  return {at::where(first, summed, at::zeros({}, c.options())), at::where(first, ids, at::full({}, -1, ids.options()))};
}

// s = z / tau in float64: for "full" rounded to acc_dtype first, as the kernels' scale_logit rounds the logits of
// the student's normalizer over the vocabulary; "topk" forms its normalizer from these s alone, in float64.
at::Tensor scaled_logits(const at::Tensor& z, const TopKParams& p, at::ScalarType acc_dtype) {
  if (p.renormalize) return z.to(at::kDouble) * p.inv_temperature;
  return (z.to(acc_dtype) * p.inv_temperature).to(at::kDouble);
}

struct TeacherMass {
  at::Tensor max, log_sum;  // [N, 1]: log sum_k q_k = max + log_sum (max -inf: no mass; NaN: see below)
  at::Tensor has_mass;      // [N, 1] bool
};

// The row's teacher maximum is NaN where a log-probability is NaN or +inf (nonfinite.h).
TeacherMass teacher_mass(const at::Tensor& lp) {
  TeacherMass t;
  const at::Tensor max = lp.amax(1, /*keepdim=*/true);  // NaN where the row holds one
  t.max = at::where(max == std::numeric_limits<double>::infinity(), at::full({}, kNaN<double>, max.options()), max);
  t.has_mass = t.max != kNegInf<double>;
  const at::Tensor shift = at::where(t.has_mass, t.max, at::zeros_like(t.max));
  t.log_sum = (lp - shift).exp().sum(1, /*keepdim=*/true).log();
  return t;
}

// [N, 1] bool: the rows whose loss and gradient are NaN (topk_row_undefined in nonfinite.h), for "full".
at::Tensor undefined_rows(const at::Tensor& teacher_max) { return teacher_max.isnan(); }

// normalize="topk" is the logit ops' divergence between two [N, K] rows: the student's s = z / tau and the
// teacher's log-probabilities, taken as logits (log_softmax renormalizes both over the K ids). They run in
// float64 on the tensors' device (nitrobrew::logits_fwd / logits_bwd, below autograd): the divergences, the
// non-finite rule and the masking are theirs, one code path for every divergence and both families.
static_assert(kTopKMax == kMaxS && kTopKLogSum == kLogSumS && kTopKTeacherMax == kMaxT &&
                  kTopKTeacherLogSum == kLogSumT && kTopKGradCenter == kGradCenter,
              "the top-K statistics' first columns are the logit ops' (renormalized_rows_forward copies them)");

// The logit ops' labels for the rows that take part: 0 where valid, else their ignore_index, -1.
constexpr int64_t kSkipRow = -1;
at::Tensor row_labels(const at::Tensor& valid) {
  return at::where(valid, at::zeros({}, valid.options().dtype(at::kLong)),
                   at::full({}, kSkipRow, valid.options().dtype(at::kLong)));
}

std::tuple<at::Tensor, at::Tensor> logits_forward(const at::Tensor& s, const at::Tensor& t, const at::Tensor& valid,
                                                  const TopKParams& p) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("nitrobrew::logits_fwd", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const c10::optional<at::Tensor>&, int64_t, c10::string_view,
                                                    double, double)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(s, t, row_labels(valid), kSkipRow, divergence_name(p.kind), p.weight, 1.0);
}

at::Tensor logits_backward(const at::Tensor& s, const at::Tensor& t, const at::Tensor& valid,
                           const at::Tensor& logit_stats, const TopKParams& p) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("nitrobrew::logits_bwd", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const c10::optional<at::Tensor>&, const at::Tensor&, int64_t, c10::string_view, double,
                            double)>();
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor unit = at::ones({s.size(0)}, s.options());
  return op.call(unit, s, t, row_labels(valid), logit_stats, kSkipRow, divergence_name(p.kind), p.weight, 1.0);
}

std::tuple<at::Tensor, at::Tensor> renormalized_rows_forward(const at::Tensor& s, const at::Tensor& z64,
                                                             const at::Tensor& lp, const at::Tensor& valid,
                                                             const TopKParams& p) {
  auto [loss, logit_stats] = logits_forward(s, lp, valid, p);
  const at::Tensor stats = at::cat({logit_stats.narrow(1, 0, kNumTopKRowStats), z64}, 1);
  return {loss, at::where(valid.unsqueeze(1), stats, at::zeros_like(stats))};
}

// dLoss/ds [N, K] of the renormalized rows (the upstream gradient 1) from the forward's statistics: the logit
// ops' backward reads the log-normalizers and the gradient centre, and each entry's s and log-probability.
// Over vocabulary shards the ids another shard holds have s = -inf and a log-probability of -inf: 0 there.
at::Tensor renormalized_rows_grad(const at::Tensor& stats, const at::Tensor& s, const at::Tensor& lp,
                                  const at::Tensor& valid, const TopKParams& p) {
  at::Tensor logit_stats = at::zeros({stats.size(0), kNumRowStats}, stats.options());
  logit_stats.narrow(1, 0, kNumTopKRowStats).copy_(stats.narrow(1, 0, kNumTopKRowStats));
  return logits_backward(s, lp, valid, logit_stats, p);
}

}  // namespace

at::Tensor topk_valid_rows(const c10::optional<at::Tensor>& labels, const TopKParams& p, const at::Tensor& like) {
  if (!labels.has_value()) return at::ones({p.num_rows}, like.options().dtype(at::kBool));
  return *labels != p.ignore_index;
}

std::tuple<at::Tensor, at::Tensor> topk_rows_forward(const at::Tensor& z, const at::Tensor& student_norm,
                                                      const at::Tensor& teacher_logprobs, const at::Tensor& valid,
                                                      const TopKParams& p, at::ScalarType acc_dtype) {
  const at::Tensor z64 = z.to(at::kDouble);
  const at::Tensor s = scaled_logits(z, p, acc_dtype);
  const at::Tensor lp = teacher_logprobs.to(at::kDouble);
  if (p.renormalize) return renormalized_rows_forward(s, z64, lp, valid, p);
  // "full": forward KL, sum_k q_k (log q_k - log p_{id_k}) with q_k as given.
  const at::Tensor norm = student_norm.to(at::kDouble);
  const at::Tensor s_max = norm.narrow(1, 0, 1), s_log_sum = norm.narrow(1, 1, 1);
  const TeacherMass t = teacher_mass(lp);
  const at::Tensor kept = lp != kNegInf<double>;  // q_k = 0 adds nothing (0 log 0 = 0)
  const at::Tensor log_p = (s - s_max) - s_log_sum;
  const at::Tensor terms = at::where(kept, lp.exp() * (lp - log_p), at::zeros_like(log_p));
  const at::Tensor undefined = valid.unsqueeze(1) & undefined_rows(t.max);
  const at::Tensor active = valid.unsqueeze(1) & t.has_mass & undefined.logical_not();
  at::Tensor loss = at::where(active, terms.sum(1, /*keepdim=*/true), at::zeros_like(s_max));
  loss = at::where(undefined, at::full({}, kNaN<double>, loss.options()), loss).squeeze(1);
  const at::Tensor stats = at::cat({s_max, s_log_sum, t.max, t.log_sum, at::zeros_like(s_max), z64}, 1);
  return {loss, at::where(valid.unsqueeze(1), stats, at::zeros_like(stats))};
}

std::tuple<at::Tensor, at::Tensor> topk_gathered_forward(const at::Tensor& zs, const at::Tensor& ids,
                                                          const at::Tensor& teacher_logprobs, const at::Tensor& valid,
                                                          const TopKParams& p, at::ScalarType acc_dtype) {
  auto [loss, stats] = topk_rows_forward(zs.gather(1, ids), at::Tensor(), teacher_logprobs, valid, p, acc_dtype);
  return {loss.to(zs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat), stats};
}

at::Tensor topk_gathered_backward(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& ids,
                                  const at::Tensor& teacher_logprobs, const at::Tensor& valid,
                                  const at::Tensor& row_stats, const TopKParams& p, at::ScalarType acc_dtype) {
  const TopKGradTerms terms = topk_grad_terms(row_stats, ids, teacher_logprobs, valid, p, acc_dtype);
  // Repeated ids carry 0 after their first occurrence, which holds their sum (write_ids).
  const at::Tensor coef = (terms.id_sparse * grad_loss.to(at::kDouble).unsqueeze(1)).to(zs.scalar_type());
  // Each row filled once with 0, or NaN where the row is undefined (dense is NaN there), then the ids' terms added:
  // one write of [N, V], where zeros and a masked fill afterwards wrote it twice and read it once.
  const at::Tensor row_fill = at::where(terms.dense.isnan(), kNaN<double>, 0.0).to(zs.scalar_type()).unsqueeze(1);
  at::Tensor dzs = row_fill.expand({p.num_rows, p.vocab_size}).contiguous();
  return dzs.scatter_add_(1, ids, coef);
}

std::tuple<at::Tensor, at::Tensor> topk_merge_shards(const at::Tensor& partials, const at::Tensor& teacher_logprobs,
                                                      const at::Tensor& valid, const TopKParams& p,
                                                      at::ScalarType acc_dtype) {
  const at::Tensor parts = partials.to(at::kDouble);
  const at::Tensor max = parts.select(2, 0), log_sum = parts.select(2, 1);  // [R, N]
  // The softmax states merged: an empty shard (max -inf) adds 0; a NaN maximum stays (nonfinite.h).
  const at::Tensor top = max.amax(0, /*keepdim=*/true);
  const at::Tensor shift = at::where(top == kNegInf<double>, at::zeros_like(top), top);
  const at::Tensor terms = at::where(max == kNegInf<double>, at::zeros_like(max), ((max - shift) + log_sum).exp());
  const at::Tensor student_norm = at::stack({top.squeeze(0), terms.sum(0).log()}, 1);
  const at::Tensor z = parts.narrow(2, 2, p.k).sum(0);
  return topk_rows_forward(z, student_norm, teacher_logprobs, valid, p, acc_dtype);
}

TopKGradTerms topk_grad_terms(const at::Tensor& row_stats, const at::Tensor& teacher_ids,
                              const at::Tensor& teacher_logprobs, const at::Tensor& valid, const TopKParams& p,
                              at::ScalarType acc_dtype) {
  const at::Tensor stats = row_stats.to(at::kDouble);
  const at::Tensor s_max = stats.narrow(1, kTopKMax, 1), s_log_sum = stats.narrow(1, kTopKLogSum, 1);
  const at::Tensor t_max = stats.narrow(1, kTopKTeacherMax, 1), t_log_sum = stats.narrow(1, kTopKTeacherLogSum, 1);
  const at::Tensor s = scaled_logits(stats.narrow(1, kTopKLogitsColumn, p.k), p, acc_dtype);
  const at::Tensor prob = ((s - s_max) - s_log_sum).exp();  // p_{id_k} (p~_k when renormalized)
  const at::Tensor lp = teacher_logprobs.to(at::kDouble);
  const at::Tensor zero = at::zeros({}, stats.options()), nan = at::full({}, kNaN<double>, stats.options());
  at::Tensor undefined, active, dense, c;  // per row: the dense coefficient; per entry: the sparse term
  if (p.renormalize) {
    c = renormalized_rows_grad(stats, s, lp, valid, p);  // NaN on the rows the logit ops find undefined
    undefined = valid.unsqueeze(1) & c.isnan().any(1, /*keepdim=*/true);
    active = valid.unsqueeze(1) & undefined.logical_not();
    dense = at::zeros_like(s_max);
  } else {
    undefined = valid.unsqueeze(1) & undefined_rows(t_max);
    active = valid.unsqueeze(1) & (t_max != kNegInf<double>) & undefined.logical_not();
    dense = (t_max + t_log_sum).exp();  // sum_k q_k
    c = -lp.exp();
  }
  // Undefined rows: NaN everywhere (the dense part, or for "topk" the ids' entries).
  dense = at::where(undefined, nan, at::where(active, dense, zero));
  c = at::where(undefined, nan, at::where(active, c, zero));
  const auto [sparse, write_ids] = sum_over_repeated_ids(c, teacher_ids);
  TopKGradTerms terms;
  terms.dense = dense.squeeze(1);
  terms.write_ids = write_ids;
  terms.id_sparse = sparse * p.inv_temperature;
  terms.id_dense = at::where(active.logical_or(undefined), dense * prob, zero) * p.inv_temperature;
  terms.grad_rows =
      at::where(active.logical_or(undefined), at::cat({s_max, s_log_sum, dense}, 1), zero).to(at::kFloat).contiguous();
  return terms;
}

at::Tensor model_logits_at_ids(const at::Tensor& z, const at::Tensor& ids, const at::Tensor& bias, double scale) {
  at::Tensor out = z;
  if (bias.defined()) out = out + bias.index_select(0, ids.reshape(-1)).view(ids.sizes());
  return scale == 1.0 ? out : out * scale;
}

TopKSparseGrad topk_sparse_grad(const TopKGradTerms& terms, const at::Tensor& grad_loss, at::ScalarType coef_dtype) {
  TopKSparseGrad sparse;
  sparse.coef = (terms.id_sparse * grad_loss.to(at::kDouble).unsqueeze(1)).to(coef_dtype).contiguous();
  auto [sorted, order] =
      at::sort(terms.write_ids.reshape(-1), /*stable=*/c10::optional<bool>(true), /*dim=*/0, /*descending=*/false);
  sparse.sorted_ids = sorted.contiguous();
  sparse.order = order.contiguous();
  return sparse;
}

}  // namespace nitrobrew
