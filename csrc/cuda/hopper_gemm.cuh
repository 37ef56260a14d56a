// The sm_90a tile GEMM of the CUDA fused-linear kernels: TMA-fed wgmma. Compiled for every architecture the package ships, but the kernel body
// exists only in the sm_90a pass (elsewhere it is empty and never launched: the host picks
// this path only where the loaded binary is sm_90a, see logit_passes.cu).
//
// A block computes 128-row x 256-vocabulary logit tiles of the student and the teacher:
//   warpgroup 0 (producer; its warp 0 alone, Loader): streams 32-wide K slabs of X (128 rows)
//     and W (256 rows) into a ring of kStages shared-memory stages with cp.async.bulk.tensor
//     (TMA, 64-byte swizzle); each stage has a "full" mbarrier (TMA bytes landed) and an
//     "empty" one (consumers are done), and is refilled as soon as both consumers release it.
//     With an even number of row blocks, blocks run in clusters of 2 (two row blocks of one
//     vocabulary split): each producer loads its own X slab and half of the W slab, multicast to
//     both blocks, and a stage is refilled once the consumers of both have released it;
//   warpgroups 1, 2 (consumers): each multiplies its 64 rows of the X slab by the W slab with
//     wgmma.m64n256k16 into float32 accumulators in registers: first the student tile, which
//     it then parks in shared memory (ParkedTile), then the teacher tile in the same
//     registers; the pass (fused_linear_passes.cuh) reads both while the producer already
//     streams the next tile's slabs. The KL pass folds the student's side of most tiles while
//     the teacher's products run, a piece after each slab's products are issued
//     (KLPass::student_piece): the fold is time in which neither warpgroup multiplies. The
//     student-only passes park each tile and fold it while the next tile's products run.
// Why park: the two logit tiles must both exist when a tile is folded, and registers hold only
// 128 x 128 of each. Parking the student tile (128 KB) allows 128 x 256 tiles, which ran 5%
// faster than 128 x 128 ones with both tiles in registers. benchmarks/NOTES.md has the
// measurements and the variants tried.
// A wgmma accumulator of 64 x 256 has, per warp, the register layout of 32 mma.m16n8 tiles
// (tile_gemm.cuh), so the passes serve both paths unchanged.
#pragma once

#include <cuda.h>

#include "fused_linear_passes.cuh"
#include "sm90_ptx.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NITROBREW_SM90A_DEVICE 1
#else
#define NITROBREW_SM90A_DEVICE 0
#endif

