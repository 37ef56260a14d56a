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

// The two rows of a logit tile that a thread's accumulator fragment covers (see
// tile_gemm.cuh): rows first + lane/4 and first + lane/4 + 8, where `first` is the warp's
// first row. Rows past the batch or whose label is ignore_index are not valid.
struct FragmentRows {
  int64_t row[2];
  bool valid[2];
  int64_t label[2];

  template <typename T>
  __device__ __forceinline__ FragmentRows(const FusedLinearArgs<T>& a, int64_t first) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row[i] = first + lane / 4 + 8 * i;
      label[i] = -1;
      valid[i] = row[i] < a.n_rows;
      if (valid[i] && a.labels != nullptr) {
        label[i] = a.labels[row[i]];
        valid[i] = label[i] != a.ignore_index;
      }
    }
  }
};

// Which vocabulary tiles the blocks of a launch walk: tiles [first_tile, end_tile), cut into
// splits of tiles_per_split consecutive tiles, one split per block (and row tile).
struct VocabSchedule {
  int64_t first_tile, end_tile, tiles_per_split;
  __device__ __forceinline__ int64_t begin(int64_t split) const { return first_tile + split * tiles_per_split; }
  __device__ __forceinline__ int64_t end(int64_t split) const {
    return min(begin(split) + tiles_per_split, end_tile);
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

template <int kN>
__device__ __forceinline__ void apply_softcap(TileAcc<kN>& z, float cap) {
  if (cap <= 0.f) return;
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) z.v[j][e] = softcap(z.v[j][e], cap);
  }
}

// Computes the student and teacher logit tiles at vocabulary offset v0, soft-capped.
template <typename T, bool kVec>
__device__ __forceinline__ void logit_tiles(Acc& zs, Acc& zt, SmemTile<T>& smem, const FusedLinearArgs<T>& a,
                                            int64_t row0, int64_t v0) {
  tile_gemm<T, kVec>(zs, smem, rows_of(a.xs, a.ld_xs, row0, a.n_rows), rows_of(a.ws, a.ld_ws, v0, a.vocab_size), a.d_s);
  tile_gemm<T, kVec>(zt, smem, rows_of(a.xt, a.ld_xt, row0, a.n_rows), rows_of(a.wt, a.ld_wt, v0, a.vocab_size), a.d_t);
  apply_softcap(zs, a.softcap_s);
  apply_softcap(zt, a.softcap_t);
}

// The sm_80 path (mma.sync; runs on sm_90 too). Grid: (row tiles of 64, splits). Each block
// walks the vocabulary tiles of its split and hands each pair of logit tiles to the pass
// (fused_linear_passes.cuh), which folds it into per-row state or turns it into dLoss/dz.
template <typename T, bool kVec, typename Pass>
__global__ void __launch_bounds__(kThreads)
    mma_logit_kernel(FusedLinearArgs<T> a, VocabSchedule sched, typename Pass::Params params) {
  __shared__ SmemTile<T> smem;
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows, split = blockIdx.y;
  const FragmentRows rows(a, row0 + (threadIdx.x / 32) * 16);
  Pass pass(a, rows, params);
  Acc zs, zt;
  for (int64_t tile = sched.begin(split); tile < sched.end(split); ++tile) {
    const int64_t v0 = tile * kTileCols;
    if constexpr (Pass::kStudentOnly) {
      tile_gemm<T, kVec>(zs, smem, rows_of(a.xs, a.ld_xs, row0, a.n_rows), rows_of(a.ws, a.ld_ws, v0, a.vocab_size),
                         a.d_s);
      apply_softcap(zs, a.softcap_s);
      pass.tile(a, rows, v0, zs, zs);
    } else {
      logit_tiles<T, kVec>(zs, zt, smem, a, row0, v0);
      pass.tile(a, rows, v0, zs, zt);
    }
  }
  pass.finish(a, rows, split);
}

}  // namespace cuda
}  // namespace nitrobrew
