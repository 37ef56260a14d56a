// cuBLAS products (cublas_gemm.h).
#include "cublas_gemm.h"

#include <ATen/cuda/CUDAContext.h>

namespace nitrobrew {
namespace cuda {
namespace {

cudaDataType_t cublas_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "nitrobrew: no cuBLAS product for dtype ", t);
  }
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, int64_t lda, const void* b,
          int64_t ldb, at::ScalarType ab_type, float beta, void* c, at::ScalarType c_type, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.f;
  // float32 operands: float32 arithmetic throughout (no TF32 even where torch allows it for matmuls), as
  // the kernels' own float32 path.
  const cublasComputeType_t compute = ab_type == at::kFloat ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), &alpha, a,
                                    cublas_type(ab_type), static_cast<int>(lda), b, cublas_type(ab_type),
                                    static_cast<int>(ldb), &beta, c, cublas_type(c_type), static_cast<int>(ldc),
                                    compute, CUBLAS_GEMM_DEFAULT));
}

void products_f32(const at::Tensor& x, const at::Tensor& w, int64_t vocab, float* z, int64_t ld_z) {
  // Row-major z [rows x vocab] is column-major z^T [vocab x rows] = w[:vocab] . x^T, where row-major
  // w [V x D] and x [rows x D] read column-major are w^T and x^T.
  gemm(/*trans_a=*/true, /*trans_b=*/false, vocab, x.size(0), x.size(1), w.data_ptr(), w.stride(0), x.data_ptr(),
       x.stride(0), x.scalar_type(), 0.f, z, at::kFloat, ld_z);
}

}  // namespace cuda
}  // namespace nitrobrew
