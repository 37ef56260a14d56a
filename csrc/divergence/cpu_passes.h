// The passes of the distillation losses over logit tiles on the CPU, shared by the fused-linear
// ops (tiles from x . w^T) and the logit-level ops (tiles copied from the caller's logits): the
// same algorithm as the CUDA kernels (per-row online state, merge of partial states, recompute
// backward), fed by walk_logit_tiles (engine/cpu/tile_walk.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <limits>
#include <tuple>
#include <vector>

#include "../engine/cpu/tile_walk.h"
#include "distill_params.h"
#include "nonfinite.h"
#include "row_partial.h"

namespace nitrobrew {
namespace cpu {

// The walk of p's logits (engine/cpu/tile_walk.h).
inline TilePlan plan_tiles(const DistillParams& p) { return plan_tiles(p.num_rows, p.vocab_size, p.chunk_v); }

template <typename acc_t, typename Source, typename Visitor>
void walk_logit_tiles(Source& source, const DistillParams& p, const TilePlan& plan,
                      const at::TensorOptions& acc_options, Visitor& visitor) {
  walk_logit_tiles<acc_t>(source,
                          WalkShape{p.num_rows, p.vocab_size, p.softcap_s, p.softcap_t, p.logit_scale_s, p.logit_scale_t},
                          plan, acc_options, visitor);
}

// Rows whose label is ignore_index take no part in the loss. With check_label_range (a forward
// with the CE add-on over the whole vocabulary), a label outside [0, vocab_size) raises; a shard's
// forward and every backward take such labels as held by another shard (no column matches them).
inline std::vector<uint8_t> row_mask(const c10::optional<at::Tensor>& labels, const DistillParams& p,
                                     bool check_label_range) {
  std::vector<uint8_t> valid(p.num_rows, 1);
  if (!labels.has_value()) return valid;
  const at::Tensor l = labels->contiguous();
  const int64_t* label = l.data_ptr<int64_t>();
  for (int64_t n = 0; n < p.num_rows; ++n) {
    valid[n] = label[n] != p.ignore_index;
    TORCH_CHECK(!check_label_range || !valid[n] || p.ce_weight == 0.0 || (label[n] >= 0 && label[n] < p.vocab_size),
                "labels must be in [0, vocab_size = ", p.vocab_size, ") or equal ignore_index (",
                p.ignore_index, ") when ce_weight > 0; row ", n, " has label ", label[n]);
  }
  return valid;
}

// Pass 1: one-pass KL state per row (also gives the log-normalizers for JSD), plus the
// cross-entropy add-on's log-normalizer and label logit.
template <typename acc_t>
struct OnlineKLPass {
  const DistillParams& p;
  const uint8_t* valid;
  const int64_t* label;  // nullptr without labels
  std::vector<KLState<acc_t>> kl;
  std::vector<SoftmaxState<acc_t>> ce;
  std::vector<acc_t> label_logit;
  std::vector<EntropyState<acc_t>> ent;  // with p.entropy

  OnlineKLPass(const DistillParams& params, const uint8_t* valid_rows, const int64_t* labels)
      : p(params), valid(valid_rows), label(labels), kl(params.num_rows), ce(params.num_rows),
        label_logit(params.num_rows, acc_t(0)), ent(params.num_rows) {}

  void begin_vocab_tile(int64_t, int64_t) {}
  void end_row_chunk(const LogitTile&) {}
  void end_vocab_tile(int64_t, int64_t) {}

