// CPU implementation of the logit-level distillation ops (nitrobrew.logits): the fused-linear
// passes (divergence/cpu_passes.h) over tiles copied from the caller's [N, V] logits, converted to
// float32 (float64 for float64 inputs) one tile at a time.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <tuple>

#include "../divergence/cpu_passes.h"
#include "logits_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> logits_fwd_cpu(const at::Tensor& zs, const at::Tensor& zt,
                                                        const c10::optional<at::Tensor>& labels,
                                                        int64_t ignore_index, c10::string_view divergence, double beta, double temperature) {
  const DistillParams p = make_logits_params(zs, zt, labels, ignore_index, divergence, beta, temperature);
  TORCH_CHECK(zs.device().is_cpu(), "zs must be a CPU tensor here, got ", zs.device());
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "logits_fwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    GivenTiles source{zs, zt};
    out = distill_forward<acc_t>(source, labels, p, zs.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
  });
  return out;
}

// A vocabulary shard's forward (nitrobrew.distributed): pass 1's unfinished row states, or with
// row_stats (the whole vocabulary's log-normalizers) JSD's mixture sums over this shard.
at::Tensor logits_shard_cpu(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                                const c10::optional<at::Tensor>& row_stats, int64_t ignore_index,
                                c10::string_view divergence, double beta, double temperature) {
  const DistillParams p = make_logits_params(zs, zt, labels, ignore_index, divergence, beta, temperature);
  TORCH_CHECK(zs.device().is_cpu(), "zs must be a CPU tensor here, got ", zs.device());
  if (row_stats.has_value()) check_shard_row_stats(*row_stats, p);
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "logits_shard_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto acc_options = zs.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const std::vector<uint8_t> valid = row_mask(labels, p, /*check_label_range=*/false);
    GivenTiles source{zs, zt};
    out = row_stats.has_value() ? mixture_sums<acc_t>(source, valid, *row_stats, p, acc_options)
                                : distill_partials<acc_t>(source, labels, valid, p, acc_options);
  });
  return out;
}

at::Tensor logits_bwd_cpu(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& zt,
                                 const c10::optional<at::Tensor>& labels, const at::Tensor& row_stats,
                                 int64_t ignore_index, c10::string_view divergence, double beta, double temperature) {
  const DistillParams p = make_logits_params(zs, zt, labels, ignore_index, divergence, beta, temperature);
  TORCH_CHECK(zs.device().is_cpu(), "zs must be a CPU tensor here, got ", zs.device());
  check_backward_inputs(grad_loss, row_stats, p);
  at::Tensor dzs = at::empty(zs.sizes(), zs.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "logits_bwd_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto acc_options = zs.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    const at::Tensor labels_c = labels.has_value() ? labels->contiguous() : at::Tensor();
    const std::vector<uint8_t> valid = row_mask(labels, p, /*check_label_range=*/false);
    const at::Tensor grad_c = grad_loss.to(acc_options.dtype()).contiguous();
    const at::Tensor stats_c = row_stats.to(acc_options.dtype()).contiguous();
    GradientPass<acc_t> pass{p, valid.data(), labels.has_value() ? labels_c.data_ptr<int64_t>() : nullptr,
                             grad_c.data_ptr<acc_t>(), stats_c.data_ptr<acc_t>(), divergence_params<acc_t>(p)};
    pass.dzs = dzs;  // each tile's G, converted to the logits' dtype as it is copied out
    GivenTiles source{zs, zt};
    walk_logit_tiles<acc_t>(source, p, plan_tiles(p), acc_options, pass);
  });
  return dzs;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) {
  m.impl("logits_fwd", &logits_fwd_cpu);
  m.impl("logits_bwd", &logits_bwd_cpu);
  m.impl("logits_shard", &logits_shard_cpu);
}

}  // namespace cpu
}  // namespace nitrobrew
