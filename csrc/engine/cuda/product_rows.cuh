// The training path's walk over stored products (engine: it knows no loss). The products
// z = x . w^T of a chunk of rows were written by cuBLAS in float32, one row per token with a stride of
// `ld` entries. A row is read by a cluster of blocks, each block taking one slice of its columns, so
// that the row's state is merged on chip (distributed shared memory) and every block finishes the same
// row statistics (fused_linear/fused_linear_product_rows.cu).
//
// On Hopper each block stages its slice of a row in shared memory with one bulk copy per model while
// it works on the previous row (double buffering): the passes over the row then read shared memory,
// and the products are read from device memory once. Elsewhere (sm_80; rows too long for the staging
// buffers) a block reads its slice from device memory in each pass.
#pragma once

#include <cstdint>

#include "../numerics.h"
#include "cuda_types.h"
#include "model_logits.cuh"
#include "sm90/ptx.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#include <cooperative_groups.h>
#define NITROBREW_CLUSTERS 1
#else
#define NITROBREW_CLUSTERS 0
#endif

namespace nitrobrew {
namespace cuda {

constexpr int kProductRowThreads = 512;
// Row strides of the stored products and of dLoss/dz, and the clusters' column slices, are multiples of
// 8 entries: 32 bytes of float32 products, 16 of a 16-bit gradient, so that every vector access and
// bulk copy is aligned.
constexpr int64_t kProductAlign = 8;

// One model's stored products and what turns them into its logits.
template <typename T>
struct StoredProducts {
  const float* z;  // [rows, ld] float32
  ModelLogits<T> f;
};

// The cluster of blocks that shares a row, and this block's slice of the row's columns.
struct RowCluster {
  unsigned rank = 0, size = 1;

  __device__ static RowCluster current() {
    RowCluster c;
#if NITROBREW_CLUSTERS
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    c.rank = cluster.block_rank();
    c.size = cluster.num_blocks();
#endif
    return c;
  }

  // Every thread of every block of the cluster: shared memory written before is visible to all after.
  __device__ __forceinline__ void sync() const {
#if NITROBREW_CLUSTERS
    cooperative_groups::this_cluster().sync();
#else
    __syncthreads();
#endif
  }

  // Block r's copy of a shared-memory variable of this block.
  template <typename X>
  __device__ __forceinline__ X* peer(X* mine, unsigned r) const {
#if NITROBREW_CLUSTERS
    return cooperative_groups::this_cluster().map_shared_rank(mine, r);
#else
    return mine;
#endif
  }
};

// The columns of a row of `vocab` entries that block `rank` of a cluster of `size` takes.
__host__ __device__ __forceinline__ int64_t row_slice_width(int64_t vocab, int64_t size) {
  const int64_t width = (vocab + size - 1) / size;
  return (width + kProductAlign - 1) / kProductAlign * kProductAlign;
}

struct RowSlice {
  int64_t begin, end;  // columns [begin, end)

  __device__ static RowSlice of(int64_t vocab, const RowCluster& c) {
    const int64_t width = row_slice_width(vocab, c.size);
    const int64_t begin = width * c.rank < vocab ? width * c.rank : vocab;
    return {begin, begin + width < vocab ? begin + width : vocab};
  }
  __device__ __forceinline__ int64_t size() const { return end - begin; }
};

// Where a block's slice of one row's products is read: a model's products at column `begin` of the row
// (device memory or the staging buffer), with what turns them into its logits.
template <typename T>
struct SliceSource {
  const float* zs;
  const float* zt;  // nullptr for student-only walks
  ModelLogits<T> fs, ft;
};

// The models' logits of the slice's entries [k0, k0 + kN) (column begin + k0 + k).
template <int kN, bool kTeacher, typename T>
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
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    ys[k] = model_logit_at(src.fs, ys[k], begin + k0 + k);
    if constexpr (kTeacher) yt[k] = model_logit_at(src.ft, yt[k], begin + k0 + k);
  }
}