  void visit_row(int64_t n, int64_t v0, int64_t cols, const acc_t* zs, const acc_t* zt) {
    if (!valid[n]) return;
    const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);
    // Reverse KL is weighted by the student, forward KL (and JSD's first pass) by the teacher.
    const bool weight_by_student = p.kind == Divergence::kReverseKL;
    const acc_t* zw = weight_by_student ? zs : zt;
    const acc_t* zo = weight_by_student ? zt : zs;
    acc_t max_w = zw[0], max_o = zo[0];
    for (int64_t v = 1; v < cols; ++v) {  // a NaN is kept: it makes the row NaN (nonfinite.h)
      max_w = nan_max(max_w, zw[v]);
      max_o = nan_max(max_o, zo[v]);
    }
    // Entries of -inf (masked vocabulary, logit-level ops) have probability 0 and add nothing:
    // a tile whose entries are all -inf on one side leaves that side's state empty, and no term
    // ever forms -inf - -inf (0 log 0 = 0).
    KLState<acc_t> part;
    part.w.m = scale_logit(max_w, inv_t);
    part.o.m = scale_logit(max_o, inv_t);
    const auto sums = lane_sums<acc_t, 3>(cols, [&](int64_t v) {
      const acc_t w = scale_logit(zw[v], inv_t), o = scale_logit(zo[v], inv_t);
      const acc_t e = w == kNegInf<acc_t> ? acc_t(0) : exp_(w - part.w.m);
      return std::array<acc_t, 3>{e, e == acc_t(0) ? acc_t(0) : e * (w - o),
                                  o == kNegInf<acc_t> ? acc_t(0) : exp_(o - part.o.m)};
    });
    part.w.l = sums[0];
    part.a = sums[1];
    part.o.l = sums[2];
    merge_sides(kl[n], part);

    if (p.entropy) {  // the student's entropy, relative to its own maximum
      const acc_t* zstu = weight_by_student ? zw : zo;
      EntropyState<acc_t> ent_part;
      ent_part.m = weight_by_student ? part.w.m : part.o.m;
      if (ent_part.m != kNegInf<acc_t>) {
        const auto ent_sums = lane_sums<acc_t, 2>(cols, [&](int64_t v) {
          const acc_t d = scale_logit(zstu[v], inv_t) - ent_part.m;
          const acc_t e = exp_(d);
          return std::array<acc_t, 2>{e, e == acc_t(0) ? acc_t(0) : e * d};
        });
        ent_part.l = ent_sums[0];
        ent_part.c = ent_sums[1];
      }
      merge(ent[n], ent_part);
    }

    if (p.ce_weight != 0.0) {
      const acc_t max_s = weight_by_student ? max_w : max_o;
      SoftmaxState<acc_t> ce_part;
      ce_part.m = max_s;
      ce_part.l = lane_sums<acc_t, 1>(cols, [&](int64_t v) { return std::array<acc_t, 1>{exp_(zs[v] - max_s)}; })[0];
      merge(ce[n], ce_part);
      const int64_t y = label[n];
      if (y >= v0 && y < v0 + cols) label_logit[n] = zs[y - v0];
    }
  }
};

// Pass 2 of the divergences that have one (has_second_pass: JSD, the skew KLs, TVD): with the
// log-normalizers known, sums second_pass_terms' (a, b) per row, in float64 whatever the tiles' type:
// JSD's terms q (log q - log M) are differences of nearly equal numbers when p ~ q, and in float32 a JSD
// of ~1e-8 per row came out off by up to 50% (float32 PyTorch: up to 800%); float64 from the same
// float32 row statistics is exact to ~1e-13.
template <typename acc_t>
struct MixturePass {
  using mix_t = double;
  const DistillParams& p;
  const uint8_t* valid;
  const acc_t* stats;  // [N, kNumRowStats]
  DivergenceParams<mix_t> div;
  std::vector<mix_t> sum_a, sum_b;

  MixturePass(const DistillParams& params, const uint8_t* valid_rows, const acc_t* row_stats)
      : p(params), valid(valid_rows), stats(row_stats),
        div(divergence_params<mix_t>(params)), sum_a(params.num_rows, mix_t(0)),
        sum_b(params.num_rows, mix_t(0)) {}

  void begin_vocab_tile(int64_t, int64_t) {}
  void end_row_chunk(const LogitTile&) {}
  void end_vocab_tile(int64_t, int64_t) {}

