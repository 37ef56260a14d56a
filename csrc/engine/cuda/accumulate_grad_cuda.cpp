// CUDA kernel of nitrobrew::accumulate_grad (registration.cpp): acc [V, D] float32 = g^T . x + beta * acc
// with cuBLAS, 16-bit operands, float32 accumulation and a float32 C: dws summed over the training path's
// chunks with one rounding, at the end (_forward_grads.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cublas_gemm.h"

namespace nitrobrew {
namespace cuda {
namespace {

void accumulate_grad_cuda(const at::Tensor& acc, const at::Tensor& g, const at::Tensor& x, double beta) {
  TORCH_CHECK(acc.dim() == 2 && g.dim() == 2 && x.dim() == 2 && acc.size(0) == g.size(1) && acc.size(1) == x.size(1) &&
                  g.size(0) == x.size(0),
              "acc must be [V, D], g [N, V] and x [N, D], got ", acc.sizes(), ", ", g.sizes(), " and ", x.sizes());
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.is_contiguous(), "acc must be a contiguous float32 tensor, got ",
              acc.scalar_type());
  TORCH_CHECK(g.scalar_type() == x.scalar_type() &&
                  (g.scalar_type() == at::kBFloat16 || g.scalar_type() == at::kHalf || g.scalar_type() == at::kFloat),
              "g and x must share one dtype (bfloat16, float16 or float32), got ", g.scalar_type(), " and ",
              x.scalar_type());
  TORCH_CHECK(g.stride(1) == 1 && x.stride(1) == 1, "g and x must have unit-stride rows");
  TORCH_CHECK(acc.device() == g.device() && g.device() == x.device(), "acc, g and x must be on one device");
  if (acc.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(acc.device());
  if (g.size(0) == 0) {  // no token: beta * acc (beta 0 ignores what acc held, as cuBLAS does)
    beta == 0.0 ? acc.zero_() : acc.mul_(beta);
    return;
  }
  // Row-major acc [V x D] is column-major acc^T [D x V] = x^T [D x N] . g [N x V]: row-major x read
  // column-major is x^T (no transpose), row-major g read column-major is g^T (transposed back).
  gemm(/*trans_a=*/false, /*trans_b=*/true, x.size(1), g.size(1), g.size(0), x.data_ptr(), x.stride(0), g.data_ptr(),
       g.stride(0), x.scalar_type(), static_cast<float>(beta), acc.data_ptr(), at::kFloat, acc.stride(0));
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("accumulate_grad", &accumulate_grad_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
