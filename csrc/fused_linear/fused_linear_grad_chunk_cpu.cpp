// CPU implementation of fused_linear_grad_chunk, the training path's step over a chunk of tokens
// (nitrobrew/_forward_grads.py): for every `product_rows` rows, both models' products are formed once
// with the BLAS in the accumulation dtype and stored, and the CPU passes (divergence/cpu_passes.h) run
// over them: pass 1 (and JSD's pass 2) for the rows' losses, then the gradient pass writes
// G = dLoss/dz. The caller forms dxs, dws and dbias_s from G: four products in all, as on CUDA.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "../divergence/cpu_passes.h"
#include "../engine/cpu/products.h"
#include "fused_linear_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

constexpr int64_t kRowStrideAlign = 8;  // the row stride of G, as on CUDA

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> grad_chunk(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                              const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                              const c10::optional<at::Tensor>& bias_s,
                                              const c10::optional<at::Tensor>& bias_t, const at::Tensor& row_scale,
                                              const DistillParams& p, int64_t product_rows) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const at::Tensor xs_acc = xs.to(acc_dtype).contiguous();
  const at::Tensor xt_acc = xt.to(acc_dtype).contiguous();
  const auto options = xs_acc.options();
  const int64_t n = p.num_rows, vocab = p.vocab_size;
  const int64_t ld = (vocab + kRowStrideAlign - 1) / kRowStrideAlign * kRowStrideAlign;
  at::Tensor loss = at::empty({n}, options);
  at::Tensor grad = at::empty({n, ld}, options).narrow(1, 0, vocab);
  at::Tensor entropy = at::zeros({p.entropy ? n : 0}, options);  // masked rows: 0
  const acc_t scale = row_scale.item<acc_t>();
  const at::Tensor bs = bias_s.has_value() ? bias_s->to(acc_dtype) : at::Tensor();
  const at::Tensor bt = bias_t.has_value() ? bias_t->to(acc_dtype) : at::Tensor();
  const int64_t rows = std::max<int64_t>(1, std::min(product_rows, n));
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t count = std::min(rows, n - r0);
    DistillParams pc = p;  // the step's rows
    pc.num_rows = count;
    const c10::optional<at::Tensor> labels_c =
        labels.has_value() ? c10::optional<at::Tensor>(labels->narrow(0, r0, count).contiguous()) : c10::nullopt;
    const TilePlan plan = plan_tiles(pc);
    at::Tensor zs = at::empty({count, vocab}, options), zt = at::empty({count, vocab}, options);
    store_products(xs_acc.narrow(0, r0, count), ws, zs, plan.vocab_tile);
    store_products(xt_acc.narrow(0, r0, count), wt, zt, plan.vocab_tile);
    GivenTiles source{zs, zt, bs, bt};
    at::Tensor loss_c, stats_c;
    std::tie(loss_c, stats_c) = distill_forward<acc_t>(source, labels_c, pc, options);
    loss.narrow(0, r0, count).copy_(loss_c);
    if (p.entropy) entropy.narrow(0, r0, count).copy_(stats_c.select(1, kEntropyS));

    const std::vector<uint8_t> valid = row_mask(labels_c, pc, /*check_label_range=*/false);
    const std::vector<acc_t> row_grad(count, scale);
    GradientPass<acc_t> pass{pc, valid.data(), labels_c.has_value() ? labels_c->data_ptr<int64_t>() : nullptr,
                             row_grad.data(), stats_c.data_ptr<acc_t>(), divergence_params<acc_t>(pc)};
    pass.dzs = grad.narrow(0, r0, count);
    walk_logit_tiles<acc_t>(source, pc, plan, options, pass);
  }
  return {loss, grad, entropy};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_linear_grad_chunk_cpu(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const at::Tensor& row_scale, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size,
    int64_t product_rows, bool entropy) {
  DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                             temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t,
                                             vocab_size, /*chunk_v=*/0);
  p.entropy = entropy;
  TORCH_CHECK(xs.device().is_cpu(), "xs must be a CPU tensor here, got ", xs.device());
  TORCH_CHECK(row_scale.dim() == 0 && row_scale.device().is_cpu(), "row_scale must be a scalar CPU tensor, got ",
              row_scale.sizes(), " on ", row_scale.device());
  TORCH_CHECK(product_rows >= 1, "product_rows must be positive, got ", product_rows);
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "fused_linear_grad_chunk_cpu", [&] {
    out = grad_chunk<scalar_t>(xs, xt, ws, wt, labels, bias_s, bias_t, row_scale, p, product_rows);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) { m.impl("fused_linear_grad_chunk", &fused_linear_grad_chunk_cpu); }

}  // namespace cpu
}  // namespace nitrobrew
