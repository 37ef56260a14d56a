// Pieces of the memory-bound row kernels (one block per row: logits/cuda.cu,
// logits/topk_cuda.cu): conversions, strided rows, block reductions; their exponential is fast_math.cuh's RowExp.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../numerics.h"
#include "cuda_types.h"
#include "fast_math.cuh"

namespace nitrobrew {
namespace cuda {

constexpr int kRowThreads = 256;

// Element v of row n of a [N, V] matrix at any strides.
template <typename T>
struct Rows {
  const T* base;
  int64_t ld, stride;  // row and column strides in elements
  __device__ __forceinline__ const T* row(int64_t n) const { return base + n * ld; }
};

template <typename acc_t>
__device__ __forceinline__ acc_t shfl(acc_t v, int lane) {
  return __shfl_xor_sync(0xffffffffu, v, lane);
}

// Block-wide sums of two values over blocks of up to 1024 threads; valid in thread 0. Every thread must
// call it; callable again after it returns.
template <typename acc_t>
__device__ __forceinline__ void block_sum2(acc_t& x, acc_t& y) {
  __shared__ acc_t scratch[32][2];
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) {
    x += shfl(x, mask);
    y += shfl(y, mask);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scratch[warp][0] = x;
    scratch[warp][1] = y;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x / 32); ++w) {
      x += scratch[w][0];
      y += scratch[w][1];
    }
  }
  __syncthreads();  // scratch is free again
}

// Calls f.chunk<kN>(s, v0) with the scaled logits s[k] = z[v0 + k] * inv_t (rounded in scale_t,
// as scale_logit does, then widened to acc_t) of the thread's chunks of one row of `vocab` entries:
// every blockDim-th chunk of kN entries (one 16-byte load) when `vectorized` (unit stride, 16-byte
// aligned row), in order, then single entries for the rest.
// Two loads are in flight per thread: the top-K kernels, whose float64 registers allow 4-5 blocks
// per SM, kept too few bytes in flight with one (ncu: 79% DRAM throughput at 48% occupancy).
template <int kN, typename T, typename acc_t, typename scale_t, typename F>
__device__ __forceinline__ void for_each_row_chunk(const T* z, int64_t stride, int64_t vocab, bool vectorized,
                                                   scale_t inv_t, F&& f) {
  int64_t v = 0;
  if (vectorized) {
    const uint4* chunk = reinterpret_cast<const uint4*>(z);
    const auto call = [&](const uint4& raw, int64_t c) {
      const T* pz = reinterpret_cast<const T*>(&raw);
      acc_t s[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) s[k] = static_cast<acc_t>(scale_logit(to_acc<scale_t>(pz[k]), inv_t));
      f.template chunk<kN>(s, c * kN);
    };
    const int64_t chunks = vocab / kN, step = blockDim.x;
    int64_t c = threadIdx.x;
    for (; c + step < chunks; c += 2 * step) {
      const uint4 first = chunk[c], second = chunk[c + step];
      call(first, c);
      call(second, c + step);
    }
    if (c < chunks) call(chunk[c], c);
    v = chunks * kN;
  }
  for (int64_t i = v + threadIdx.x; i < vocab; i += blockDim.x) {
    acc_t s[1] = {static_cast<acc_t>(scale_logit(to_acc<scale_t>(z[i * stride]), inv_t))};
    f.template chunk<1>(s, i);
  }
}

}  // namespace cuda
}  // namespace nitrobrew