  void visit_row(int64_t n, int64_t, int64_t cols, const acc_t* zs, const acc_t* zt) {
    if (!valid[n]) return;
    // The scaled logits rounded as in the other passes (then widened): the backward's gradient
    // centre must come from the same s and t.
    const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);
    const acc_t* row = stats + n * kNumRowStats;
    const LogNormalizer<mix_t> norm_s{row[kMaxS], row[kLogSumS]}, norm_t{row[kMaxT], row[kLogSumT]};
    const auto sums = lane_sums<mix_t, 2>(cols, [&](int64_t v) {
      const SecondPassTerms<mix_t> terms = second_pass_terms(div, static_cast<mix_t>(scale_logit(zs[v], inv_t)),
                                                             static_cast<mix_t>(scale_logit(zt[v], inv_t)), norm_s, norm_t);
      return std::array<mix_t, 2>{terms.a, terms.b};
    });
    sum_a[n] += sums[0];
    sum_b[n] += sums[1];
  }
};

// Pass 1 over the tiles `source` fills: every row's unfinished state, [N, kNumPartialFields] in
// acc_t (masked rows hold empty states). A label outside [0, vocab_size) is no column's.
template <typename acc_t, typename Source>
at::Tensor distill_partials(Source& source, const c10::optional<at::Tensor>& labels, const std::vector<uint8_t>& valid,
                            const DistillParams& p, const at::TensorOptions& acc_options) {
  const at::Tensor labels_c = labels.has_value() ? labels->contiguous() : at::Tensor();
  OnlineKLPass<acc_t> kl_pass(p, valid.data(), labels.has_value() ? labels_c.data_ptr<int64_t>() : nullptr);
  walk_logit_tiles<acc_t>(source, p, plan_tiles(p), acc_options, kl_pass);
  at::Tensor partials = at::empty({p.num_rows, kNumPartialFields}, acc_options);
  acc_t* out = partials.data_ptr<acc_t>();
  for (int64_t n = 0; n < p.num_rows; ++n) {
    store_partial(RowPartial<acc_t>{kl_pass.kl[n], kl_pass.ce[n], kl_pass.label_logit[n], kl_pass.ent[n]},
                  out + n * kNumPartialFields);
  }
  return partials;
}

// Pass 2 (has_second_pass) over the tiles `source` fills, with the log-normalizers of row_stats (over the
// whole vocabulary): second_pass_terms' sums of these tiles per row, [N, 2] in float64.
template <typename acc_t, typename Source>
at::Tensor mixture_sums(Source& source, const std::vector<uint8_t>& valid, const at::Tensor& row_stats,
                        const DistillParams& p, const at::TensorOptions& acc_options) {
  const at::Tensor stats_c = row_stats.to(acc_options.dtype()).contiguous();
  MixturePass<acc_t> mix(p, valid.data(), stats_c.data_ptr<acc_t>());
  walk_logit_tiles<acc_t>(source, p, plan_tiles(p), acc_options, mix);
  at::Tensor sums = at::empty({p.num_rows, 2}, acc_options.dtype(at::kDouble));
  double* out = sums.data_ptr<double>();
  for (int64_t n = 0; n < p.num_rows; ++n) {
    out[2 * n] = mix.sum_a[n];
    out[2 * n + 1] = mix.sum_b[n];
  }
  return sums;
}

