// CUDA implementation of nitrobrew::products (registration.cpp): cuBLAS's product x . w[:vocab]^T with
// a float32 output (the GEMM's only rounding), rows padded to a stride of 8 entries.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cublas_gemm.h"
#include "vocab_walk.h"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int64_t kRowStrideAlign = 8;  // 32 bytes: the logits kernels' 16-byte loads stay aligned

at::Tensor products_cuda(const at::Tensor& x, const at::Tensor& w, int64_t vocab_size) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x must be [N, D] and w [V, D], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(vocab_size >= 0 && vocab_size <= w.size(0), "vocab_size must be in [0, ", w.size(0), "], got ",
              vocab_size);
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "x and w must share one dtype, got ", x.scalar_type(), " and ",
              w.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf || x.scalar_type() == at::kFloat,
              "products on CUDA take bfloat16, float16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.device() == w.device(), "x and w must be on one device, got ", x.device(), " and ", w.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t ld = (vocab_size + kRowStrideAlign - 1) / kRowStrideAlign * kRowStrideAlign;
  at::Tensor z = at::empty({x.size(0), ld}, x.options().dtype(at::kFloat)).narrow(1, 0, vocab_size);
  if (x.size(0) > 0 && vocab_size > 0 && x.size(1) > 0) {
    products_f32(unit_stride_rows(x), unit_stride_rows(w), vocab_size, z.data_ptr<float>(), ld);
  } else if (x.size(1) == 0) {
    z.zero_();
  }
  return z;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("products", &products_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
