// Pieces shared by the CUDA forward and backward of the fused-linear losses: the kernel
// arguments, the rows a thread's accumulator fragment covers, and the host-side checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../fused_linear_params.h"
#include "fused_linear_cuda.h"
#include "tile_gemm.cuh"

namespace nitrobrew {
namespace cuda {

template <typename T>
struct FusedLinearArgs {
  const T* xs;
  const T* xt;
  const T* ws;
  const T* wt;
  int64_t ld_xs, ld_xt, ld_ws, ld_wt;  // row strides in elements
  int64_t n_rows, d_s, d_t, vocab_size;
  const int64_t* labels;  // nullptr without labels
  int64_t ignore_index;
  float inv_temperature, softcap_s, softcap_t, ce_weight;
  DivergenceParams<float> div;
};

template <typename T>
FusedLinearArgs<T> make_args(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
                             const c10::optional<at::Tensor>& labels, const FusedLinearParams& p) {
  FusedLinearArgs<T> a;
  a.xs = reinterpret_cast<const T*>(xs.data_ptr());
  a.xt = reinterpret_cast<const T*>(xt.data_ptr());
  a.ws = reinterpret_cast<const T*>(ws.data_ptr());
  a.wt = reinterpret_cast<const T*>(wt.data_ptr());
  a.ld_xs = xs.stride(0);
  a.ld_xt = xt.stride(0);
  a.ld_ws = ws.stride(0);
  a.ld_wt = wt.stride(0);
  a.n_rows = p.num_rows;
  a.d_s = p.hidden_s;
  a.d_t = p.hidden_t;
  a.vocab_size = p.vocab_size;
  a.labels = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  a.ignore_index = p.ignore_index;
  a.inv_temperature = static_cast<float>(p.inv_temperature);
  a.softcap_s = static_cast<float>(p.softcap_s);
  a.softcap_t = static_cast<float>(p.softcap_t);
  a.ce_weight = static_cast<float>(p.ce_weight);
  a.div = divergence_params<float>(p);
  return a;
}

// 16-byte cp.async needs every row start 16-byte aligned and K a multiple of 16 bytes.
inline bool vectorizable(const at::Tensor& t) {
  const int64_t bytes = t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * bytes) % 16 == 0 &&
         (t.size(1) * bytes) % 16 == 0;
}

// The CUDA storage type of a torch scalar type.
template <typename scalar_t>
using cuda_type_t = std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, __nv_bfloat16,
                                       std::conditional_t<std::is_same_v<scalar_t, at::Half>, __half, scalar_t>>;

// The two rows of the tile a thread's accumulator fragment covers (see tile_gemm.cuh).
struct FragmentRows {
  int64_t row[2];
  bool valid[2];
  int64_t label[2];

  template <typename T>
  __device__ __forceinline__ FragmentRows(const FusedLinearArgs<T>& a, int64_t row0) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row[i] = row0 + warp * 16 + lane / 4 + 8 * i;
      label[i] = -1;
      valid[i] = row[i] < a.n_rows;
      if (valid[i] && a.labels != nullptr) {
        label[i] = a.labels[row[i]];
        valid[i] = label[i] != a.ignore_index;
      }
    }
  }
};

inline int multiprocessor_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Column of entry e (0/1) of n-tile j of this thread's fragment, relative to the tile.
__device__ __forceinline__ int fragment_col(int j, int e) { return 8 * j + 2 * (threadIdx.x % 4) + e; }

template <typename T>
__device__ __forceinline__ Operand<T> rows_of(const T* base, int64_t ld, int64_t first, int64_t total) {
  return Operand<T>{base + first * ld, ld, total - first};
}

// Computes the student and teacher logit tiles at vocabulary offset v0, soft-capped.
template <typename T, bool kVec>
__device__ __forceinline__ void logit_tiles(Acc& zs, Acc& zt, SmemTile<T>& smem, const FusedLinearArgs<T>& a,
                                            int64_t row0, int64_t v0) {
  tile_gemm<T, kVec>(zs, smem, rows_of(a.xs, a.ld_xs, row0, a.n_rows), rows_of(a.ws, a.ld_ws, v0, a.vocab_size), a.d_s);
  tile_gemm<T, kVec>(zt, smem, rows_of(a.xt, a.ld_xt, row0, a.n_rows), rows_of(a.wt, a.ld_wt, v0, a.vocab_size), a.d_t);
#pragma unroll
  for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      zs.v[j][e] = softcap(zs.v[j][e], a.softcap_s);
      zt.v[j][e] = softcap(zt.v[j][e], a.softcap_t);
    }
  }
}

}  // namespace cuda
}  // namespace nitrobrew
