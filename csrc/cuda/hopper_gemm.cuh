// The sm_90a tile GEMM of the CUDA fused-linear kernels: TMA-fed wgmma with warp
// specialization. Compiled for every architecture the package ships, but the kernel body
// exists only in the sm_90a pass (elsewhere it is empty and never launched: the host picks
// this path only where the loaded binary is sm_90a, see logit_passes.cu).
//
// A block computes 128-row x 128-vocabulary logit tiles of the student and the teacher:
//   warpgroup 0 (producer): one thread streams 128 x 64 slabs of X and W into a ring of
//     kStages shared-memory stages with cp.async.bulk.tensor (TMA, 128-byte swizzle); each
//     stage has a "full" mbarrier (TMA bytes landed) and an "empty" one (consumers are done);
//   warpgroups 1, 2 (consumers): each multiplies its 64 rows of the X slab by the W slab with
//     wgmma.m64n128k16 into float32 accumulators in registers, first the student tile, then
//     the teacher tile, and hands both to the pass (fused_linear_passes.cuh) while the
//     producer already streams the next tile's slabs.
// A wgmma accumulator of 64 x 128 has, per warp, the register layout of 16 mma.m16n8 tiles
// (tile_gemm.cuh), so the passes serve both paths unchanged.
#pragma once

#include <cuda.h>

#include "fused_linear_passes.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NITROBREW_SM90A_DEVICE 1
#else
#define NITROBREW_SM90A_DEVICE 0
#endif

namespace nitrobrew {
namespace cuda {
namespace hopper {

constexpr int kRows = 128;      // block tile rows: 2 consumer warpgroups x 64
constexpr int kCols = 128;      // vocabulary entries per tile
constexpr int kK = 64;          // K per slab: 64 16-bit values = one 128-byte swizzle row
constexpr int kStages = 6;      // shared-memory ring depth
constexpr int kThreads = 384;   // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerWarps = 8;
constexpr int kSlabBytes = kRows * kK * 2;  // X slab and W slab alike (kRows == kCols)
constexpr int kStageBytes = 2 * kSlabBytes;
constexpr int kSmemBytes = kStages * kStageBytes + 1024 /* alignment */ + 2 * kStages * 8 /* mbarriers */;
static_assert(kRows == kCols, "one TMA box shape serves X and W");

// The four operands as TMA descriptors (built on the host, read by the copy engine).
struct TensorMaps {
  CUtensorMap xs, xt, ws, wt;
};

// Which (row block, vocabulary split) a block takes. Blocks are numbered so that those running
// together cover `group` consecutive row blocks and a run of splits: the X rows of a group stay
// in L2 while its blocks walk the vocabulary, and each W tile is read from memory once per
// group rather than once per row block.
struct BlockOrder {
  int64_t row_blocks, splits;
  int64_t group;
  __device__ __forceinline__ void decode(int64_t id, int64_t& row_block, int64_t& split) const {
    const int64_t per_group = group * splits;
    const int64_t g = id / per_group, r = id % per_group;
    const int64_t rows_here = min(group, row_blocks - g * group);
    row_block = g * group + r % rows_here;
    split = r / rows_here;
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_loop:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// Box {kK, 128} of a 2-D map at (column k, row) into shared memory; completes on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, int32_t k, int32_t row, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k), "r"(row), "r"(smem_addr(bar))
      : "memory");
}

// wgmma shared-memory descriptor of a K-major operand in 128-byte-swizzled rows: 8-row groups
// 1024 bytes apart (SBO); the leading offset is unused for this layout. Advancing K by 16
// values adds 32 bytes, i.e. 2 to the encoded start address.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int kN>
__device__ __forceinline__ void fence_acc(TileAcc<kN>& d) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d.v[j][e])::"memory");
  }
}

// d (+)= A . B^T for a 64 x 16 slice of A and a 128 x 16 slice of B; scale_d = 0 overwrites d
// (the first product of a tile: zeroing d with ordinary instructions would serialize wgmma).
template <typename T>
__device__ __forceinline__ void wgmma_m64n128k16(TileAcc<16>& d, uint64_t desc_a, uint64_t desc_b, int scale_d);

