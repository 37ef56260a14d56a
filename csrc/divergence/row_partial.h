// A row's pass-1 state before it is finished: what vocabulary splits of one kernel, and vocabulary
// shards on different devices (nitrobrew.distributed), hand to the merge that finishes the row.
// The merge is associative, so a row's state merged over splits and then over shards is its state
// over the whole vocabulary (docs/design.md, section 3).
#pragma once

#include "nonfinite.h"
#include "online_state.h"
#include "row_stats.h"

namespace nitrobrew {

// Columns of a [N, kNumPartialFields] tensor of unfinished row states (the shard ops' output).
enum PartialField : int {
  kPartMaxW = 0,    // the KL state's weighting side (the teacher, the student for reverse KL)
  kPartSumW,
  kPartMaxO,        // its other side
  kPartSumO,
  kPartA,           // sum_v e^{w_v - m_w} (w_v - o_v)
  kPartMaxCE,       // the CE add-on's softmax state of the student's temperature-1 logits
  kPartSumCE,
  kPartLabelLogit,  // the student's logit at the row's label, 0 where this part does not hold it
  kPartMaxH,        // the student's entropy state (EntropyState), empty unless asked for
  kPartSumH,
  kPartCH,
  kNumPartialFields
};

template <typename T>
struct RowPartial {
  KLState<T> kl;
  SoftmaxState<T> ce;
  T label_logit = T(0);
  EntropyState<T> ent;  // the student's temperature-scaled logits, where asked for (DistillParams::entropy)
};

// Merges `part` into `into` where part's weighting side may be empty (every entry -inf): its other
// side still counts, which merge(KLState) would skip along with the rest.
template <typename T>
NB_HOST_DEVICE void merge_sides(KLState<T>& into, const KLState<T>& part) {
  if (part.w.m == kNegInf<T>) {
    merge(into.o, part.o);
  } else {
    merge(into, part);
  }
}

// Exactly one part holds a row's label, the others add 0.
template <typename T>
NB_HOST_DEVICE void merge(RowPartial<T>& into, const RowPartial<T>& part) {
  merge_sides(into.kl, part.kl);
  merge(into.ce, part.ce);
  into.label_logit += part.label_logit;
  merge(into.ent, part.ent);
}

template <typename T, typename S>
NB_HOST_DEVICE RowPartial<T> load_partial(const S* in) {
  RowPartial<T> r;
  r.kl.w = {T(in[kPartMaxW]), T(in[kPartSumW])};
  r.kl.o = {T(in[kPartMaxO]), T(in[kPartSumO])};
  r.kl.a = T(in[kPartA]);
  r.ce = {T(in[kPartMaxCE]), T(in[kPartSumCE])};
  r.label_logit = T(in[kPartLabelLogit]);
  r.ent = {T(in[kPartMaxH]), T(in[kPartSumH]), T(in[kPartCH])};
  return r;
}

template <typename T, typename S>
NB_HOST_DEVICE void store_partial(const RowPartial<T>& r, S* out) {
  out[kPartMaxW] = S(r.kl.w.m);
  out[kPartSumW] = S(r.kl.w.l);
  out[kPartMaxO] = S(r.kl.o.m);
  out[kPartSumO] = S(r.kl.o.l);
  out[kPartA] = S(r.kl.a);
  out[kPartMaxCE] = S(r.ce.m);
  out[kPartSumCE] = S(r.ce.l);
  out[kPartLabelLogit] = S(r.label_logit);
  out[kPartMaxH] = S(r.ent.m);
  out[kPartSumH] = S(r.ent.l);
  out[kPartCH] = S(r.ent.c);
}

// How a merged row is finished: the divergence's direction and the CE add-on.
struct RowFinish {
  bool weight_by_student;  // reverse KL
  double ce_weight;        // 0 = no CE add-on
  int64_t vocab_size;      // the labels' range [0, vocab_size)
};

// Finishes a row merged over the whole vocabulary into its row statistics (`row`, kNumRowStats
// columns) and returns its loss: the KL (a divergence with a second pass has its loss from finish_second_pass_row) plus
// the CE add-on at `label`. A side with no entry above -inf is an undefined distribution, and a
// label outside [0, vocab_size) an undefined cross-entropy: NaN (nonfinite.h), no device-side
// assertion (eager calls raise in Python first).
template <typename T>
NB_HOST_DEVICE T finish_row(const RowPartial<T>& st, const RowFinish& f, int64_t label, T* row) {
  if (st.kl.w.m == kNegInf<T> || st.kl.o.m == kNegInf<T>) {
    for (int k = 0; k < kNumRowStats; ++k) row[k] = kNaN<T>;
    return kNaN<T>;
  }
  T value = store_kl_row(finish_kl_row(st.kl, f.weight_by_student), row);
  row[kEntropyS] = entropy(st.ent);  // 0 where not asked for (an empty state)
  row[kMaxCE] = row[kLogSumCE] = T(0);
  if (f.ce_weight != 0.0) {
    LogNormalizer<T> norm_ce = log_normalizer(st.ce);
    if (label < 0 || label >= f.vocab_size) norm_ce.max = kNaN<T>;
    row[kMaxCE] = norm_ce.max;
    row[kLogSumCE] = norm_ce.log_sum;
    value -= T(f.ce_weight) * log_prob(st.label_logit, norm_ce);
  }
  return value;
}

// The loss of a divergence with a second pass (has_second_pass) from its sums (a, b) over the whole
// vocabulary (second_pass_terms), with the CE add-on of the row statistics finish_row wrote; the
// gradient's centre goes into the row statistics.
template <typename T, typename M>
NB_HOST_DEVICE T finish_second_pass_row(M a, M b, const DivergenceParams<M>& div, const RowFinish& f, T label_logit,
                                        T* row) {
  const SecondPassRow<M> r = finish_second_pass(div, a, b);
  row[kGradCenter] = static_cast<T>(r.center);
  T value = static_cast<T>(r.loss);
  if (f.ce_weight != 0.0) {
    value -= T(f.ce_weight) * log_prob(label_logit, LogNormalizer<T>{row[kMaxCE], row[kLogSumCE]});
  }
  return value;
}

}  // namespace nitrobrew
