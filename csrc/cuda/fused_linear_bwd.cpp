// CUDA backward of the fused-linear losses (host): walks the vocabulary in chunks; for each,
// the gradient pass (GradPass, logit_passes.cu) recomputes the logit tiles on chip and writes
// dLoss/dz for the chunk, and cuBLAS accumulates
//   dxs += dz_chunk . ws_chunk          (float32 accumulator, scaled by g per row at the end)
//   dws_chunk = dz_chunk^T . (g * xs)
// Extra memory: the chunk ([N x chunk] in the inputs' dtype, at most kChunkBytes), the
// float32 dxs accumulator and g * xs: never O(N x V).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "fused_linear_cuda.h"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int64_t kChunkBytes = int64_t(192) << 20;

cudaDataType_t cublas_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_CHECK(false, "unsupported dtype for the CUDA backward: ", t);
  }
}

// Column-major C[m x n] = alpha * op(A) . op(B) + beta * C, accumulated in float32.
void gemm(bool trans_b, int64_t m, int64_t n, int64_t k, const void* a, at::ScalarType a_type, int64_t lda,
          const void* b, int64_t ldb, float beta, void* c, at::ScalarType c_type, int64_t ldc) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.f;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  TORCH_CUDABLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(m),
                                    static_cast<int>(n), static_cast<int>(k), &alpha, a, cublas_type(a_type),
                                    static_cast<int>(lda), b, cublas_type(a_type), static_cast<int>(ldb), &beta, c,
                                    cublas_type(c_type), static_cast<int>(ldc), CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

std::tuple<at::Tensor, at::Tensor> fused_linear_distill_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& xs_in, const at::Tensor& xt_in, const at::Tensor& ws_in,
    const at::Tensor& wt_in, const c10::optional<at::Tensor>& labels_in, const at::Tensor& row_stats_in,
    int64_t ignore_index, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, int64_t vocab_size, int64_t chunk_v, bool compute_dxs, bool compute_dws) {
  const FusedLinearParams p = make_fused_linear_params(xs_in, xt_in, ws_in, wt_in, labels_in, ignore_index, beta,
                                                       temperature, ce_weight, softcap_s, softcap_t, vocab_size,
                                                       chunk_v);
  TORCH_CHECK(xs_in.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == p.num_rows, "grad_loss must be [N] = [", p.num_rows,
              "], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats_in.dim() == 2 && row_stats_in.size(0) == p.num_rows && row_stats_in.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] as the forward returns it, got ", row_stats_in.sizes());
  TORCH_CHECK(grad_loss.device() == xs_in.device() && row_stats_in.device() == xs_in.device(),
              "grad_loss and row_stats must be on ", xs_in.device());
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const at::Tensor xs = unit_stride_rows(xs_in), xt = unit_stride_rows(xt_in);
  const at::Tensor ws = unit_stride_rows(ws_in), wt = unit_stride_rows(wt_in);
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  const at::Tensor row_stats = row_stats_in.to(at::kFloat).contiguous();
  const at::Tensor g = grad_loss.to(at::kFloat).unsqueeze(1);  // [N, 1]
  const auto dtype = xs.scalar_type();

  at::Tensor dxs_acc, xs_scaled, dws;
  if (compute_dxs) dxs_acc = at::zeros({p.num_rows, p.hidden_s}, xs.options().dtype(at::kFloat));
  if (compute_dws) {
    // g * xs, [N, D_s]: computed in float32 per element and written in the inputs' dtype,
    // with no float32 temporary of the whole matrix.
    xs_scaled = at::empty({p.num_rows, p.hidden_s}, xs.options());
    at::mul_out(xs_scaled, xs, g);
    dws = at::zeros_like(ws_in, at::MemoryFormat::Contiguous);      // padded rows past vocab_size stay 0
  }
  const int64_t n = p.num_rows, elem = xs.element_size();
  int64_t chunk = std::max<int64_t>(kGradChunkAlign, kChunkBytes / std::max<int64_t>(n * elem, 1) / kGradChunkAlign * kGradChunkAlign);
  chunk = std::min(chunk, (p.vocab_size + kGradChunkAlign - 1) / kGradChunkAlign * kGradChunkAlign);
  at::Tensor dz = at::empty({n, chunk}, xs.options());
  const LogitTilePasses passes(xs, xt, ws, wt, labels, p);
  for (int64_t c0 = 0; n > 0 && (compute_dxs || compute_dws) && c0 < p.vocab_size; c0 += chunk) {
    const int64_t cols = std::min(chunk, p.vocab_size - c0);
    passes.grad_pass(row_stats, c0, cols, dz);
    if (compute_dxs) {  // dxs_acc^T [D_s x N] += ws_chunk^T [D_s x cols] . dz^T [cols x N]
      const void* ws_chunk = static_cast<const char*>(ws.data_ptr()) + c0 * ws.stride(0) * elem;
      gemm(false, p.hidden_s, n, cols, ws_chunk, dtype, ws.stride(0), dz.data_ptr(), chunk, 1.f,
           dxs_acc.data_ptr(), at::kFloat, p.hidden_s);
    }
    if (compute_dws) {  // dws_chunk^T [D_s x cols] = xs_scaled^T [D_s x N] . dz [N x cols]
      gemm(true, p.hidden_s, cols, n, xs_scaled.data_ptr(), dtype, p.hidden_s, dz.data_ptr(), chunk, 0.f,
           static_cast<char*>(dws.data_ptr()) + c0 * dws.stride(0) * elem, dtype, dws.stride(0));
    }
  }
  at::Tensor dxs = at::empty({0}, xs.options());
  if (compute_dxs) {
    dxs = at::empty({p.num_rows, p.hidden_s}, xs.options());
    at::mul_out(dxs, dxs_acc, g);  // float32 in, the inputs' dtype out
  }
  if (!compute_dws) dws = at::empty({0}, ws.options());
  return {dxs, dws};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_distill_bwd", &fused_linear_distill_bwd_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
