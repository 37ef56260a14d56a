// CPU implementation of product_partials and product_grads (registration.cpp): the training path's
// stages over stored products, for vocabulary shards whose row states are merged across ranks between
// them (nitrobrew/distributed.py). The passes are those of fused_linear_grad_chunk_cpu.cpp, over the
// caller's products instead of its own (divergence/cpu_passes.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <vector>

#include "../divergence/cpu_passes.h"
#include "fused_linear_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

constexpr int64_t kRowStrideAlign = 8;  // the row stride of G, as fused_linear_grad_chunk's

// What both ops walk: zs and zt on the CPU in the accumulation dtype of `dtype` inputs (float64 for
// float64, else float32), the biases' first V entries in that dtype, and the rows not masked.
struct ProductWalk {
  at::Tensor bias_s, bias_t;  // [V], or undefined
  std::vector<uint8_t> valid;
};

ProductWalk product_walk(const at::Tensor& zs, const c10::optional<at::Tensor>& labels,
                         const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                         at::ScalarType dtype, const DistillParams& p) {
  TORCH_CHECK(zs.device().is_cpu(), "zs must be a CPU tensor here, got ", zs.device());
  TORCH_CHECK(at::isFloatingType(dtype), "dtype must be the inputs' floating dtype, got ", dtype);
  const at::ScalarType acc = dtype == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(zs.scalar_type() == acc, "zs must be in the accumulation dtype of ", dtype, " inputs, ", acc, ", got ",
              zs.scalar_type());
  auto take = [&](const c10::optional<at::Tensor>& b) {
    return b.has_value() ? b->narrow(0, 0, zs.size(1)).to(acc).contiguous() : at::Tensor();
  };
  return {take(bias_s), take(bias_t), row_mask(labels, p, /*check_label_range=*/false)};
}

at::Tensor product_partials_cpu(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                                const c10::optional<at::Tensor>& row_stats, int64_t ignore_index,
                                c10::string_view divergence, double beta, double temperature, double ce_weight,
                                c10::optional<double> softcap_s, c10::optional<double> softcap_t, double logit_scale_s,
                                double logit_scale_t, at::ScalarType dtype, bool entropy) {
  DistillParams p = make_product_params(zs, zt, labels, bias_s, bias_t, ignore_index, divergence, beta, temperature,
                                        ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t);
  p.entropy = entropy && !row_stats.has_value();  // the partials' pass only, not JSD's mixture pass
  const ProductWalk w = product_walk(zs, labels, bias_s, bias_t, dtype, p);
  if (row_stats.has_value()) check_shard_row_stats(*row_stats, p);
  GivenTiles source{zs, zt, w.bias_s, w.bias_t};
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES(zs.scalar_type(), "product_partials_cpu", [&] {
    out = row_stats.has_value() ? mixture_sums<scalar_t>(source, w.valid, *row_stats, p, zs.options())
                                : distill_partials<scalar_t>(source, labels, w.valid, p, zs.options());
  });
  return out.unsqueeze(0);  // one part: the shard's columns in one walk
}

at::Tensor product_grads_cpu(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                             const c10::optional<at::Tensor>& bias_s, const c10::optional<at::Tensor>& bias_t,
                             const at::Tensor& row_stats, const at::Tensor& row_scale, int64_t ignore_index,
                             c10::string_view divergence, double beta, double temperature, double ce_weight,
                             c10::optional<double> softcap_s, c10::optional<double> softcap_t, double logit_scale_s,
                             double logit_scale_t, at::ScalarType dtype) {
  const DistillParams p = make_product_params(zs, zt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                              temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
                                              logit_scale_t);
  const ProductWalk w = product_walk(zs, labels, bias_s, bias_t, dtype, p);
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == p.num_rows && row_stats.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] = [", p.num_rows, ", ", int(kNumRowStats),
              "] as merge_shards returns it, got ", row_stats.sizes());
  TORCH_CHECK(row_scale.dim() == 0, "row_scale must be a scalar tensor, got ", row_scale.sizes());
  GivenTiles source{zs, zt, w.bias_s, w.bias_t};
  const at::Tensor labels_c = labels.has_value() ? labels->contiguous() : at::Tensor();
  const int64_t n = p.num_rows, vocab = p.vocab_size;
  const int64_t ld = (vocab + kRowStrideAlign - 1) / kRowStrideAlign * kRowStrideAlign;
  at::Tensor grad = at::empty({n, ld}, zs.options()).narrow(1, 0, vocab);
  AT_DISPATCH_FLOATING_TYPES(zs.scalar_type(), "product_grads_cpu", [&] {
    const at::Tensor stats = row_stats.to(zs.scalar_type()).contiguous();
    const std::vector<scalar_t> row_grad(n, row_scale.item<scalar_t>());
    GradientPass<scalar_t> pass{p, w.valid.data(), labels.has_value() ? labels_c.data_ptr<int64_t>() : nullptr,
                                row_grad.data(), stats.data_ptr<scalar_t>(), divergence_params<scalar_t>(p)};
    pass.dzs = grad;
    walk_logit_tiles<scalar_t>(source, p, plan_tiles(p), zs.options(), pass);
  });
  return grad;  // the accumulation dtype, as fused_linear_grad_chunk's on the CPU
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) {
  m.impl("product_partials", &product_partials_cpu);
  m.impl("product_grads", &product_grads_cpu);
}

}  // namespace cpu
}  // namespace nitrobrew
