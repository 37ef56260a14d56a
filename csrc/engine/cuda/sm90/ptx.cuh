// Thin wrappers of the sm_90 PTX the TMA-fed kernels use: mbarriers, cluster barriers, TMA
// loads, bulk reductions into global memory and matrix stores to shared memory. No torch: tools/tma_stream_bench.cu, a standalone program, includes it too. Compiled for
// every architecture, but only sm_90a kernel bodies call them.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace nitrobrew {
namespace cuda {
namespace hopper {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

// The mbarrier at a shared-memory address (smem_addr): loops that wait on a ring's barriers pass
// addresses computed once, not pointers converted at every use.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) { mbar_wait(smem_addr(bar), parity); }

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { mbar_arrive(smem_addr(bar)); }

// Arrives on the mbarrier at this one's shared-memory offset in cluster block `rank`.
__device__ __forceinline__ void mbar_arrive_remote(uint32_t bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(bar), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote) : "memory");
}
__device__ __forceinline__ void mbar_arrive_remote(uint64_t* bar, uint32_t rank) {
  mbar_arrive_remote(smem_addr(bar), rank);
}

__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// True in one lane of the (converged, whole) warp, the same lane every call.
__device__ __forceinline__ bool elect_one() {
  uint32_t elected = 0;
  asm volatile(
      "{\n.reg .pred p;\nelect.sync _|p, 0xffffffff;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(elected));
  return elected != 0;
}

// The mbarrier and TMA operations with shared-memory addresses (smem_addr) and tensor-map
// addresses computed once: a producer loop then only adds offsets.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void tma_load(uint32_t dst, uint64_t map, int32_t k, int32_t row, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(map), "r"(k), "r"(row), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_multicast(uint32_t dst, uint64_t map, int32_t k, int32_t row, uint32_t bar,
                                                   uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(map), "r"(k), "r"(row), "r"(bar), "h"(mask)
      : "memory");
}

// The same from pointers.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  mbar_arrive_expect_tx(smem_addr(bar), bytes);
}

// The map's box at (column k, row) into shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int32_t k, int32_t row, uint64_t* bar) {
  tma_load(smem_addr(dst), reinterpret_cast<uint64_t>(map), k, row, smem_addr(bar));
}

// The box at (column k, row) into shared memory at this offset in every cluster block of `mask`;
// completes on each one's mbarrier at the offset of `bar`.
__device__ __forceinline__ void tma_load_multicast(void* dst, const CUtensorMap* map, int32_t k, int32_t row,
                                                   uint64_t* bar, uint16_t mask) {
  tma_load_multicast(smem_addr(dst), reinterpret_cast<uint64_t>(map), k, row, smem_addr(bar), mask);
}

// The box at (column k, head, row, batch) of a 4-D map into shared memory; completes on `bar`.
// (The attention kernels read [B, N, H, D] tensors as (D, H, N, B) maps, one head per box.)
__device__ __forceinline__ void tma_load_4d(void* dst, const CUtensorMap* map, int32_t k, int32_t head, int32_t row,
                                            int32_t batch, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(head), "r"(row), "r"(batch), "r"(smem_addr(bar))
      : "memory");
}

// Shared-memory writes of this thread (generic proxy) made visible to later wgmma reads and bulk
// copies (async proxy), once a barrier orders them.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// dst[0 .. bytes / 4) += src[...] in float32, asynchronously (a bulk group: commit, then wait).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const void* src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(src)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Every committed bulk group has read its shared memory (the source may be rewritten).
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Every committed bulk group is complete.
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Four 8 x 8 16-bit matrices to shared memory: lane l gives the address of row l % 8 of matrix
// l / 8 and holds, in r[m], elements (l / 4, 2 (l % 4) + {0, 1}) of matrix m (the mma C layout).
__device__ __forceinline__ void stmatrix_x4(void* row_addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_addr(row_addr)),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