// Merges each row's R parts (partials [R, N, kNumPartialFields], in part order) and finishes the
// row: (loss [N], row_stats [N, kNumRowStats]) in acc_t, masked rows 0. A second pass's loss needs its
// sums ([R, N, 2] float64, summed over the parts; without them only the row statistics'
// log-normalizers are final, which pass 2 reads). Labels are the whole vocabulary's.
template <typename acc_t>
std::tuple<at::Tensor, at::Tensor> finish_rows(const at::Tensor& partials, const c10::optional<at::Tensor>& mixture,
                                               const c10::optional<at::Tensor>& labels,
                                               const std::vector<uint8_t>& valid, const DistillParams& p) {
  const at::Tensor parts = partials.contiguous();
  const at::Tensor labels_c = labels.has_value() ? labels->contiguous() : at::Tensor();
  const at::Tensor mix = mixture.has_value() ? mixture->to(at::kDouble).contiguous() : at::Tensor();
  const int64_t num_parts = parts.size(0);
  at::Tensor loss = at::zeros({p.num_rows}, parts.options());
  at::Tensor row_stats = at::zeros({p.num_rows, kNumRowStats}, parts.options());
  acc_t* loss_ = loss.data_ptr<acc_t>();
  acc_t* stats_ = row_stats.data_ptr<acc_t>();
  const RowFinish finish{p.kind == Divergence::kReverseKL, p.ce_weight, p.vocab_size};
  const DivergenceParams<double> div = divergence_params<double>(p);
  for (int64_t n = 0; n < p.num_rows; ++n) {
    if (!valid[n]) continue;
    RowPartial<acc_t> st;
    double sum_a = 0.0, sum_b = 0.0;
    for (int64_t r = 0; r < num_parts; ++r) {
      merge(st, load_partial<acc_t>(parts.data_ptr<acc_t>() + (r * p.num_rows + n) * kNumPartialFields));
      if (mix.defined()) {
        sum_a += mix.data_ptr<double>()[(r * p.num_rows + n) * 2];
        sum_b += mix.data_ptr<double>()[(r * p.num_rows + n) * 2 + 1];
      }
    }
    acc_t* row = stats_ + n * kNumRowStats;
    const int64_t label = labels.has_value() ? labels_c.data_ptr<int64_t>()[n] : 0;
    loss_[n] = finish_row(st, finish, label, row);
    if (mix.defined() && has_second_pass(p.kind)) {
      loss_[n] = finish_second_pass_row(sum_a, sum_b, div, finish, st.label_logit, row);
    }
  }
  return {loss, row_stats};
}

// The forward of every op over the whole vocabulary: pass 1 (and pass 2 where the divergence has one) over the tiles
// `source` fills; returns (loss [N], row_stats [N, kNumRowStats]) in acc_t.
template <typename acc_t, typename Source>
std::tuple<at::Tensor, at::Tensor> distill_forward(Source& source, const c10::optional<at::Tensor>& labels,
                                                   const DistillParams& p, const at::TensorOptions& acc_options) {
  const std::vector<uint8_t> valid = row_mask(labels, p, /*check_label_range=*/true);
  const at::Tensor partials = distill_partials<acc_t>(source, labels, valid, p, acc_options).unsqueeze(0);
  auto [loss, row_stats] = finish_rows<acc_t>(partials, c10::nullopt, labels, valid, p);
  if (!has_second_pass(p.kind)) return {loss, row_stats};
  const at::Tensor mixture = mixture_sums<acc_t>(source, valid, row_stats, p, acc_options).unsqueeze(0);
  return finish_rows<acc_t>(partials, mixture, labels, valid, p);
}

// Backward: recomputes each logit tile, turns it into G = g_n * dLoss/dz in place (z: the product
// x . w^T + bias before the logit scale, whose factor G includes), and either accumulates
// dxs += G . ws_tile, dws_tile = G^T . xs and dbias += column sums of G with the BLAS (fused-linear
// ops) or writes G out as dzs (logit-level ops).
template <typename acc_t>
struct GradientPass {
  const DistillParams& p;
  const uint8_t* valid;
  const int64_t* label;
  const acc_t* grad;   // [N] upstream gradient per row
  const acc_t* stats;  // [N, kNumRowStats]
  DivergenceParams<acc_t> div;
  at::Tensor dxs_acc;       // [N, D_s] or undefined
  at::Tensor dws;           // [V_rows, D_s] in the input dtype, or undefined
  at::Tensor dws_tile_acc;  // [vocab_tile, D_s]
  at::Tensor dzs;           // [N, V] (logit-level ops), or undefined
  at::Tensor dbias_acc;     // [V_rows] in the accumulation dtype, or undefined

  void begin_vocab_tile(int64_t, int64_t cols) {
    if (dws.defined()) dws_tile_acc.narrow(0, 0, cols).zero_();
  }