// Calls f.chunk<kN>(ys, yt, v0) with the models' logits (before the temperature) of the slice: chunks
// of 4 columns (one 16-byte load of each model's products), each thread taking every blockDim-th chunk
// in order, four in flight (their loads issued before any is used: a block reading device memory needs
// that many bytes in flight to keep up with it), then single columns for the rest. v0 is the chunk's
// column in the row. Student-only walks (kTeacher false) pass ys as yt.
template <bool kTeacher, typename T, typename F>
__device__ __forceinline__ void for_each_product_chunk(const SliceSource<T>& src, const RowSlice& slice, F& f) {
  constexpr int kN = 4, kInFlight = 4;
  const int64_t count = slice.size(), chunks = count / kN, step = blockDim.x;
  int64_t c = threadIdx.x;
  for (; c + (kInFlight - 1) * step < chunks; c += kInFlight * step) {
    float ys[kInFlight][kN], yt[kInFlight][kN];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) load_logits<kN, kTeacher>(src, slice.begin, (c + i * step) * kN, ys[i], yt[i]);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) f.template chunk<kN>(ys[i], kTeacher ? yt[i] : ys[i], slice.begin + (c + i * step) * kN);
  }
  for (; c < chunks; c += step) {
    float ys[kN], yt[kN];
    load_logits<kN, kTeacher>(src, slice.begin, c * kN, ys, yt);
    f.template chunk<kN>(ys, kTeacher ? yt : ys, slice.begin + c * kN);
  }
  for (int64_t k = chunks * kN + threadIdx.x; k < count; k += step) {
    float ys[1], yt[1];
    load_logits<1, kTeacher>(src, slice.begin, k, ys, yt);
    f.template chunk<1>(ys, kTeacher ? yt : ys, slice.begin + k);
  }
}

// Stores kN values of a row of dLoss/dz at column v0 (a multiple of kN when kN > 1): one vector store.
template <int kN, typename T>
__device__ __forceinline__ void store_chunk(T* row, int64_t v0, const T (&g)[kN]) {
  if constexpr (kN * sizeof(T) == 8) {
    *reinterpret_cast<uint2*>(row + v0) = *reinterpret_cast<const uint2*>(g);
  } else if constexpr (kN * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(row + v0) = *reinterpret_cast<const uint4*>(g);
  } else {
#pragma unroll
    for (int k = 0; k < kN; ++k) row[v0 + k] = g[k];
  }
}

// Fills columns [begin, end) of a row with `value`.
template <typename T>
__device__ __forceinline__ void fill_slice(T* row, const RowSlice& slice, T value) {
  for (int64_t v = slice.begin + threadIdx.x; v < slice.end; v += blockDim.x) row[v] = value;
}

// The staging of slices in shared memory (Hopper; the calls compile to nothing below sm_90, where no
// staged kernel is launched). One thread initializes `count` mbarriers for one arrival each, before a
// barrier of the block.
__device__ __forceinline__ void hopper_init_barriers(uint64_t* bars, int count) {
#if NITROBREW_CLUSTERS
  for (int i = 0; i < count; ++i) hopper::mbar_init(&bars[i], 1);
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// The phase of `bar` completes once `bytes` of copies have landed (one thread arrives).
__device__ __forceinline__ void hopper_expect_bytes(uint64_t* bar, uint32_t bytes) {
#if NITROBREW_CLUSTERS
  hopper::mbar_arrive_expect_tx(bar, bytes);
#endif
}

__device__ __forceinline__ void hopper_wait(uint64_t* bar, uint32_t parity) {
#if NITROBREW_CLUSTERS
  hopper::mbar_wait(bar, parity);
#endif
}

// `bytes` (a multiple of 16) from device memory at src into this block's shared memory at dst,
// completing on the mbarrier `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if NITROBREW_CLUSTERS
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          hopper::smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(hopper::smem_addr(bar))
      : "memory");
#endif
}

}  // namespace cuda
}  // namespace nitrobrew
