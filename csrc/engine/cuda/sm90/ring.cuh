// The slab ring of the sm_90a kernels: a producer warp streams 32-wide K slabs of the operands
// into a ring of kStages shared-memory stages with TMA (cp.async.bulk.tensor, 64-byte swizzle);
// each stage has a "full" mbarrier (bytes landed) and an "empty" one (consumers done) and is
// refilled as soon as its consumers release it. Here: the vocabulary walk's tile shape and
// shared-memory budget, the order in which blocks take (row block, split), the producer (Loader),
// the consumers' view (Ring: wait, multiply with wgmma, release) and the parked tile. Clusters of
// 2 blocks share each W slab (multicast). The walk kernel that runs them is vocab_walk.cuh's.
#pragma once

#include <cuda.h>

#include "ptx.cuh"
#include "wgmma.cuh"

namespace nitrobrew {
namespace cuda {
namespace hopper {

constexpr int kRows = 128;      // block tile rows: 2 consumer warpgroups x 64
// kCols (wgmma.cuh): 256 vocabulary entries per tile (192 with 6 stages was 8% slower)
constexpr int kK = 32;          // K per slab: 32 16-bit values = one 64-byte swizzle row
constexpr int kStages = 4;      // shared-memory ring depth
// A producer warpgroup (whose warp 0 alone loads) and 2 consumer warpgroups. Loads must never
// wait for the consumers' math: with thread 0 of a consumer producing, the kernel ran at the
// speed of a copy-only model of its loads (tools/experiments/tma_stream_bench.cu, docs/notes/measurement.md). The
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

// The four operands as TMA descriptors (built on the host, read by the copy engine).
struct TensorMaps {
  CUtensorMap xs, xt, ws, wt;
};

// Which (row block, vocabulary split) a block takes. The `cluster` blocks of a cluster take
// consecutive row blocks of one split (VocabWalk::launch pairs them only when their count is even;
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
// ran 2% slower, docs/notes/fused_linear_forward.md, so they take whole tiles.)
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
// shape and changed nothing measurable on the Qwen shape: docs/notes/fused_linear_forward.md.)
template <int kCluster>
struct Loader {
  static constexpr int kWBoxRows = kCols / kCluster;  // the W maps' box (VocabWalk::launch)
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
// than their products took; docs/notes/attention_kl.md, v11).
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

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
