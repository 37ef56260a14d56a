// The training path's walk over stored products (engine: it knows no loss). The products
// z = x . w^T of a chunk of rows were written by cuBLAS in float32, one row per token with a stride of
// `ld` entries. Each row is cut into slices of columns, and every (row, slice) is one block of its own:
// the row kernels (fused_linear/fused_linear_product_rows.cu) fold a slice into a partial state, or turn
// it into dLoss/dz from the row's finished statistics. No block waits on another, so the grid streams
// device memory at the rate of a copy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../numerics.h"
#include "cuda_types.h"
#include "model_logits.cuh"

namespace nitrobrew {
namespace cuda {

constexpr int kProductRowThreads = 256;
// Blocks a SM the row kernels are compiled for (at most 64 registers a thread): with 74 registers 3 fit,
// and ncu saw the partials kernel at 53% of the DRAM bandwidth (docs/notes/fused_linear_training_path.md).
constexpr int kProductRowBlocksPerSM = 4;
// Row strides of the stored products and of dLoss/dz, and the slices' widths, are multiples of 8
// entries: 32 bytes of float32 products, 16 of a 16-bit gradient, so that every vector access is aligned.
constexpr int64_t kProductAlign = 8;
// Columns of a row a block takes: 16 chunks of 4 a thread, 4 loads of each model in flight at a time.
constexpr int64_t kRowSliceCols = 16 * 4 * kProductRowThreads;

// The (row, slice) of this block in a grid of rows x slices blocks (x fastest over slices).
struct RowSlice {
  int64_t row, slice;  // the row, and which of its slices
  int64_t begin, end;  // columns [begin, end) of the row

  __device__ static RowSlice of_block(int64_t vocab, int64_t width, int64_t slices) {
    const int64_t block = blockIdx.x, slice = block % slices, begin = slice * width;
    return {block / slices, slice, begin, begin + width < vocab ? begin + width : vocab};
  }
  __device__ __forceinline__ int64_t size() const { return end - begin; }
};

// Where a block's slice of one row's products is read: a model's products at column `begin` of the row,
// with what turns them into its logits.
template <typename T>
struct SliceSource {
  const float* zs;
  const float* zt;  // nullptr for student-only walks
  ModelLogits<T> fs, ft;
};

// The models' logits of the slice's entries [k0, k0 + kN) (column begin + k0 + k). kPlain: neither model has a
// bias, a logit scale or a soft-cap (Llama, Qwen, ...), and the logits are the products as they are.
template <int kN, bool kTeacher, bool kPlain, typename T>
__device__ __forceinline__ void load_logits(const SliceSource<T>& src, int64_t begin, int64_t k0, float (&ys)[kN],
                                            float (&yt)[kN]) {
  if constexpr (kN == 4) {
    const float4 zs = *reinterpret_cast<const float4*>(src.zs + k0);
    ys[0] = zs.x, ys[1] = zs.y, ys[2] = zs.z, ys[3] = zs.w;
    if constexpr (kTeacher) {
      const float4 zt = *reinterpret_cast<const float4*>(src.zt + k0);
      yt[0] = zt.x, yt[1] = zt.y, yt[2] = zt.z, yt[3] = zt.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      ys[k] = src.zs[k0 + k];
      if constexpr (kTeacher) yt[k] = src.zt[k0 + k];
    }
  }
  if constexpr (!kPlain) {
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      ys[k] = model_logit_at(src.fs, ys[k], begin + k0 + k);
      if constexpr (kTeacher) yt[k] = model_logit_at(src.ft, yt[k], begin + k0 + k);
    }
  }
}

// Whether both models' logits are their products as they are (load_logits' kPlain).
template <typename T>
__host__ __device__ inline bool plain_logits(const ModelLogits<T>& fs, const ModelLogits<T>& ft) {
  return fs.bias == nullptr && fs.scale == 1.f && !(fs.softcap > 0.f) && ft.bias == nullptr && ft.scale == 1.f &&
         !(ft.softcap > 0.f);
}

// Calls f.chunk<kN>(ys, yt, v0) with the models' logits (before the temperature) of the slice
// [begin, begin + count): chunks of 4 columns (one 16-byte load of each model's products), each thread
// taking every blockDim-th chunk in order, four in flight (their loads issued before any is used), then
// single columns for the rest. v0 is the chunk's column in the row. Student-only walks (kTeacher false)
// pass ys as yt.
template <bool kTeacher, bool kPlain, typename T, typename F>
__device__ __forceinline__ void for_each_product_chunk(const SliceSource<T>& src, int64_t begin, int64_t count, F& f) {
  constexpr int kN = 4, kInFlight = 4;
  const int64_t chunks = count / kN, step = blockDim.x;
  int64_t c = threadIdx.x;
  for (; c + (kInFlight - 1) * step < chunks; c += kInFlight * step) {
    float ys[kInFlight][kN], yt[kInFlight][kN];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) load_logits<kN, kTeacher, kPlain>(src, begin, (c + i * step) * kN, ys[i], yt[i]);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) f.template chunk<kN>(ys[i], kTeacher ? yt[i] : ys[i], begin + (c + i * step) * kN);
  }
  for (; c < chunks; c += step) {
    float ys[kN], yt[kN];
    load_logits<kN, kTeacher, kPlain>(src, begin, c * kN, ys, yt);
    f.template chunk<kN>(ys, kTeacher ? yt : ys, begin + c * kN);
  }
  for (int64_t k = chunks * kN + threadIdx.x; k < count; k += step) {
    float ys[1], yt[1];
    load_logits<1, kTeacher, kPlain>(src, begin, k, ys, yt);
    f.template chunk<1>(ys, kTeacher ? yt : ys, begin + k);
  }
}

// Two values rounded to a 16-bit T, packed in one 32-bit register (a, then b).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(a))) |
           uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(b))) << 16;
  } else {
    return uint32_t(__half_as_ushort(__float2half_rn(a))) | uint32_t(__half_as_ushort(__float2half_rn(b))) << 16;
  }
}

// Stores kN values of a row of dLoss/dz at column v0 (a multiple of kN when kN > 1), rounded to T: one
// vector store of registers packed in pairs (a T array reinterpreted as a vector would live in local
// memory).
template <int kN, typename T>
__device__ __forceinline__ void store_chunk(T* row, int64_t v0, const float (&g)[kN]) {
  if constexpr (kN == 4 && sizeof(T) == 2) {
    uint2 packed;
    packed.x = pack_pair<T>(g[0], g[1]);
    packed.y = pack_pair<T>(g[2], g[3]);
    *reinterpret_cast<uint2*>(row + v0) = packed;
  } else if constexpr (kN == 4 && sizeof(T) == 4) {
    *reinterpret_cast<float4*>(row + v0) = make_float4(g[0], g[1], g[2], g[3]);
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) row[v0 + k] = from_acc<T>(g[k]);
  }
}

// Fills columns [begin, end) of a row with `value`.
template <typename T>
__device__ __forceinline__ void fill_slice(T* row, const RowSlice& slice, T value) {
  for (int64_t v = slice.begin + threadIdx.x; v < slice.end; v += blockDim.x) row[v] = value;
}

}  // namespace cuda
}  // namespace nitrobrew