namespace nitrobrew {
namespace cuda {
namespace hopper {

constexpr int kRows = 128;      // block tile rows: 2 consumer warpgroups x 64
constexpr int kCols = 256;      // vocabulary entries per tile (the wgmma N; 192 with 6 stages was 8% slower)
constexpr int kK = 32;          // K per slab: 32 16-bit values = one 64-byte swizzle row
constexpr int kStages = 4;      // shared-memory ring depth
// A producer warpgroup (whose warp 0 alone loads) and 2 consumer warpgroups. Loads must never
// wait for the consumers' math: with thread 0 of a consumer producing, the kernel ran at the
// speed of a copy-only model of its loads (tools/tma_stream_bench.cu, benchmarks/NOTES.md). The
// 3 warps per SM sub-partition start at 168 registers each; setmaxnreg then moves the
// producer's to the consumers (240 each: the 128-register accumulator and the pass need ~200;
// the KL pass spills ~350 bytes, as it did with 255).
constexpr int kProducerThreads = 128;
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kProducerThreads + kConsumerThreads;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kXSlabBytes = kRows * kK * 2;
constexpr int kWSlabBytes = kCols * kK * 2;
constexpr int kStageBytes = kXSlabBytes + kWSlabBytes;
constexpr int kParkBytes = kRows * kCols * 4;
constexpr int kSmemBytes = kStages * kStageBytes + kParkBytes + 1024 /* alignment */ + 2 * kStages * 8;
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a block may have");
using WideAcc = TileAcc<kCols / 8>;  // a consumer thread's share of a 64 x kCols tile

// The four operands as TMA descriptors (built on the host, read by the copy engine).
struct TensorMaps {
  CUtensorMap xs, xt, ws, wt;
};

// Which (row block, vocabulary split) a block takes. The `cluster` blocks of a cluster take
// consecutive row blocks of one split (logit_passes.cu pairs them only when their count is even;
// with an odd count the last block would lie past the rows, load zeros and write nothing, but
// still stream its share of the W slabs). Clusters are numbered so that those
// running together cover `group` consecutive clusters' row blocks and a run of splits: the X rows
// of a group stay in L2 while its blocks walk the vocabulary, and each W tile is read from memory
// once per group rather than once per row block.
struct BlockOrder {
  int64_t row_units, splits;  // row_units: row blocks / cluster, rounded up
  int64_t group;
  int64_t cluster;
  __device__ __forceinline__ void decode(int64_t id, int64_t& row_block, int64_t& split) const {
    const int64_t unit = id / cluster, rank = id % cluster;
    const int64_t per_group = group * splits;
    const int64_t g = unit / per_group, r = unit % per_group;
    const int64_t units_here = min(group, row_units - g * group);
    row_block = cluster * (g * group + r % units_here) + rank;
    split = r / units_here;
  }
};

// wgmma shared-memory descriptor of a K-major operand in 64-byte-swizzled rows (as TMA wrote
// them): 8-row groups 512 bytes apart (SBO); the leading offset is unused for this layout.
// Advancing K by 16 values adds 32 bytes, i.e. 2 to the encoded start address.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(512 >> 4) << 32) | (uint64_t(2) << 62);
}

// A descriptor's start address is in 16-byte units: moving the operand by `bytes` adds bytes / 16.
constexpr uint64_t desc_step(int bytes) { return static_cast<uint64_t>(bytes) >> 4; }

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

// Pieces of the wgmma asm statements (here and in wgmma_ops.cuh): the accumulator's "+f"
// operands, 4 per n-tile of 8 columns (TileAcc's v[j][e] in order), and their register names.
#define NITROBREW_ACC_TILE(d, j) "+f"(d.v[j][0]), "+f"(d.v[j][1]), "+f"(d.v[j][2]), "+f"(d.v[j][3])
#define NITROBREW_ACC_0_7(d) \
  NITROBREW_ACC_TILE(d, 0), NITROBREW_ACC_TILE(d, 1), NITROBREW_ACC_TILE(d, 2), NITROBREW_ACC_TILE(d, 3), \
      NITROBREW_ACC_TILE(d, 4), NITROBREW_ACC_TILE(d, 5), NITROBREW_ACC_TILE(d, 6), NITROBREW_ACC_TILE(d, 7)
#define NITROBREW_ACC_8_15(d) \
  NITROBREW_ACC_TILE(d, 8), NITROBREW_ACC_TILE(d, 9), NITROBREW_ACC_TILE(d, 10), NITROBREW_ACC_TILE(d, 11), \
      NITROBREW_ACC_TILE(d, 12), NITROBREW_ACC_TILE(d, 13), NITROBREW_ACC_TILE(d, 14), NITROBREW_ACC_TILE(d, 15)
#define NITROBREW_ACC_16_31(d) \
  NITROBREW_ACC_TILE(d, 16), NITROBREW_ACC_TILE(d, 17), NITROBREW_ACC_TILE(d, 18), NITROBREW_ACC_TILE(d, 19), \
      NITROBREW_ACC_TILE(d, 20), NITROBREW_ACC_TILE(d, 21), NITROBREW_ACC_TILE(d, 22), NITROBREW_ACC_TILE(d, 23), \
      NITROBREW_ACC_TILE(d, 24), NITROBREW_ACC_TILE(d, 25), NITROBREW_ACC_TILE(d, 26), NITROBREW_ACC_TILE(d, 27), \
      NITROBREW_ACC_TILE(d, 28), NITROBREW_ACC_TILE(d, 29), NITROBREW_ACC_TILE(d, 30), NITROBREW_ACC_TILE(d, 31)
#define NITROBREW_REGS_0_31 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define NITROBREW_REGS_32_63 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define NITROBREW_REGS_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d (+)= A . B^T for a 64 x 16 slice of A and a kCols x 16 slice of B; scale_d = 0 overwrites
// d (the first product of a tile: zeroing d with ordinary instructions would serialize wgmma).
// TYPE is the PTX type of A and B.
#define NITROBREW_WGMMA_TILE(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 ", " NITROBREW_REGS_32_63 ", " NITROBREW_REGS_64_127 "}, " \
      "%128, %129, p, 1, 1, 0, 0;\n}\n" \
      : NITROBREW_ACC_0_7(d), NITROBREW_ACC_8_15(d), NITROBREW_ACC_16_31(d) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

template <typename T>
__device__ __forceinline__ void wgmma_tile(WideAcc& d, uint64_t desc_a, uint64_t desc_b, int scale_d);

template <>
__device__ __forceinline__ void wgmma_tile<__nv_bfloat16>(WideAcc& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  NITROBREW_WGMMA_TILE("bf16");
#endif
}

template <>
__device__ __forceinline__ void wgmma_tile<__half>(WideAcc& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  NITROBREW_WGMMA_TILE("f16");
#endif
}

// A consumer thread's fragment of the student's logit tile, parked in shared memory while the
// teacher's tile occupies the registers: entry (j, k) of thread t at park[(4j + k) * 256 + t]
// (a warp touches 32 consecutive words: no bank conflicts). Only the thread that parks an
// entry reads it back, so no barrier is needed.
struct ParkedTile {
  static constexpr int kNTiles = kCols / 8;
  static constexpr int kThreadsParked = kConsumerThreads;
  static constexpr bool kRuntimeIndex = true;  // at(j, k) takes j and k known only at run time
  float* base;  // park + consumer thread index
  // A volatile load, so that the compiler reads each entry where the pass uses it rather than
  // hoisting all 128 loads ahead of the fold (which needs 128 more registers and spilled).
  __device__ __forceinline__ float at(int j, int k) const {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(v) : "r"(smem_addr(base + (4 * j + k) * kThreadsParked)));
    return v;
  }
  __device__ __forceinline__ void park(const WideAcc& acc) const {
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
      for (int k = 0; k < 4; ++k) base[(4 * j + k) * kThreadsParked] = acc.v[j][k];
    }
  }
};

