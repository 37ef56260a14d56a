// cuBLAS matrix products of the CUDA paths, on the current stream with torch's handle: the recompute
// backward's chunk products (chunked_grads_cuda.cpp) and the training path's logits and gradients.
// This header names no cuBLAS type, so that only cublas_gemm_cuda.cpp needs cuBLAS's headers.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace nitrobrew {
namespace cuda {

// Column-major C[m x n] = op(A) . op(B) + beta * C, with op(X) = X^T where trans_x, products
// accumulated in float32 (exactly float32 for float32 operands, whatever torch's TF32 setting). A and
// B are of ab_type (bfloat16, float16 or float32), C of c_type (ab_type or float32).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b,
          int64_t ldb, at::ScalarType ab_type, float beta, void* c, at::ScalarType c_type, int64_t ldc);

// z[rows x vocab] = x[rows x D] . w[:vocab]^T in float32, row stride ld_z: the logits' products of
// the training path. x and w have unit-stride rows.
void products_f32(const at::Tensor& x, const at::Tensor& w, int64_t vocab, float* z, int64_t ld_z);

}  // namespace cuda
}  // namespace nitrobrew