template <>
__device__ __forceinline__ void wgmma_m64n128k16<__nv_bfloat16>(TileAcc<16>& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      :
        "+f"(d.v[0][0]), "+f"(d.v[0][1]), "+f"(d.v[0][2]), "+f"(d.v[0][3]),
        "+f"(d.v[1][0]), "+f"(d.v[1][1]), "+f"(d.v[1][2]), "+f"(d.v[1][3]),
        "+f"(d.v[2][0]), "+f"(d.v[2][1]), "+f"(d.v[2][2]), "+f"(d.v[2][3]),
        "+f"(d.v[3][0]), "+f"(d.v[3][1]), "+f"(d.v[3][2]), "+f"(d.v[3][3]),
        "+f"(d.v[4][0]), "+f"(d.v[4][1]), "+f"(d.v[4][2]), "+f"(d.v[4][3]),
        "+f"(d.v[5][0]), "+f"(d.v[5][1]), "+f"(d.v[5][2]), "+f"(d.v[5][3]),
        "+f"(d.v[6][0]), "+f"(d.v[6][1]), "+f"(d.v[6][2]), "+f"(d.v[6][3]),
        "+f"(d.v[7][0]), "+f"(d.v[7][1]), "+f"(d.v[7][2]), "+f"(d.v[7][3]),
        "+f"(d.v[8][0]), "+f"(d.v[8][1]), "+f"(d.v[8][2]), "+f"(d.v[8][3]),
        "+f"(d.v[9][0]), "+f"(d.v[9][1]), "+f"(d.v[9][2]), "+f"(d.v[9][3]),
        "+f"(d.v[10][0]), "+f"(d.v[10][1]), "+f"(d.v[10][2]), "+f"(d.v[10][3]),
        "+f"(d.v[11][0]), "+f"(d.v[11][1]), "+f"(d.v[11][2]), "+f"(d.v[11][3]),
        "+f"(d.v[12][0]), "+f"(d.v[12][1]), "+f"(d.v[12][2]), "+f"(d.v[12][3]),
        "+f"(d.v[13][0]), "+f"(d.v[13][1]), "+f"(d.v[13][2]), "+f"(d.v[13][3]),
        "+f"(d.v[14][0]), "+f"(d.v[14][1]), "+f"(d.v[14][2]), "+f"(d.v[14][3]),
        "+f"(d.v[15][0]), "+f"(d.v[15][1]), "+f"(d.v[15][2]), "+f"(d.v[15][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

template <>
__device__ __forceinline__ void wgmma_m64n128k16<__half>(TileAcc<16>& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      :
        "+f"(d.v[0][0]), "+f"(d.v[0][1]), "+f"(d.v[0][2]), "+f"(d.v[0][3]),
        "+f"(d.v[1][0]), "+f"(d.v[1][1]), "+f"(d.v[1][2]), "+f"(d.v[1][3]),
        "+f"(d.v[2][0]), "+f"(d.v[2][1]), "+f"(d.v[2][2]), "+f"(d.v[2][3]),
        "+f"(d.v[3][0]), "+f"(d.v[3][1]), "+f"(d.v[3][2]), "+f"(d.v[3][3]),
        "+f"(d.v[4][0]), "+f"(d.v[4][1]), "+f"(d.v[4][2]), "+f"(d.v[4][3]),
        "+f"(d.v[5][0]), "+f"(d.v[5][1]), "+f"(d.v[5][2]), "+f"(d.v[5][3]),
        "+f"(d.v[6][0]), "+f"(d.v[6][1]), "+f"(d.v[6][2]), "+f"(d.v[6][3]),
        "+f"(d.v[7][0]), "+f"(d.v[7][1]), "+f"(d.v[7][2]), "+f"(d.v[7][3]),
        "+f"(d.v[8][0]), "+f"(d.v[8][1]), "+f"(d.v[8][2]), "+f"(d.v[8][3]),
        "+f"(d.v[9][0]), "+f"(d.v[9][1]), "+f"(d.v[9][2]), "+f"(d.v[9][3]),
        "+f"(d.v[10][0]), "+f"(d.v[10][1]), "+f"(d.v[10][2]), "+f"(d.v[10][3]),
        "+f"(d.v[11][0]), "+f"(d.v[11][1]), "+f"(d.v[11][2]), "+f"(d.v[11][3]),
        "+f"(d.v[12][0]), "+f"(d.v[12][1]), "+f"(d.v[12][2]), "+f"(d.v[12][3]),
        "+f"(d.v[13][0]), "+f"(d.v[13][1]), "+f"(d.v[13][2]), "+f"(d.v[13][3]),
        "+f"(d.v[14][0]), "+f"(d.v[14][1]), "+f"(d.v[14][2]), "+f"(d.v[14][3]),
        "+f"(d.v[15][0]), "+f"(d.v[15][1]), "+f"(d.v[15][2]), "+f"(d.v[15][3])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
#endif
}

// Ring position shared by the producer and the consumers: both walk the same sequence of slabs.
struct RingSlot {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <typename T, typename Pass>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_logit_kernel(const __grid_constant__ TensorMaps maps, FusedLinearArgs<T> a, BlockOrder order,
                        VocabSchedule sched, typename Pass::Params params) {
#if NITROBREW_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  int64_t row_block, split;
  order.decode(blockIdx.x, row_block, split);
  const int64_t row0 = row_block * kRows;
  const int64_t first = sched.begin(split), last = sched.end(split);
  const int k_slabs_s = static_cast<int>((a.d_s + kK - 1) / kK), k_slabs_t = static_cast<int>((a.d_t + kK - 1) / kK);
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {  // producer
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      RingSlot slot;
      auto stream = [&](const CUtensorMap* x, const CUtensorMap* w, int k_slabs, int32_t v0) {
        for (int ks = 0; ks < k_slabs; ++ks) {
          mbar_wait(&empty[slot.stage], slot.phase ^ 1);
          uint8_t* stage = smem + slot.stage * kStageBytes;
          mbar_arrive_expect_tx(&full[slot.stage], kStageBytes);
          tma_load(stage, x, ks * kK, static_cast<int32_t>(row0), &full[slot.stage]);
          tma_load(stage + kSlabBytes, w, ks * kK, v0, &full[slot.stage]);
          slot.advance();
        }
      };
      for (int64_t tile = first; tile < last; ++tile) {
        const int32_t v0 = static_cast<int32_t>(tile * kCols);
        stream(&maps.xs, &maps.ws, k_slabs_s, v0);
        stream(&maps.xt, &maps.wt, k_slabs_t, v0);
      }
    }
  } else {  // consumers
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int consumer = warpgroup - 1, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const FragmentRows rows(a, row0 + 64 * consumer + 16 * warp);
    Pass pass(a, rows, params);
    RingSlot slot;
    int pending = -1;  // stage whose wgmma group may still be reading it
    auto release = [&](int stage) {
      if (lane == 0) mbar_arrive(&empty[stage]);
    };
    auto multiply = [&](TileAcc<16>& acc, int k_slabs) {
      for (int ks = 0; ks < k_slabs; ++ks) {
        mbar_wait(&full[slot.stage], slot.phase);
        const uint8_t* stage = smem + slot.stage * kStageBytes;
        const uint64_t desc_x = smem_desc(stage + consumer * (kSlabBytes / 2));
        const uint64_t desc_w = smem_desc(stage + kSlabBytes);
        fence_acc(acc);
        wgmma_fence();
#pragma unroll
        for (int k16 = 0; k16 < kK / 16; ++k16) {
          wgmma_m64n128k16<T>(acc, desc_x + 2 * k16, desc_w + 2 * k16, ks > 0 || k16 > 0);
        }
        wgmma_commit();
        fence_acc(acc);
        wgmma_wait<1>();  // the previous slab's products are done: its stage can be refilled
        if (pending >= 0) release(pending);
        pending = slot.stage;
        slot.advance();
      }
    };
    TileAcc<16> zs, zt;
    for (int64_t tile = first; tile < last; ++tile) {
      multiply(zs, k_slabs_s);
      multiply(zt, k_slabs_t);
      wgmma_wait<0>();
      fence_acc(zs);
      fence_acc(zt);
      release(pending);
      pending = -1;
      apply_softcaps(zs, zt, a.softcap_s, a.softcap_t);
      pass.tile(a, rows, tile * kCols, zs, zt);
    }
    pass.finish(a, rows, split);
  }
#endif
}

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