// Columns [8 kOff, 8 kOff + 64) of a consumer's 256-wide tile (parked or in registers), read like a
// tile with .at(j, k). The attention kernel folds its tiles in such slices: folding a 256-wide
// tile at once spilled 1.4 KB. (The fused-linear passes in slices lost their 360-byte spill but
// ran 2% slower, benchmarks/NOTES.md, so they take whole tiles.)
template <typename Tile, int kOff>
struct TileSlice {
  static constexpr int kNTiles = 8;
  const Tile& tile;
  __device__ __forceinline__ float at(int j, int k) const { return tile.at(j + kOff, k); }
};

// Ring position shared by the producer and the consumers: both walk the same sequence of slabs
// through a ring of kDepth stages.
template <int kDepth>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kDepth) {
      stage = 0;
      phase ^= 1;
    }
  }
};
using RingSlot = RingPosition<kStages>;

// The producer: warp 0 of the producer warpgroup streams the block's slabs into the ring, in the
// order the consumers multiply them: per vocabulary tile, the student's K slabs, then the
// teacher's (none for a student-only pass: k_slabs_t = 0). In a cluster of kCluster blocks (row
// blocks of one split) it loads its own X slab and its share (`rank`) of the W slab, multicast to
// every block of the cluster; a stage is then refilled once the consumers of all of them have
// released it. Every lane walks the slabs, so the loop's values are warp-uniform, and one elected
// lane issues the barrier arrival and the copies; addresses are computed once. (A single producer
// thread took ~80 instructions, ~450 cycles, per slab on the H100 (ncu), each copy's operands going
// through an ELECT / R2UR / BRA.U.ANY loop; the warp made the forward 2.4% faster on Llama-3's
// shape and changed nothing measurable on the Qwen shape: benchmarks/NOTES.md.)
template <int kCluster>
struct Loader {
  static constexpr int kWBoxRows = kCols / kCluster;  // the W maps' box (logit_passes.cu)
  uint64_t map_xs, map_xt, map_ws, map_wt;
  uint32_t stage0;          // shared address of stage 0
  uint32_t full0, empty0;   // shared addresses of stage 0's barriers
  int32_t row0, w_row_offset;  // X rows; this block's share of each W slab
  uint32_t w_offset;           // its offset in the stage
  int64_t tile, last;
  int k_slabs_s, k_slabs_t;
  bool leader;
  int teacher = 0, ks = 0;
  RingSlot slot;

