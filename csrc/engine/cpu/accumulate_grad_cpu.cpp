// CPU kernel of nitrobrew::accumulate_grad (registration.cpp): acc = g^T . x + beta * acc in acc's dtype.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace nitrobrew {
namespace cpu {
namespace {

void accumulate_grad_cpu(const at::Tensor& acc, const at::Tensor& g, const at::Tensor& x, double beta) {
  TORCH_CHECK(acc.dim() == 2 && g.dim() == 2 && x.dim() == 2 && acc.size(0) == g.size(1) && acc.size(1) == x.size(1) &&
                  g.size(0) == x.size(0),
              "acc must be [V, D], g [N, V] and x [N, D], got ", acc.sizes(), ", ", g.sizes(), " and ", x.sizes());
  at::Tensor out = acc;  // addmm_ into the caller's buffer
  out.addmm_(g.t().to(acc.scalar_type()), x.to(acc.scalar_type()), beta, 1.0);
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) { m.impl("accumulate_grad", &accumulate_grad_cpu); }

}  // namespace cpu
}  // namespace nitrobrew
