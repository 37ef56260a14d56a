// CPU kernel of nitrobrew::scaled (registration.cpp): x times a scalar tensor, computed in float32
// (float64 for float64 x) and returned in x's dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace nitrobrew {
namespace cpu {
namespace {

at::Tensor scaled_cpu(const at::Tensor& x, const at::Tensor& factor) {
  TORCH_CHECK(factor.dim() == 0 && factor.device() == x.device(), "factor must be a scalar tensor on ", x.device(),
              ", got ", factor.sizes(), " on ", factor.device());
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::mul(x.to(acc), factor.to(acc)).to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) { m.impl("scaled", &scaled_cpu); }

}  // namespace cpu
}  // namespace nitrobrew
