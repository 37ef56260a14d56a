// CPU implementation of the fused-linear distillation ops: the same tiled algorithm as
// the CUDA kernels (vocabulary tiles, per-row online state in float32, merge of
// partial states, recompute backward), with the tile GEMMs done by ATen's BLAS.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../divergence/cpu_passes.h"
#include "fused_linear_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

// The lm_head biases, if given, in the accumulation dtype.
struct Biases {
  const c10::optional<at::Tensor>& s;
  const c10::optional<at::Tensor>& t;
};

ProductTiles product_tiles(const at::Tensor& xs_acc, const at::Tensor& xt_acc, const at::Tensor& ws,
                           const at::Tensor& wt, const Biases& bias) {
  ProductTiles source{xs_acc, xt_acc, ws, wt};
  if (bias.s.has_value()) source.bias_s = bias.s->to(xs_acc.scalar_type());
  if (bias.t.has_value()) source.bias_t = bias.t->to(xs_acc.scalar_type());
  return source;
}

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor> fused_linear_forward(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const Biases& bias, const DistillParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor xs_acc = xs.to(acc_dtype).contiguous();
  const at::Tensor xt_acc = xt.to(acc_dtype).contiguous();
  ProductTiles source = product_tiles(xs_acc, xt_acc, ws, wt, bias);
  return distill_forward<acc_t>(source, labels, p, xs_acc.options());
}

// A vocabulary shard's forward (nitrobrew.distributed): pass 1's unfinished row states, or with
// row_stats (the whole vocabulary's log-normalizers) JSD's mixture sums over this shard.
template <typename scalar_t>
at::Tensor fused_linear_shard_forward(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                      const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                      const Biases& bias, const c10::optional<at::Tensor>& row_stats,
                                      const DistillParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor xs_acc = xs.to(acc_dtype).contiguous();
  const at::Tensor xt_acc = xt.to(acc_dtype).contiguous();
  ProductTiles source = product_tiles(xs_acc, xt_acc, ws, wt, bias);
  const std::vector<uint8_t> valid = row_mask(labels, p, /*check_label_range=*/false);
  if (row_stats.has_value()) return mixture_sums<acc_t>(source, valid, *row_stats, p, xs_acc.options());
  return distill_partials<acc_t>(source, labels, valid, p, xs_acc.options());
}

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_linear_backward(
    const at::Tensor& grad_loss, const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
    const at::Tensor& wt, const c10::optional<at::Tensor>& labels, const Biases& bias, const at::Tensor& row_stats,
    const DistillParams& p, bool compute_dxs, bool compute_dws, bool compute_dbias) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor xs_acc = xs.to(acc_dtype).contiguous();
  const at::Tensor xt_acc = xt.to(acc_dtype).contiguous();
  const at::Tensor labels_c = labels.has_value() ? labels->contiguous() : at::Tensor();
  const std::vector<uint8_t> valid = row_mask(labels, p, /*check_label_range=*/false);
  const TilePlan plan = plan_tiles(p);
  const at::Tensor grad_c = grad_loss.to(acc_dtype).contiguous();
  const at::Tensor stats_c = row_stats.to(acc_dtype).contiguous();

  GradientPass<acc_t> pass{p, valid.data(), labels.has_value() ? labels_c.data_ptr<int64_t>() : nullptr,
                           grad_c.data_ptr<acc_t>(), stats_c.data_ptr<acc_t>(), divergence_params<acc_t>(p)};
  if (compute_dxs) pass.dxs_acc = at::zeros({p.num_rows, p.hidden_s}, xs_acc.options());
  if (compute_dws) {
    pass.dws = at::zeros_like(ws, at::MemoryFormat::Contiguous);  // padded rows past vocab_size stay 0
    pass.dws_tile_acc = at::empty({plan.vocab_tile, p.hidden_s}, xs_acc.options());
  }
  compute_dbias = compute_dbias && bias.s.has_value();
  if (compute_dbias) pass.dbias_acc = at::zeros({ws.size(0)}, xs_acc.options());  // padded rows stay 0
  ProductTiles source = product_tiles(xs_acc, xt_acc, ws, wt, bias);
  walk_logit_tiles<acc_t>(source, p, plan, xs_acc.options(), pass);

  at::Tensor dxs = compute_dxs ? pass.dxs_acc.to(xs.scalar_type()) : at::empty({0}, xs.options());
  at::Tensor dws = compute_dws ? pass.dws : at::empty({0}, ws.options());
  at::Tensor dbias = compute_dbias ? pass.dbias_acc.to(ws.scalar_type()) : at::empty({0}, ws.options());
  return {dxs, dws, dbias};
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor here, got ", t.device());
}

std::tuple<at::Tensor, at::Tensor> fused_linear_fwd_cpu(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, int64_t ignore_index, c10::string_view divergence, double beta,
    double temperature, double ce_weight, c10::optional<double> softcap_s, c10::optional<double> softcap_t,
    double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v, bool entropy) {
  DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                             temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t,
                                             vocab_size, chunk_v);
  p.entropy = entropy;
  check_cpu(xs, "xs");
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "fused_linear_fwd_cpu", [&] {
    out = fused_linear_forward<scalar_t>(xs, xt, ws, wt, labels, Biases{bias_s, bias_t}, p);
  });
  return out;
}

at::Tensor fused_linear_shard_cpu(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const c10::optional<at::Tensor>& row_stats, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v,
    bool entropy) {
  DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                             temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t,
                                             vocab_size, chunk_v);
  p.entropy = entropy && !row_stats.has_value();  // the partials' pass only, not JSD's mixture pass
  check_cpu(xs, "xs");
  if (row_stats.has_value()) check_shard_row_stats(*row_stats, p);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "fused_linear_shard_cpu", [&] {
    out = fused_linear_shard_forward<scalar_t>(xs, xt, ws, wt, labels, Biases{bias_s, bias_t}, row_stats, p);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_linear_bwd_cpu(
    const at::Tensor& grad_loss, const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
    const at::Tensor& wt, const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const at::Tensor& row_stats, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size, int64_t chunk_v,
    bool compute_dxs, bool compute_dws, bool compute_dbias_s) {
  const DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence,
                                                   beta, temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
                                                   logit_scale_t, vocab_size, chunk_v);
  check_cpu(xs, "xs");
  check_backward_inputs(grad_loss, row_stats, p);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "fused_linear_bwd_cpu", [&] {
    out = fused_linear_backward<scalar_t>(grad_loss, xs, xt, ws, wt, labels, Biases{bias_s, bias_t}, row_stats, p,
                                          compute_dxs, compute_dws, compute_dbias_s);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) {
  m.impl("fused_linear_fwd", &fused_linear_fwd_cpu);
  m.impl("fused_linear_bwd", &fused_linear_bwd_cpu);
  m.impl("fused_linear_shard", &fused_linear_shard_cpu);
}

}  // namespace cpu
}  // namespace nitrobrew