  __device__ __forceinline__ Loader(const TensorMaps* maps, const uint8_t* smem, uint64_t* full, uint64_t* empty,
                                    int32_t row0_, int64_t first, int64_t last_, int slabs_s, int slabs_t, int32_t rank)
      : map_xs(reinterpret_cast<uint64_t>(&maps->xs)),
        map_xt(reinterpret_cast<uint64_t>(&maps->xt)),
        map_ws(reinterpret_cast<uint64_t>(&maps->ws)),
        map_wt(reinterpret_cast<uint64_t>(&maps->wt)),
        stage0(smem_addr(smem)),
        full0(smem_addr(full)),
        empty0(smem_addr(empty)),
        row0(row0_),
        w_row_offset(rank * kWBoxRows),
        w_offset(kXSlabBytes + rank * kWBoxRows * kK * 2),
        tile(first),
        last(last_),
        k_slabs_s(slabs_s),
        k_slabs_t(slabs_t),
        leader(elect_one()) {}

  __device__ __forceinline__ void load_all() {
    while (tile < last) {
      const uint32_t full = full0 + 8 * slot.stage;
      mbar_wait(empty0 + 8 * slot.stage, slot.phase ^ 1);
      if (leader) {
        const uint32_t stage = stage0 + slot.stage * kStageBytes;
        const int32_t k = ks * kK, v0 = static_cast<int32_t>(tile * kCols);
        mbar_arrive_expect_tx(full, kStageBytes);
        tma_load(stage, teacher ? map_xt : map_xs, k, row0, full);
        if constexpr (kCluster == 1) {
          tma_load(stage + w_offset, teacher ? map_wt : map_ws, k, v0, full);
        } else {
          tma_load_multicast(stage + w_offset, teacher ? map_wt : map_ws, k, v0 + w_row_offset, full,
                             (1u << kCluster) - 1);
        }
      }
      __syncwarp();
      slot.advance();
      if (++ks == (teacher ? k_slabs_t : k_slabs_s)) {
        ks = 0;
        teacher = !teacher && k_slabs_t > 0;  // no teacher slabs: student-only passes
        if (!teacher) ++tile;
      }
    }
  }
};

// A consumer's view of the stage ring: waits for slabs, multiplies them, releases them. The
// producer (Loader, or the attention kernel's) refills each stage as soon as it is released.
// Barrier addresses and descriptors are computed once: the loop over slabs only adds the stage's
// offset (rebuilding them from pointers at every slab cost the attention kernels more issue time
// than their products took; benchmarks/NOTES.md, attention v11).
struct Ring {
  uint32_t full, empty;     // shared-memory addresses of the stages' barriers
  uint64_t desc_x, desc_w;  // stage 0's X slab (this consumer's 64 rows) and W slab
  RingSlot slot;
  int pending = -1;  // stage whose wgmma group may still be reading it
  int peer = -1;     // the other block of a cluster of 2 whose producer also fills this ring, or -1

