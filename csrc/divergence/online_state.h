// Per-row math of the fused distillation losses, shared by the CPU and CUDA kernels.
//
// A row's logits arrive one vocabulary tile at a time. Each tile is reduced to a
// partial state while it is on chip (in cache on the CPU) and merged into the running
// state; the merge is associative, so tiles, vocab splits and vocab shards combine the
// same way. docs/design.md section 3 has the derivation.
#pragma once

#include <cmath>
#include <limits>

#include "../engine/numerics.h"

namespace nitrobrew {

// Which divergence a kernel computes (docs/design.md, section 2). JSD(beta) with beta = 0 / 1, and the
// skew KLs with alpha = 0, are mapped to kForwardKL / kReverseKL by the caller (parse_divergence): the
// mixture formula is discontinuous there, and the plain KLs need no second pass.
//   kJSD            beta KL(q || M) + (1 - beta) KL(p || M),  M = (1 - beta) p + beta q
//   kSkewForwardKL  KL(q || M),  M = alpha q + (1 - alpha) p   (beta = alpha)
//   kSkewReverseKL  KL(p || M),  M = alpha p + (1 - alpha) q   (beta = 1 - alpha)
//   kTVD            1/2 sum_v |p_v - q_v|
enum class Divergence : int { kForwardKL = 0, kReverseKL = 1, kJSD = 2, kSkewForwardKL = 3, kSkewReverseKL = 4, kTVD = 5 };

// Divergences whose loss and gradient centre are two sums per row over the whole vocabulary, formed from
// pass 1's log-normalizers in a second pass (second_pass_terms; finish_second_pass).
NB_HOST_DEVICE constexpr bool has_second_pass(Divergence k) {
  return k != Divergence::kForwardKL && k != Divergence::kReverseKL;
}

// Divergences of a mixture M = (1 - beta) p + beta q (mixture).
NB_HOST_DEVICE constexpr bool has_mixture(Divergence k) {
  return k == Divergence::kJSD || k == Divergence::kSkewForwardKL || k == Divergence::kSkewReverseKL;
}

// Running log-sum-exp of one distribution: lse = m + log(l).
template <typename T>
struct SoftmaxState {
  T m = kNegInf<T>;
  T l = T(0);
};

// One-pass KL state. `w` is the distribution the KL is weighted by (the teacher for
// forward KL, the student for reverse KL), `o` the other one, and
// a = sum_v exp(w_v - m_w) * (w_v - o_v). Then KL(w || o) = a / l_w - lse_w + lse_o.
template <typename T>
struct KLState {
  SoftmaxState<T> w, o;
  T a = T(0);
};

// Factor that rescales a sum kept relative to max `m` to a new max `m_new`.
// An empty state (m = -inf) contributes nothing; m_new is finite whenever this is called.
template <typename T>
NB_HOST_DEVICE T rescale(T m, T m_new) {
  return m == kNegInf<T> ? T(0) : exp_(m - m_new);
}

template <typename T>
NB_HOST_DEVICE void merge(SoftmaxState<T>& into, const SoftmaxState<T>& part) {
  if (part.m == kNegInf<T>) return;  // empty part: never form -inf - -inf
  const T m_new = into.m > part.m ? into.m : part.m;
  into.l = into.l * rescale(into.m, m_new) + part.l * rescale(part.m, m_new);
  into.m = m_new;
}

template <typename T>
NB_HOST_DEVICE void merge(KLState<T>& into, const KLState<T>& part) {
  if (part.w.m == kNegInf<T>) return;
  const T m_new = into.w.m > part.w.m ? into.w.m : part.w.m;
  const T scale_into = rescale(into.w.m, m_new);
  const T scale_part = rescale(part.w.m, m_new);
  into.a = into.a * scale_into + part.a * scale_part;
  into.w.l = into.w.l * scale_into + part.w.l * scale_part;
  into.w.m = m_new;
  merge(into.o, part.o);
}

// Running entropy of one distribution (the student's, when a caller asks for it): its softmax state
// and c = sum_v e^{x_v - m} (x_v - m), relative to the same maximum. Then H = log l - c / l, with no
// large terms to cancel (c / l is E[x] - m). Its own maximum, apart from the KL state's, keeps it out
// of the KL folds: it costs an exponential per entry, and only where it is asked for.
template <typename T>
struct EntropyState {
  T m = kNegInf<T>;
  T l = T(0);
  T c = T(0);
};

// Raises an entropy state's maximum to m_new (finite, >= m): l and c rescaled, c's terms shifted.
template <typename T>
NB_HOST_DEVICE void raise_max(EntropyState<T>& st, T m_new) {
  if (st.m == kNegInf<T>) {  // empty: nothing to rescale (never form -inf - m_new)
    st.m = m_new;
    return;
  }
  const T r = exp_(st.m - m_new);
  st.c = r * (st.c + st.l * (st.m - m_new));
  st.l *= r;
  st.m = m_new;
}

// Adds entry x (at most st.m, or -inf) given its e = exp(x - st.m): a -inf entry adds 0, not 0 * -inf.
template <typename T>
NB_HOST_DEVICE void add_entry(EntropyState<T>& st, T x, T e) {
  st.l += e;
  st.c += e == T(0) ? T(0) : e * (x - st.m);
}

// A NaN maximum on either side leaves l and c NaN (raise_max's factor is NaN), so the row's entropy is NaN.
template <typename T>
NB_HOST_DEVICE void merge(EntropyState<T>& into, EntropyState<T> part) {
  if (part.m == kNegInf<T>) return;
  if (into.m == kNegInf<T>) {  // empty: the part as it is (a NaN maximum included)
    into = part;
    return;
  }
  if (!(part.m <= into.m)) {  // a larger or NaN maximum of the part, or a NaN one here
    raise_max(into, part.m);
  } else if (part.m < into.m) {
    raise_max(part, into.m);
  }
  into.l += part.l;
  into.c += part.c;
}

// H = -sum p log p of a merged state; 0 for an empty one: a state nobody asked for (a row whose
// student has no entry above -inf is undefined, and NaN, before its entropy is read).
template <typename T>
NB_HOST_DEVICE T entropy(const EntropyState<T>& st) {
  return st.m == kNegInf<T> ? T(0) : log_(st.l) - st.c / st.l;
}

// A distribution's log-normalizer kept as (max, log of the sum relative to it) rather than
// their sum: log p_v = (x_v - max) - log_sum then loses nothing to rounding the lse, which
// matters once logits reach ~1e2 (an fp32 lse of 100 has an ulp of 8e-6).
template <typename T>
struct LogNormalizer {
  T max;
  T log_sum;
};

template <typename T>
NB_HOST_DEVICE LogNormalizer<T> log_normalizer(const SoftmaxState<T>& s) {
  return {s.m, log_(s.l)};
}

template <typename T>
NB_HOST_DEVICE T log_prob(T x, const LogNormalizer<T>& norm) {
  return (x - norm.max) - norm.log_sum;
}

// KL(w || o) = a / l_w - lse_w + lse_o, with the large terms of the two lse cancelled first.
template <typename T>
NB_HOST_DEVICE T kl_divergence(const KLState<T>& s) {
  return s.a / s.w.l - (s.w.m - s.o.m) - (log_(s.w.l) - log_(s.o.l));
}

// Row statistics of the forward pass (the columns of RowStat in fused_linear_params.h are
// written by the callers from these): the KL per row and both log-normalizers, from the
// merged one-pass state. `weight_by_student` is true for reverse KL.
template <typename T>
struct KLRowResult {
  LogNormalizer<T> norm_s, norm_t;
  T kl;           // KL(w || o)
  T grad_center;  // E_w[w - o], the reverse-KL gradient's centre
};

template <typename T>
NB_HOST_DEVICE KLRowResult<T> finish_kl_row(const KLState<T>& st, bool weight_by_student) {
  KLRowResult<T> r;
  r.norm_s = log_normalizer(weight_by_student ? st.w : st.o);
  r.norm_t = log_normalizer(weight_by_student ? st.o : st.w);
  r.kl = kl_divergence(st);
  r.grad_center = st.a / st.w.l;
  return r;
}

// Per-row constants of the divergence, derived once from the loss options.
template <typename T>
struct DivergenceParams {
  Divergence kind;
  T beta;           // the mixture weight of M = (1 - beta) p + beta q (has_mixture)
  T one_minus_beta; // 1 - beta, formed in double: beta near 1 would lose it in float
};

// One entry's mixture M = (1 - beta) p + beta q, formed from d = log p - log q with two exponentials (r and
// the larger side) and one log; the log-add-exp form took an exponential and a log1p on top of one
// exponential per side. With L the larger side and S the smaller, r = e^{-|d|} = S / L and
// u = M / L = w_L + w_S r, which lies in [min(w), 1]: log L - log M = -log u and log S - log M = -(|d| + log u)
// are formed without subtracting two log-probabilities of the row's size (log p - log M as such lost ~3 ulps
// of log p against a result 10x smaller: skew reverse KL at alpha = 0.9, randomized seeds 505, 820, 1142).
// Entries where p = q = 0 are the callers' to drop (d is NaN there).
template <typename T>
struct Mixture {
  T p, q;                    // L = e^{log L}, S = L r
  T log_p_over_m, log_q_over_m;
  T q_over_m;
};

// log p - log q of an entry with scaled logits s, t: the differences to the rows' maxima first (exact where
// an entry is near its maximum), then the log-sums' difference.
template <typename T>
NB_HOST_DEVICE T log_ratio(T s, T t, const LogNormalizer<T>& norm_s, const LogNormalizer<T>& norm_t) {
  return ((s - norm_s.max) - (t - norm_t.max)) - (norm_s.log_sum - norm_t.log_sum);
}

// A skew KL at alpha = 1 may weigh the larger side 0, and then the smaller one exactly 1 (M is the smaller side):
// u = r is logged as -|d|, which does not underflow. q / M is 0 where q = 0 (0 / 0 there at alpha = 1).
template <typename T, typename Exp = StdExp>
NB_HOST_DEVICE Mixture<T> mixture(const DivergenceParams<T>& d, T log_p, T log_q, T log_p_over_q, Exp exp = Exp{}) {
  using std::fabs;
  const bool p_larger = !(log_p_over_q < T(0));  // NaN: either way, every quantity below is NaN
  const T abs_d = fabs(log_p_over_q);
  const T r = exp(-abs_d);
  const T larger = exp(p_larger ? log_p : log_q), smaller = larger * r;
  const T w_larger = p_larger ? d.one_minus_beta : d.beta, w_smaller = p_larger ? d.beta : d.one_minus_beta;
  const T u = w_larger + w_smaller * r;
  // u - 1 = w_S (r - 1) (w_L + w_S = 1): u itself rounds at 1's ulp, all of log u where it is small (p ~ M,
  // small weights; peaked rows in float32: 1.5-3x the log-add-exp form's error). log_near_one picks.
  const T log_u = w_larger == T(0) ? -abs_d : exp.log_u(u, w_smaller * (r - T(1)));
  Mixture<T> m;
  m.p = p_larger ? larger : smaller;
  m.q = p_larger ? smaller : larger;
  m.log_p_over_m = p_larger ? -log_u : -(abs_d + log_u);
  m.log_q_over_m = p_larger ? -(abs_d + log_u) : -log_u;
  m.q_over_m = m.q == T(0) ? T(0) : exp.over_u(p_larger ? r : T(1), u);
  return m;
}

// -1, 0 or 1; NaN for NaN (a row the non-finite rule makes undefined).
template <typename T>
NB_HOST_DEVICE T sign_of(T x) {
  return x != x ? x : T(x > T(0)) - T(x < T(0));
}

// TVD's sign(p_v - q_v), the sign of log p - log q, from the scaled logits s, t and the rows' log-normalizers;
// 0 at ties, and where p = q = 0; NaN in a row with a NaN log-normalizer or log-probability. An entry whose
// logits are equal (s = t) in rows whose log-normalizers agree to float32 rounding is a tie: two equal rows of
// logits (p = q) then give the sign 0 at every entry, where their normalizers, summed in different orders by
// the kernels, differ by an ulp that would make every entry's sign +-1 at random.
template <typename T>
NB_HOST_DEVICE T tvd_sign(T s, T t, const LogNormalizer<T>& norm_s, const LogNormalizer<T>& norm_t) {
  using std::fabs;
  constexpr T kEps = T(4) * T(std::numeric_limits<float>::epsilon());
  const T gap = (norm_s.max - norm_t.max) + (norm_s.log_sum - norm_t.log_sum);  // log q - log p where s = t
  if (s == t && fabs(gap) <= kEps * (T(1) + fabs(norm_s.log_sum) + fabs(norm_t.log_sum))) return T(0);
  const T log_p = log_prob(s, norm_s), log_q = log_prob(t, norm_t);
  return log_p == log_q ? T(0) : sign_of(log_p - log_q);  // equal: a tie, or p = q = 0 (-inf - -inf is NaN)
}

// w (log w - log M), the KL term of a side of probability w: 0 where w = 0 (whatever log M: -inf or NaN), NaN
// where w is NaN (the non-finite rule's undefined rows).
template <typename T>
NB_HOST_DEVICE T kl_term(T w, T log_w_over_m) {
  return w == T(0) ? T(0) : w * log_w_over_m;
}

// The two per-entry terms of the second pass, summed per row over the vocabulary (a, b):
//   JSD:              q (log q - log M),  p (log p - log M)    KL(q || M), KL(p || M)
//   skew forward KL:  q (log q - log M),  p q / M              the loss, the gradient's centre
//   skew reverse KL:  p (log p - log M),  p q / M
//   TVD:              |p - q|,            sign(p - q) p        (sign(0) = 0: tvd_sign; |p - q| as
//                                                                  sign(p - q) (p - q), 0 at ties)
// Entries where a side is 0 add 0 (kl_term); a NaN log-normalizer or log-probability makes its row's terms
// NaN. The product p q / M is p (q / M): 0 where p or q is 0.
template <typename T>
struct SecondPassTerms {
  T a, b;
};

// s, t: the entry's scaled logits; norm_s, norm_t: the rows' log-normalizers.
template <typename T, typename Exp = StdExp>
NB_HOST_DEVICE SecondPassTerms<T> second_pass_terms(const DivergenceParams<T>& d, T s, T t,
                                                    const LogNormalizer<T>& norm_s, const LogNormalizer<T>& norm_t,
                                                    Exp exp = Exp{}) {
  const T log_p = log_prob(s, norm_s), log_q = log_prob(t, norm_t);
  if (d.kind == Divergence::kTVD) {
    const T p = exp(log_p), sign = tvd_sign(s, t, norm_s, norm_t);
    return {sign * (p - exp(log_q)), sign * p};
  }
  // Entries where p = q = 0 add 0. In float64 math (float32 inputs) a branch skips them; in float32 math d = 0
  // there (a select, not a branch per entry) gives p = q = 0 and both terms 0 without one. As a select, the float64
  // mixture kernel of the training path spilled (32-48 bytes, sm_90a). Only both -inf: where equal finite log p and
  // log q round from an unequal d (log_ratio's is the exact one), d = 0 would drop terms that cancel over the row.
  const bool both_zero = log_p == kNegInf<T> && log_q == kNegInf<T>;
  T log_p_over_q;
  if constexpr (sizeof(T) == 8) {
    if (both_zero) return {T(0), T(0)};
    log_p_over_q = log_ratio(s, t, norm_s, norm_t);
  } else {
    log_p_over_q = both_zero ? T(0) : log_ratio(s, t, norm_s, norm_t);
  }
  const Mixture<T> m = mixture(d, log_p, log_q, log_p_over_q, exp);
  if (d.kind == Divergence::kJSD) return {kl_term(m.q, m.log_q_over_m), kl_term(m.p, m.log_p_over_m)};
  const T pq_over_m = kl_term(m.p, m.q_over_m);  // p q / M, 0 where p = 0 (q / M may be 0 / 0 there)
  if (d.kind == Divergence::kSkewForwardKL) return {kl_term(m.q, m.log_q_over_m), pq_over_m};
  return {kl_term(m.p, m.log_p_over_m), pq_over_m};  // the skew reverse KL
}

// A row's loss and gradient centre from its second-pass sums over the whole vocabulary.
template <typename T>
struct SecondPassRow {
  T loss, center;
};

template <typename T>
NB_HOST_DEVICE SecondPassRow<T> finish_second_pass(const DivergenceParams<T>& d, T a, T b) {
  switch (d.kind) {
    case Divergence::kSkewForwardKL:
      return {a, b};
    case Divergence::kSkewReverseKL:  // 1 - alpha = beta
      return {a, a + d.beta * b};
    case Divergence::kTVD:
      return {T(0.5) * a, b};
    default:
      return {d.beta * a + d.one_minus_beta * b, b};
  }
}

// dLoss/ds_v for one vocabulary entry (docs/design.md section 5), where s, t are the student's
// and teacher's temperature-scaled logits and norm_s, norm_t the rows' log-normalizers. Each is
// p_v (g_v - sum_u p_u g_u) with g = dLoss/dp, and `center` is the per-row sum the forward saved:
//   reverse KL:       E_p[s - t]. p (log p - log q - KL) = p ((s - t) - E_p[s - t]): the two
//                     log-normalizers cancel exactly, which keeps the gradient accurate when
//                     logits are ~1e4 and KL is a difference of two such numbers.
//   JSD:              KL(p || M), summed in the forward from the same log p - log M terms;
//                     (1 - beta) p (log p - log M - KL(p || M)).
//   skew forward KL:  sum p q / M;  -(1 - alpha) p (q / M - center).
//   skew reverse KL:  KL(p || M) + (1 - alpha) sum p q / M;  p (log p - log M + (1 - alpha) q / M - center).
//                     (dLoss/dp = log p - log M + 1 - alpha p / M, and alpha p / M = 1 - (1 - alpha) q / M:
//                     the constants cancel, and the q / M form keeps the gradient's error in proportion to it
//                     as alpha -> 1, where alpha p / M ~ alpha and the centre cancelled it at ~alpha / (1 - alpha)
//                     times the float32 reference's error.)
//   TVD:              sum sign(p - q) p;  1/2 p (sign(p - q) - center), with the subgradient
//                     sign(0) = 0 where p = q (tvd_sign).
//   forward KL:       unused.
// `exp` evaluates the probabilities and the mixture's ratio r (mixture). The callers give entries where p = 0
// (s = -inf) the gradient 0 without calling this, but forward KL's -q.
template <typename T, typename Exp = StdExp>
NB_HOST_DEVICE T divergence_grad(const DivergenceParams<T>& d, T s, T t, const LogNormalizer<T>& norm_s,
                                 const LogNormalizer<T>& norm_t, T center, Exp exp = Exp{}) {
  const T log_p = log_prob(s, norm_s), log_q = log_prob(t, norm_t);
  switch (d.kind) {
    case Divergence::kForwardKL:
      return exp(log_p) - exp(log_q);
    case Divergence::kReverseKL:
      return exp(log_p) * ((s - t) - center);
    case Divergence::kTVD:
      return T(0.5) * exp(log_p) * (tvd_sign(s, t, norm_s, norm_t) - center);
    default:
      break;
  }
  const Mixture<T> m = mixture(d, log_p, log_q, log_ratio(s, t, norm_s, norm_t), exp);
  if (m.p == T(0)) return T(0);  // p underflowed (the callers drop p = 0 exactly): no q / M of 0 / 0 or inf
  switch (d.kind) {
    case Divergence::kSkewForwardKL:
      return -d.one_minus_beta * m.p * (m.q_over_m - center);
    case Divergence::kSkewReverseKL:  // beta = 1 - alpha
      return m.p * (m.log_p_over_m + d.beta * m.q_over_m - center);
    default:
      return d.one_minus_beta * m.p * (m.log_p_over_m - center);
  }
}

}  // namespace nitrobrew