  void visit_row(int64_t n, int64_t v0, int64_t cols, acc_t* zs, const acc_t* zt) {
    if (!valid[n]) {
      std::fill(zs, zs + cols, acc_t(0));
      return;
    }
    const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);
    const acc_t cap_s = static_cast<acc_t>(p.softcap_s);
    const acc_t g = grad[n] * static_cast<acc_t>(p.logit_scale_s);
    const acc_t ce_weight = static_cast<acc_t>(p.ce_weight);
    const int64_t y = label != nullptr ? label[n] - v0 : -1;
    const acc_t* row = stats + n * kNumRowStats;
    const LogNormalizer<acc_t> norm_s{row[kMaxS], row[kLogSumS]}, norm_t{row[kMaxT], row[kLogSumT]};
    const LogNormalizer<acc_t> norm_ce{row[kMaxCE], row[kLogSumCE]};
    if (norm_s.max != norm_s.max || norm_t.max != norm_t.max) {  // an undefined row: NaN throughout
      std::fill(zs, zs + cols, kNaN<acc_t>);
      return;
    }
    // A student entry of -inf has probability 0: its gradient is -q (forward KL) or 0, never the
    // 0 * inf that the other divergences' formulas would form.
    const bool zero_at_masked = div.kind != Divergence::kForwardKL;
    for (int64_t v = 0; v < cols; ++v) {
      const acc_t z = zs[v];
      const acc_t s = scale_logit(z, inv_t), t = scale_logit(zt[v], inv_t);
      if (zero_at_masked && s == kNegInf<acc_t>) {
        zs[v] = acc_t(0);
        continue;
      }
      acc_t dz = divergence_grad(div, s, t, norm_s, norm_t, row[kGradCenter]) * inv_t;
      if (ce_weight != acc_t(0)) dz += ce_weight * (exp_(log_prob(z, norm_ce)) - acc_t(v == y ? 1 : 0));
      zs[v] = g * dz * softcap_grad_from_capped(z, cap_s);
    }
  }

  void end_row_chunk(const LogitTile& tile) {
    const at::Tensor& g = tile.zs;  // [rows, cols], now holds G
    if (dzs.defined()) dzs.narrow(0, tile.r0, tile.rows).narrow(1, tile.v0, tile.cols).copy_(g);
    if (dxs_acc.defined()) dxs_acc.narrow(0, tile.r0, tile.rows).addmm_(g, tile.ws_tile);
    if (dws.defined()) dws_tile_acc.narrow(0, 0, tile.cols).addmm_(g.t(), tile.xs_rows);
    if (dbias_acc.defined()) dbias_acc.narrow(0, tile.v0, tile.cols).add_(g.sum(0));
  }

  void end_vocab_tile(int64_t v0, int64_t cols) {
    if (dws.defined()) dws.narrow(0, v0, cols).copy_(dws_tile_acc.narrow(0, 0, cols));
  }
};

// The backward's per-row inputs as the forward returned them.
inline void check_backward_inputs(const at::Tensor& grad_loss, const at::Tensor& row_stats,
                                  const DistillParams& p) {
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == p.num_rows,
              "grad_loss must be [N] = [", p.num_rows, "], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == p.num_rows && row_stats.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] = [", p.num_rows, ", ", int(kNumRowStats),
              "] as the forward returns it, got ", row_stats.sizes());
  TORCH_CHECK(grad_loss.device().is_cpu() && row_stats.device().is_cpu(),
              "grad_loss and row_stats must be CPU tensors here");
}

// The whole vocabulary's row statistics that a shard's pass 2 reads (has_second_pass).
inline void check_shard_row_stats(const at::Tensor& row_stats, const DistillParams& p) {
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == p.num_rows && row_stats.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] = [", p.num_rows, ", ", int(kNumRowStats),
              "] as merge_shards returns it, got ", row_stats.sizes());
  TORCH_CHECK(row_stats.device().is_cpu(), "row_stats must be a CPU tensor here");
  TORCH_CHECK(has_second_pass(p.kind), "row_stats are given only to a second pass (jsd, the skew KLs, tvd)");
}

}  // namespace cpu
}  // namespace nitrobrew
