// Building blocks of the passes (vocab_walk.cuh) that know no loss: the fast exponential of
// their sums, a quad shuffle, the running row maxima of a fold spread over a product's slabs, a
// fragment's entry at a run-time index, and the buffer a gradient pass writes dLoss/dz into.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "row_kernels.cuh"
#include "tile_gemm_sm80.cuh"

namespace nitrobrew {
namespace cuda {

// The exponential, the mixtures' log u and q / M of the passes' sums and gradients: the row kernels' (RowExp) in
// float. For 16-bit inputs the special-function unit's; the gradients are rounded to 16 bits and the loss error is
// the tensor-core logits' (docs/notes). float32 inputs keep expf and their tighter accuracy.
template <typename T>
using PassExp = RowExp<T, float>;

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

// Pieces 0 to kMaxPieces - 1 of a fold spread over a product's slabs (KLPass::student_piece,
// StudentNormPass::tile_piece): the running maximum of each of the fragment's two rows over its
// n-tiles 2 piece and 2 piece + 1 (32 n-tiles in all; piece 0 starts from -inf).
constexpr int kMaxPieces = 16;
template <typename Tile>
__device__ __forceinline__ void row_max_piece(const Tile& z, int piece, float (&m)[2]) {
  static_assert(Tile::kNTiles == 2 * kMaxPieces, "two n-tiles per piece");
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float v = piece == 0 ? -INFINITY : m[i];
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
      for (int e = 0; e < 2; ++e) v = fmaxf(v, z.at(2 * piece + jj, 2 * i + e));
    }
    m[i] = v;
  }
}

// Whether a tile's entries can be read at a (j, k) known only at run time (ParkedTile, in shared
// memory); a tile in registers is read through a select over its n-tiles instead.
template <typename Tile, typename = void>
constexpr bool kRuntimeIndex = false;
template <typename Tile>
constexpr bool kRuntimeIndex<Tile, std::void_t<decltype(Tile::kRuntimeIndex)>> = Tile::kRuntimeIndex;

// Entry (j, 2 kI + e) of a thread's fragment, with j and e known only at run time.
template <int kI, typename Tile>
__device__ __forceinline__ float fragment_entry(const Tile& z, int j, int e) {
  if constexpr (kRuntimeIndex<Tile>) {
    return z.at(j, 2 * kI + e);
  } else {
    float v = 0.f;
#pragma unroll
    for (int jj = 0; jj < Tile::kNTiles; ++jj) {
      if (jj == j) v = e ? z.at(jj, 2 * kI + 1) : z.at(jj, 2 * kI);
    }
    return v;
  }
}

// Stores two adjacent entries at an address aligned to both (a packed 16-bit pair or float2).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<float2*>(dst) = make_float2(a, b);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(a, b);
  } else {
    *reinterpret_cast<__half2*>(dst) = __floats2half2_rn(a, b);
  }
}

// The [N x >= chunk_cols] buffer a gradient pass writes dLoss/dz of vocabulary entries
// [chunk_begin, chunk_begin + chunk_cols) into: entry (n, v) at grad[n * ld + v - chunk_begin].
template <typename T>
struct GradChunk {
  int64_t chunk_begin, chunk_cols;
  T* grad;
  int64_t ld;  // even, as chunk_begin is: a fragment's entry pair is one aligned store

  __device__ __forceinline__ int64_t end() const { return chunk_begin + chunk_cols; }
  // Stores a thread's fragment entries (col, col + 1) of row n (col even), those inside the chunk;
  // kInside: the caller knows both are.
  template <bool kInside = false>
  __device__ __forceinline__ void store(int64_t n, int64_t col, const float (&dz)[2]) const {
    T* out = grad + n * ld - chunk_begin;
    if (kInside || col + 1 < end()) {
      store_pair(out + col, dz[0], dz[1]);  // one 4- or 8-byte store: half the store instructions
    } else if (col < end()) {
      out[col] = from_float<T>(dz[0]);
    }
  }
};

// The GradChunk view of a [N x >= chunk_cols] buffer (host).
template <typename T>
GradChunk<T> grad_chunk_of(int64_t chunk_begin, int64_t chunk_cols, const at::Tensor& grad_chunk) {
  return {chunk_begin, chunk_cols, reinterpret_cast<T*>(grad_chunk.data_ptr()), grad_chunk.stride(0)};
}

}  // namespace cuda
}  // namespace nitrobrew
