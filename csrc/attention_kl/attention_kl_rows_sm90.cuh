// The skeleton shared by the Hopper attention kernels whose block keeps its query rows of both
// models in shared memory and streams both models' key tiles through a ring of stages: the
// forward (fwd_sm90.cu) and the deterministic dq kernel (bwd_dq_sm90.cu).
// Here: the shared-memory layout and its barriers, the block's query tile, and the producer
// thread's loads. Operands are 32-wide head-dim slabs in 64-byte swizzled rows (head_tensor_map's
// TMA boxes); a stage holds the student's slabs, then the teacher's from slab kMaxSlabs on.
#pragma once

#include "../engine/cuda/sm90/ptx.cuh"
#include "../engine/cuda/sm90/ring.cuh"
#include "attention_kl_kernels.h"

#include <cstdint>

namespace nitrobrew {
namespace cuda {
namespace attention {

// kRows query rows and kCols-key tiles, kStages stages, kConsumerWarps warps releasing each stage.
template <int kRows, int kCols, int kStages, int kConsumerWarps>
struct RowsAndKeyRing {
  static constexpr int kK = hopper::kK;  // 32 values: one 64-byte swizzled row
  static constexpr int kMaxSlabs = 4;    // head dims up to 128
  static constexpr int kRowSlabBytes = kRows * kK * 2;
  static constexpr int kColSlabBytes = kCols * kK * 2;
  static constexpr int kRowBytes = kMaxSlabs * kRowSlabBytes;  // one model's query rows
  static constexpr int kStageBytes = 2 * kMaxSlabs * kColSlabBytes;
  static constexpr int kSmemBytes = 1024 + 2 * kRowBytes + kStages * kStageBytes + (2 * kStages + 1) * 8;

  uint8_t* rows_s;
  uint8_t* rows_t;
  uint8_t* ring;
  uint64_t* full;       // [kStages]: a stage's key slabs landed
  uint64_t* empty;      // [kStages]: every consumer warp is done with a stage
  uint64_t* rows_full;  // the query rows landed

  // Lays out the block's dynamic shared memory (aligned to 1024 bytes for the swizzle) and has
  // thread 0 initialize the barriers. Every thread of the block calls it: it synchronizes them.
  __device__ __forceinline__ explicit RowsAndKeyRing(uint8_t* smem_raw) {
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    rows_s = smem;
    rows_t = smem + kRowBytes;
    ring = smem + 2 * kRowBytes;
    full = reinterpret_cast<uint64_t*>(ring + kStages * kStageBytes);
    empty = full + kStages;
    rows_full = empty + kStages;
    if (threadIdx.x == 0) {
      for (int s = 0; s < kStages; ++s) {
        hopper::mbar_init(&full[s], 1);
        hopper::mbar_init(&empty[s], kConsumerWarps);
      }
      hopper::mbar_init(rows_full, 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }

  // The producer thread: the query rows [row0, row0 + kRows) of (batch, head) of both models once
  // (onto rows_full), then key tiles [0, key_tiles) of both models' key heads into the next free
  // stage each. on_stage(tile) runs when a stage is free, before its loads (the forward's timeline
  // stamps).
  template <typename T, typename OnStage>
  __device__ __forceinline__ void produce(const AttentionArgs<T>& a, const CUtensorMap* q_s, const CUtensorMap* q_t,
                                          const CUtensorMap* k_s, const CUtensorMap* k_t, int32_t batch, int head,
                                          int row0, int key_tiles, int slabs_s, int slabs_t, OnStage on_stage) const {
    using namespace hopper;
    mbar_arrive_expect_tx(rows_full, (slabs_s + slabs_t) * kRowSlabBytes);
    for (int ks = 0; ks < slabs_s; ++ks) {
      tma_load_4d(rows_s + ks * kRowSlabBytes, q_s, ks * kK, head, row0, batch, rows_full);
    }
    for (int ks = 0; ks < slabs_t; ++ks) {
      tma_load_4d(rows_t + ks * kRowSlabBytes, q_t, ks * kK, head, row0, batch, rows_full);
    }
    const int head_s = a.key_head_s(head), head_t = a.key_head_t(head);
    RingPosition<kStages> slot;
    for (int tile = 0; tile < key_tiles; ++tile) {
      mbar_wait(&empty[slot.stage], slot.phase ^ 1);
      on_stage(tile);
      uint8_t* stage = ring + slot.stage * kStageBytes;
      mbar_arrive_expect_tx(&full[slot.stage], (slabs_s + slabs_t) * kColSlabBytes);
      for (int ks = 0; ks < slabs_s; ++ks) {
        tma_load_4d(stage + ks * kColSlabBytes, k_s, ks * kK, head_s, tile * kCols, batch, &full[slot.stage]);
      }
      for (int ks = 0; ks < slabs_t; ++ks) {
        tma_load_4d(stage + (kMaxSlabs + ks) * kColSlabBytes, k_t, ks * kK, head_t, tile * kCols, batch,
                    &full[slot.stage]);
      }
      slot.advance();
    }
  }
};

// The block's kRows queries of (b, head), heaviest query tiles (the causal mask's last rows) first
// and all heads of one tile together, and the kCols-key tiles they see.
template <int kRows, int kCols>
struct QueryTile {
  int64_t bh, b;
  int head, row0, key_tiles;

  template <typename T>
  __device__ __forceinline__ explicit QueryTile(const AttentionArgs<T>& a) {
    const int q_tiles = (a.n_q + kRows - 1) / kRows;
    bh = blockIdx.x % (a.batch * a.heads);
    row0 = (q_tiles - 1 - static_cast<int>(blockIdx.x / (a.batch * a.heads))) * kRows;
    b = bh / a.heads;
    head = static_cast<int>(bh % a.heads);
    const int key_end = min(a.n_k, a.last_key(min(kRows, a.n_q - row0) + row0 - 1) + 1);
    key_tiles = key_end > 0 ? (key_end + kCols - 1) / kCols : 0;
  }
};

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
