// Block-level tile GEMM of the CUDA fused-linear kernels (the sm_80 mma.sync path, which
// also runs on sm_90): a block of 4 warps computes the [64 rows x 64 vocab] logit tile
// X[rows] . W[vocab]^T in float32 accumulators held in registers, streaming K through
// double-buffered shared memory with cp.async. The tile never leaves the chip; the caller
// folds it into per-row state (forward) or turns it into dLoss/dz (backward).
//
// Accumulator layout (that of mma.m16n8k16): warp w owns rows [16w, 16w + 16) of the tile;
// lane l holds, for each of the 8 n-tiles j, the entries
//   acc[j][0..1] at row 16w + l/4,     columns 8j + 2(l%4) + {0, 1}
//   acc[j][2..3] at row 16w + l/4 + 8, columns 8j + 2(l%4) + {0, 1}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace nitrobrew {
namespace cuda {

constexpr int kThreads = 128;  // 4 warps
constexpr int kTileRows = 64;  // BM
constexpr int kTileCols = 64;  // BN: vocabulary entries per tile
constexpr int kTileK = 32;     // BK
constexpr int kNTiles = kTileCols / 8;

// Shared-memory rows are padded by 16 bytes so that ldmatrix's eight 16-byte row reads hit
// distinct banks.
template <typename T>
struct SmemTile {
  static constexpr int kPad = 16 / sizeof(T);
  static constexpr int kStride = kTileK + kPad;  // elements per shared-memory row
  T x[2][kTileRows][kStride];                    // [stage][BM][BK]
  T w[2][kTileCols][kStride];                    // [stage][BN][BK]
};

// One operand of the tile GEMM: `rows` rows of length k starting at `ptr`, `ld` elements apart.
template <typename T>
struct Operand {
  const T* ptr;
  int64_t ld;
  int64_t rows;  // valid rows from ptr (rows past it read as zero)
};

// A thread's share of a logit tile: kN n-tiles of 8 columns, 4 entries each, in the layout
// above. The sm_90a wgmma accumulator of a 64 x 8kN tile has the same layout per warp.
template <int kN>
struct TileAcc {
  static constexpr int kNTiles = kN;
  float v[kN][4];
  __device__ __forceinline__ float at(int j, int k) const { return v[j][k]; }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < kN; ++j) v[j][0] = v[j][1] = v[j][2] = v[j][3] = 0.f;
  }
};
using Acc = TileAcc<kNTiles>;

// float -> storage type (torch builds with the implicit half conversions switched off).
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half(v); }

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;  // 0: zero-fill
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Loads a [kRows x kTileK] slab at column k0 into shared memory. Vectorized: 16-byte chunks
// with cp.async when every row start is 16-byte aligned and k is a multiple of the chunk;
// otherwise element by element (a slow path for odd hidden sizes).
template <typename T, int kRows, bool kVectorized>
__device__ __forceinline__ void load_slab(T (*dst)[SmemTile<T>::kStride], const Operand<T>& op, int64_t k0,
                                          int64_t k) {
  constexpr int kChunk = 16 / sizeof(T);
  constexpr int kChunksPerRow = kTileK / kChunk;
  if constexpr (kVectorized) {
    for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
      const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * kChunk;
      const bool valid = r < op.rows && k0 + col < k;
      const T* src = valid ? op.ptr + r * op.ld + k0 + col : op.ptr;
      cp_async_16(&dst[r][col], src, valid);
    }
  } else {
    for (int e = threadIdx.x; e < kRows * kTileK; e += kThreads) {
      const int r = e / kTileK, col = e % kTileK;
      const bool valid = r < op.rows && k0 + col < k;
      dst[r][col] = valid ? op.ptr[r * op.ld + k0 + col] : from_float<T>(0.f);
    }
  }
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One warp's [16 x 64] share of the product of the two staged slabs.
template <typename T>
__device__ __forceinline__ void warp_mma_slab(Acc& acc, const T (*x)[SmemTile<T>::kStride],
                                              const T (*w)[SmemTile<T>::kStride]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if constexpr (sizeof(T) == 2) {
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, &x[warp * 16 + (lane % 16)][kk + (lane / 16) * 8]);
#pragma unroll
      for (int j = 0; j < kNTiles; j += 2) {
        uint32_t b[4];  // n-tiles j and j + 1, k halves 0 and 1
        ldmatrix_x4(b, &w[j * 8 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
        mma_16816<T>(acc.v[j], a, b[0], b[1]);
        mma_16816<T>(acc.v[j + 1], a, b[2], b[3]);
      }
    }
  } else {
    // float32 inputs: CUDA-core FMAs in the same register layout (the slow path). Each slab
    // is summed in float64 and rounded once, so the logits are as accurate as a blocked
    // float32 BLAS (a plain sequential float32 sum over K loses ~sqrt(K) roundings, which
    // the temperature then amplifies).
    const int r0 = warp * 16 + lane / 4, c0 = 2 * (lane % 4);
    double slab[kNTiles][4] = {};
#pragma unroll 4
    for (int kk = 0; kk < kTileK; ++kk) {
      const double x0 = x[r0][kk], x1 = x[r0 + 8][kk];
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
        const double w0 = w[8 * j + c0][kk], w1 = w[8 * j + c0 + 1][kk];
        slab[j][0] = fma(x0, w0, slab[j][0]);
        slab[j][1] = fma(x0, w1, slab[j][1]);
        slab[j][2] = fma(x1, w0, slab[j][2]);
        slab[j][3] = fma(x1, w1, slab[j][3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc.v[j][e] += static_cast<float>(slab[j][e]);
    }
  }
}

// acc = x[0:64, 0:k] . w[0:64, 0:k]^T for one tile, with a two-stage cp.async pipeline.
// Every thread of the block must call it (it synchronizes the block).
template <typename T, bool kVectorized>
__device__ void tile_gemm(Acc& acc, SmemTile<T>& smem, const Operand<T>& x, const Operand<T>& w, int64_t k) {
  acc.zero();
  const int64_t k_blocks = (k + kTileK - 1) / kTileK;
  load_slab<T, kTileRows, kVectorized>(smem.x[0], x, 0, k);
  load_slab<T, kTileCols, kVectorized>(smem.w[0], w, 0, k);
  cp_async_commit();
  for (int64_t kb = 0; kb < k_blocks; ++kb) {
    const int stage = kb & 1;
    if (kb + 1 < k_blocks) {
      load_slab<T, kTileRows, kVectorized>(smem.x[stage ^ 1], x, (kb + 1) * kTileK, k);
      load_slab<T, kTileCols, kVectorized>(smem.w[stage ^ 1], w, (kb + 1) * kTileK, k);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    warp_mma_slab<T>(acc, smem.x[stage], smem.w[stage]);
    __syncthreads();  // the stage is overwritten by the next iteration's loads
  }
}

}  // namespace cuda
}  // namespace nitrobrew
