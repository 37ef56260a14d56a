// CUDA backward of the fused-linear losses, part 1 (device): dLoss/dz for one vocabulary chunk.
//
// Grid: (row tiles of 64, vocabulary tiles of the chunk). Each block recomputes its student
// and teacher logit tiles on chip, turns them into dLoss/dz with the forward's per-row
// statistics, and writes the chunk's [N x chunk] gradient, which the host side
// (fused_linear_bwd.cpp) multiplies into dxs and dws with cuBLAS.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "fused_linear_common.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) logit_grad_kernel(FusedLinearArgs<T> a, const float* __restrict__ row_stats,
                                                              int64_t chunk_begin, int64_t chunk_cols,
                                                              T* __restrict__ grad, int64_t ld_grad) {
  __shared__ SmemTile<T> smem;
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows;
  const int64_t v0 = chunk_begin + int64_t(blockIdx.y) * kTileCols;
  const FragmentRows rows(a, row0);
  Acc zs, zt;
  logit_tiles<T, kVec>(zs, zt, smem, a, row0, v0);
  const float inv_t = a.inv_temperature;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (rows.row[i] >= a.n_rows) continue;
    const float* row = row_stats + rows.row[i] * kNumRowStats;
    const LogNormalizer<float> norm_s{row[kMaxS], row[kLogSumS]}, norm_t{row[kMaxT], row[kLogSumT]};
    const LogNormalizer<float> norm_ce{row[kMaxCE], row[kLogSumCE]};
    const float center = row[kGradCenter];
    T* out = grad + rows.row[i] * ld_grad - chunk_begin;
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = v0 + fragment_col(j, e);
        if (col >= chunk_begin + chunk_cols) continue;
        float dz = 0.f;
        if (rows.valid[i] && col < a.vocab_size) {
          const float z = zs.v[j][2 * i + e];
          const float s = scale_logit(z, inv_t), t = scale_logit(zt.v[j][2 * i + e], inv_t);
          dz = divergence_grad(a.div, s, t, log_prob(s, norm_s), log_prob(t, norm_t), center) * inv_t;
          if (a.ce_weight != 0.f) {
            dz += a.ce_weight * (exp_(log_prob(z, norm_ce)) - (col == rows.label[i] ? 1.f : 0.f));
          }
          dz *= softcap_grad_from_capped(z, a.softcap_s);
        }
        out[col] = from_float<T>(dz);
      }
    }
  }
}

}  // namespace

void launch_logit_grad(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
                       const c10::optional<at::Tensor>& labels, const FusedLinearParams& p,
                       const at::Tensor& row_stats, int64_t chunk_begin, int64_t chunk_cols, at::Tensor& grad_chunk) {
  TORCH_CHECK(grad_chunk.stride(1) == 1 && grad_chunk.size(1) >= chunk_cols && grad_chunk.size(0) == p.num_rows);
  if (p.num_rows == 0 || chunk_cols == 0) return;
  const int64_t row_tiles = (p.num_rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (chunk_cols + kTileCols - 1) / kTileCols;
  TORCH_CHECK(row_tiles < (int64_t(1) << 31) && col_tiles < 65536, "chunk too large for one launch");
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(col_tiles));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool vec = vectorizable(xs) && vectorizable(xt) && vectorizable(ws) && vectorizable(wt);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "logit_grad_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    if constexpr (!std::is_same_v<T, double>) {
      const FusedLinearArgs<T> a = make_args<T>(xs, xt, ws, wt, labels, p);
      T* out = reinterpret_cast<T*>(grad_chunk.data_ptr());
      if (vec) {
        logit_grad_kernel<T, true><<<grid, kThreads, 0, stream>>>(a, row_stats.data_ptr<float>(), chunk_begin,
                                                                  chunk_cols, out, grad_chunk.stride(0));
      } else {
        logit_grad_kernel<T, false><<<grid, kThreads, 0, stream>>>(a, row_stats.data_ptr<float>(), chunk_begin,
                                                                   chunk_cols, out, grad_chunk.stride(0));
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace cuda
}  // namespace nitrobrew