  __device__ __forceinline__ Ring(const uint8_t* smem, uint64_t* full_bars, uint64_t* empty_bars, int consumer)
      : full(smem_addr(full_bars)),
        empty(smem_addr(empty_bars)),
        desc_x(smem_desc(smem + consumer * (kXSlabBytes / 2))),
        desc_w(smem_desc(smem + kXSlabBytes)) {}

  __device__ __forceinline__ void release(int stage, int lane) {
    if (lane == 0) {
      mbar_arrive(empty + 8 * stage);
      if (peer >= 0) mbar_arrive_remote(empty + 8 * stage, peer);
    }
  }

  // acc = this consumer's 64 rows x kCols of the tile over k_slabs slabs; all products are done
  // (and every stage released) on return.
  template <typename T>
  __device__ __forceinline__ void multiply(WideAcc& acc, int k_slabs, int lane) {
    multiply<T>(acc, k_slabs, lane, [](int) {});
  }

  // The same; on_slab(ks) runs after slab ks's products are issued, while they and the previous
  // slab's run (work that needs neither the accumulator nor the ring).
  template <typename T, typename OnSlab>
  __device__ __forceinline__ void multiply(WideAcc& acc, int k_slabs, int lane, OnSlab&& on_slab) {
    for (int ks = 0; ks < k_slabs; ++ks) {
      mbar_wait(full + 8 * slot.stage, slot.phase);
      const uint64_t stage = slot.stage * desc_step(kStageBytes);
      fence_acc(acc);
      wgmma_fence();
#pragma unroll
      for (int k16 = 0; k16 < kK / 16; ++k16) {
        wgmma_tile<T>(acc, desc_x + stage + desc_step(32 * k16), desc_w + stage + desc_step(32 * k16),
                      ks > 0 || k16 > 0);
      }
      wgmma_commit();
      fence_acc(acc);
      on_slab(ks);
      wgmma_wait<1>();  // the previous slab's products are done: its stage can be refilled
      if (pending >= 0) release(pending, lane);
      pending = slot.stage;
      slot.advance();
    }
    wgmma_wait<0>();
    fence_acc(acc);
    release(pending, lane);
    pending = -1;
  }
};

// Whether a pass folds the student's side of a tile while the teacher's products run
// (KLPass::student_piece).
template <typename Pass, typename = void>
constexpr bool kFoldsStudentSideFirst = false;
template <typename Pass>
constexpr bool kFoldsStudentSideFirst<Pass, std::void_t<decltype(Pass::kStudentPieces)>> = true;

// Whether a student-only pass folds each parked tile while the next tile's products run
// (StudentNormPass::tile_piece).
template <typename Pass, typename = void>
constexpr bool kFoldsBehindNextProduct = false;
template <typename Pass>
constexpr bool kFoldsBehindNextProduct<Pass, std::void_t<decltype(Pass::kTilePieces)>> = true;

// Launched in clusters of kCluster (1 or 2) blocks (logit_passes.cu).
template <typename T, typename Pass, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_logit_kernel(const __grid_constant__ TensorMaps maps, FusedLinearArgs<T> a, BlockOrder order,
                        VocabSchedule sched, typename Pass::Params params) {
#if NITROBREW_SM90A_DEVICE
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* park = reinterpret_cast<float*>(smem + kStages * kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes + kParkBytes);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kCluster * kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if constexpr (kCluster > 1) {
    cluster_sync();  // the peer's loads and releases need this block's barriers initialized
  } else {
    __syncthreads();
  }

  int64_t row_block, split;
  order.decode(blockIdx.x, row_block, split);
  const int64_t row0 = row_block * kRows;
  const int64_t first = sched.begin(split), last = sched.end(split);
  const int k_slabs_s = static_cast<int>((a.d_s + kK - 1) / kK);
  const int k_slabs_t = Pass::kStudentOnly ? 0 : static_cast<int>((a.d_t + kK - 1) / kK);

  // Each role is one branch, so that ptxas honours setmaxnreg: the producer warpgroup gives its
  // registers to the consumers. The counts must fit the block's launch allocation, 12 warps x
  // 168 (8 x 240 + 4 x 24 does exactly); a consumer asking for more would wait forever.
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x < 32) {
      const int32_t rank = static_cast<int32_t>(blockIdx.x % kCluster);
      Loader<kCluster> loader(&maps, smem, full, empty, static_cast<int32_t>(row0), first, last, k_slabs_s, k_slabs_t,
                              rank);
      loader.load_all();  // waits for each stage's release
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int thread = threadIdx.x - kProducerThreads;
    // consumer read through a shuffle from lane 0: the compiler then knows it is the same in the
    // whole warp and keeps the ring's descriptors in uniform registers.
    const int consumer = __shfl_sync(0xffffffffu, thread / 128, 0);
    const int warp = (thread / 32) % 4, lane = thread % 32;
    const FragmentRows rows(a, row0 + 64 * consumer + 16 * warp);
    const ParkedTile zs_parked{park + thread};
    Pass pass(a, rows, params);
    Ring ring(smem, full, empty, consumer);
    if constexpr (kCluster == 2) ring.peer = static_cast<int>(blockIdx.x % 2) ^ 1;
    static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 blocks");
    // One accumulator: the student's tile, parked, then the teacher's. (Two scoped variables
    // made the compiler keep both live, 256 registers, and spill.)
    WideAcc z;
    if constexpr (Pass::kStudentOnly && kFoldsBehindNextProduct<Pass>) {
      // Each tile inside the vocabulary is parked and folded while the next tile's products run, a
      // piece after each slab's products are issued (the rest after them where a product has
      // fewer slabs than the pass pieces); the last one after the loop.
      constexpr int kPieces = Pass::kTilePieces;
      int64_t parked = -1;  // first column of the parked tile still to fold, or -1
      for (int64_t tile = first; tile < last; ++tile) {
        ring.multiply<T>(z, k_slabs_s, lane, [&](int ks) {
          if (parked >= 0 && ks < kPieces) pass.tile_piece(a, rows, parked, ks, zs_parked);
        });
        if (parked >= 0) {
          for (int piece = k_slabs_s; piece < kPieces; ++piece) pass.tile_piece(a, rows, parked, piece, zs_parked);
        }
        apply_softcap(z, a.softcap_s);
        if (pass.folds_later(a, tile * kCols, kCols)) {
          zs_parked.park(z);
          parked = tile * kCols;
        } else {
          pass.tile(a, rows, tile * kCols, z, z);
          parked = -1;
        }
      }
      if (parked >= 0) {
        for (int piece = 0; piece < kPieces; ++piece) pass.tile_piece(a, rows, parked, piece, zs_parked);
      }
    } else {
      for (int64_t tile = first; tile < last; ++tile) {
        ring.multiply<T>(z, k_slabs_s, lane);
        apply_softcap(z, a.softcap_s);
        if constexpr (Pass::kStudentOnly) {
          pass.tile(a, rows, tile * kCols, z, z);
        } else {
          zs_parked.park(z);
          if constexpr (kFoldsStudentSideFirst<Pass>) {
            if (pass.student_side_first(a, tile * kCols, kCols)) {
              // The student's side of the fold runs while the teacher's products do, a piece per
              // slab (the rest after them where the teacher has fewer slabs than the pass pieces).
              constexpr int kPieces = Pass::kStudentPieces;
              ring.multiply<T>(z, k_slabs_t, lane, [&](int ks) {
                if (ks < kPieces) pass.student_piece(a, ks, zs_parked);
              });
              for (int piece = k_slabs_t; piece < kPieces; ++piece) pass.student_piece(a, piece, zs_parked);
              apply_softcap(z, a.softcap_t);
              pass.tile_after_student(a, zs_parked, z);
              continue;
            }
          }
          ring.multiply<T>(z, k_slabs_t, lane);
          apply_softcap(z, a.softcap_t);
          pass.tile(a, rows, tile * kCols, zs_parked, z);
        }
      }
    }
    pass.finish(a, rows, split);
  }
  if constexpr (kCluster > 1) cluster_sync();  // the peer may still load into this block's ring or release its stages
#endif
}

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
