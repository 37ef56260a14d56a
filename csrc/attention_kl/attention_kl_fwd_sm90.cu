// Attention-KL forward on Hopper (sm_90a), head dims up to 128: TMA + wgmma with both models'
// query rows resident in shared memory and three consumer warpgroups taking turns on the tensor
// cores.
//
// A block owns 192 query rows of one head. Thread 0 of a producer warpgroup loads the rows of
// both models once (4-D TMA boxes straight from the [B, N, H, D] views, 32-wide head-dim slabs
// in 64-byte swizzled rows), then streams 96-key tiles of both models through a ring of two
// stages. Each of three consumer warpgroups owns 64 rows; per key tile it
//   1. multiplies its student and teacher rows by the tile's keys (wgmma.m64n96k16, both
//      operands in shared memory): the two 64 x 96 score tiles, in registers (48 each);
//   2. folds both into its rows' one-pass KL states (TwoRowKL, shared with the mma.sync kernel).
// Named barriers make the warpgroups issue their products in turn (0, 1, 2, 0, ...), so that the
// tensor cores multiply for one while the other two fold (FlashAttention-3's ping-pong, with a
// third warpgroup because the fold, two exponentials per score pair, takes about twice as long
// as the products: docs/notes/attention_kl.md, v10). Compiled for every architecture, the kernel body
// exists only in the sm_90a pass; the host launches it only where that binary is loaded.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "../engine/cuda/sm90/tma.h"
#include "../engine/cuda/sm90/wgmma_forms.cuh"
#include "attention_kl_rows_sm90.cuh"
#include "attention_kl_tiles.cuh"

namespace nitrobrew {
namespace cuda {
namespace attention {

// (Outside the anonymous namespace: in the passes where the kernel body is compiled out, an
// unused internal member function draws nvcc warning 177.)
struct AttentionMaps {
  CUtensorMap q_s, q_t, k_s, k_t;  // head_tensor_map: boxes of 192 queries, 96 keys
  int64_t* timeline;               // the kTimeline build's clock stamps (below), else null
};

namespace {

constexpr int kStages = 2;
constexpr int kProducerThreads = 128;

// Three consumer warpgroups of 64 query rows each beside the producer warpgroup: a warpgroup's fold
// (two exponentials per score pair) takes about twice its products' time, so with two (the
// previous block: 128 queries x 128 keys) the tensor cores idled while both folded; with three,
// two fold while one multiplies. Registers: 160 per consumer thread (the producer keeps 24), so
// the key tiles are 96 wide (two 64 x 96 score tiles, 96 registers).
constexpr int kConsumers = 3;
constexpr int kRows = 64 * kConsumers;  // queries per block
constexpr int kCols = 96;               // keys per tile (the wgmma N)
constexpr int kConsumerThreads = 128 * kConsumers, kThreadCount = kProducerThreads + kConsumerThreads;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kConsumerRegisters = 160;
using Layout = RowsAndKeyRing<kRows, kCols, kStages, kConsumerWarps>;
constexpr int kK = Layout::kK, kMaxSlabs = Layout::kMaxSlabs;
// The kernel body's constants ([[maybe_unused]]: the passes for other architectures compile it out).
[[maybe_unused]] constexpr int kRowSlabBytes = Layout::kRowSlabBytes, kColSlabBytes = Layout::kColSlabBytes;
[[maybe_unused]] constexpr int kStageBytes = Layout::kStageBytes;
constexpr int kSmemBytes = Layout::kSmemBytes;
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a block may have");
static_assert(kConsumerThreads * kConsumerRegisters + kProducerThreads * 24 <= 65536, "more registers than an SM has");

using Scores = TileAcc<kCols / 8>;  // a consumer thread's share of a 64 x 96 score tile

// A measuring build (NITROBREW_FWD_TIMELINE in a development build, below): clock64 stamps per block and key tile (the
// first kTimelineTiles), kStamps each: per consumer warpgroup (warp 0, lane 0) before and after
// the stage's wait, after its turn, after issuing, after the products, after the fold; then the
// producer after each wait for a free stage. Where the tile step's time goes, in cycles.
[[maybe_unused]] constexpr int kTimelineTiles = 64;  // the kernel body's (sm_90a) and the timeline knob's
enum Stamp { kWaitFull, kGotFull, kGotTurn, kIssued, kProductsDone, kFolded, kConsumerStamps };
[[maybe_unused]] constexpr int kStamps = kConsumers * kConsumerStamps + 1;

template <bool kTimeline>
__device__ __forceinline__ void stamp(int64_t* timeline, int tile, int slot) {
  if constexpr (kTimeline) {
    if (tile < kTimelineTiles) {
      long long t;
      asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
      timeline[(static_cast<int64_t>(blockIdx.x) * kTimelineTiles + tile) * kStamps + slot] = t;
    }
  }
}

// Named barriers 1 .. kConsumers: consumer warpgroup c waits on 1 + c before issuing its products
// and then lets the next one (c + 1, cyclically) go; each completes when the two warpgroups (256
// threads) reached it.
[[maybe_unused]] __device__ __forceinline__ void turn_wait(int consumer) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + consumer) : "memory");
}
[[maybe_unused]] __device__ __forceinline__ void turn_pass(int consumer) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + (consumer + 1) % kConsumers) : "memory");
}

template <typename T, bool kReverse, bool kTimeline>
__global__ void __launch_bounds__(kThreadCount, 1)
    attention_kl_fwd_hopper_kernel(const __grid_constant__ AttentionMaps maps, const AttentionArgs<T> a) {
#if NITROBREW_SM90A_DEVICE
  using namespace hopper;
  extern __shared__ uint8_t smem_raw[];
  const Layout smem(smem_raw);
  const QueryTile<kRows, kCols> block(a);
  const int64_t bh = block.bh, b = block.b;
  const int i0 = block.row0, k_tiles = block.key_tiles;
  const int slabs_s = (a.d_s + kK - 1) / kK, slabs_t = (a.d_t + kK - 1) / kK;

  // As in the vocabulary walk (engine/cuda/vocab_walk.cuh): a producer warpgroup whose thread 0 only loads,
  // its registers given to the consumers; each role is one branch, for setmaxnreg.
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 0 && k_tiles > 0) {
      smem.produce(a, &maps.q_s, &maps.q_t, &maps.k_s, &maps.k_t, static_cast<int32_t>(b), block.head, i0, k_tiles,
                   slabs_s, slabs_t,
                   [&](int tile) { stamp<kTimeline>(maps.timeline, tile, kConsumers * kConsumerStamps); });
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
    const int thread = threadIdx.x - kProducerThreads;
    // Read through a shuffle from lane 0, so that the compiler knows it is the same in the whole
    // warp and keeps what derives from it (the descriptors) in uniform registers.
    const int consumer = __shfl_sync(0xffffffffu, thread / 128, 0);
    const int warp = (thread / 32) % 4, lane = thread % 32;
    const int row0 = i0 + 64 * consumer + 16 * warp + lane / 4;  // the thread's rows: row0, row0 + 8
    TwoRowKL state = TwoRowKL::make<kReverse>(a.c_s, a.c_t);
    if (k_tiles > 0) {
      mbar_wait(smem.rows_full, 0);
      if (consumer == kConsumers - 1) turn_pass(consumer);  // warpgroup 0 multiplies first
    }
    const bool stamps = kTimeline && thread % 128 == 0;
    auto mark = [&](int tile, Stamp what) {
      if (stamps) stamp<kTimeline>(maps.timeline, tile, consumer * kConsumerStamps + what);
    };
    const uint64_t rows_desc_s = smem_desc(smem.rows_s + consumer * (kRowSlabBytes / kConsumers));
    const uint64_t rows_desc_t = smem_desc(smem.rows_t + consumer * (kRowSlabBytes / kConsumers));
    const uint64_t ring_desc = smem_desc(smem.ring);
    const uint32_t full_addr = smem_addr(smem.full), empty_addr = smem_addr(smem.empty);
    hopper::RingPosition<kStages> slot;
    for (int tile = 0; tile < k_tiles; ++tile) {
      mark(tile, kWaitFull);
      mbar_wait(full_addr + 8 * slot.stage, slot.phase);
      mark(tile, kGotFull);
      Scores s, t;
      turn_wait(consumer);
      mark(tile, kGotTurn);
      wgmma_scores_of_stage<T, kRowSlabBytes, kColSlabBytes, kMaxSlabs>(
          s, t, rows_desc_s, rows_desc_t, ring_desc + slot.stage * desc_step(kStageBytes), slabs_s, slabs_t);
      turn_pass(consumer);
      mark(tile, kIssued);
      wgmma_wait<0>();
      fence_acc(s);
      fence_acc(t);
      mark(tile, kProductsDone);
      __syncwarp();  // the warp's products have read the stage before lane 0 releases it
      if (lane == 0) mbar_arrive(empty_addr + 8 * slot.stage);
      slot.advance();

      const int j0 = tile * kCols, col0 = j0 + 2 * (lane % 4);
      const bool masked =
          a.key_mask != nullptr || j0 + kCols > a.n_k || (a.causal && j0 + kCols - 1 > a.last_key(i0));
      if (masked) {
        state.fold<kReverse, true>(s, t, [&](int j, int e) {
          return a.visible(b, row0 + 8 * (e / 2), col0 + 8 * j + (e & 1));
        });
      } else {
        state.fold<kReverse, false>(s, t, [](int, int) { return true; });
      }
      mark(tile, kFolded);
    }
    // The last warpgroup passed the turn once more than warpgroup 0 took it: take it, so that no
    // arrival is left on the barrier when the block exits.
    if (k_tiles > 0 && consumer == 0) turn_wait(consumer);
    state.write_rows<kReverse>(a, bh, row0, lane);
  }
#endif
}

#ifdef NITROBREW_DEV_KNOBS
// Development builds only (NITROBREW_DEV_KNOBS=1 at build time; docs/development.md):
// NITROBREW_FWD_TIMELINE=FILE (bfloat16, forward KL) runs the stamping build of the kernel and
// writes its stamps to FILE (int64: blocks, kTimelineTiles, kStamps, then the stamps; each block's
// clock is its SM's). Synchronizes the device: a measuring tool (tools/profiling/fwd_timeline.py).
template <typename T>
bool run_timeline(AttentionMaps maps, const AttentionArgs<T>& a, int64_t blocks, cudaStream_t stream) {
  const char* path = std::getenv("NITROBREW_FWD_TIMELINE");
  if constexpr (!std::is_same_v<T, __nv_bfloat16>) return false;
  if (path == nullptr || a.reverse) return false;
  const int64_t count = blocks * kTimelineTiles * kStamps;
  const at::Tensor stamps = at::zeros({count}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  maps.timeline = stamps.data_ptr<int64_t>();
  auto* kernel = &attention_kl_fwd_hopper_kernel<__nv_bfloat16, false, true>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<static_cast<unsigned>(blocks), kThreadCount, kSmemBytes, stream>>>(
      maps, reinterpret_cast<const AttentionArgs<__nv_bfloat16>&>(a));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const at::Tensor host = stamps.cpu();
  const int64_t header[3] = {blocks, kTimelineTiles, kStamps};
  FILE* f = std::fopen(path, "wb");
  TORCH_CHECK(f != nullptr, "NITROBREW_FWD_TIMELINE: cannot write ", path);
  std::fwrite(header, sizeof(int64_t), 3, f);
  std::fwrite(host.data_ptr<int64_t>(), sizeof(int64_t), count, f);
  std::fclose(f);
  return true;
}
#endif  // NITROBREW_DEV_KNOBS

}  // namespace

bool attention_kl_hopper_supports(int64_t d_s, int64_t d_t) {
  return d_s <= kMaxSlabs * kK && d_t <= kMaxSlabs * kK;
}

template <typename T>
void launch_attention_kl_forward_hopper(const AttentionArgs<T>& a, const at::Tensor& q_s, const at::Tensor& k_s,
                                        const at::Tensor& q_t, const at::Tensor& k_t, cudaStream_t stream) {
  TORCH_CHECK(attention_kl_hopper_supports(a.d_s, a.d_t), "attention_kl: head dims over 128");
  const AttentionMaps maps{head_tensor_map(q_s, kRows), head_tensor_map(q_t, kRows),
                           head_tensor_map(k_s, kCols), head_tensor_map(k_t, kCols), nullptr};
  const int64_t blocks = a.batch * a.heads * ((a.n_q + kRows - 1) / kRows);
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (batch, head, query tile) blocks: ", blocks);
#ifdef NITROBREW_DEV_KNOBS
  if (run_timeline(maps, a, blocks, stream)) return;
#endif
  auto* kernel = a.reverse ? &attention_kl_fwd_hopper_kernel<T, true, false>
                           : &attention_kl_fwd_hopper_kernel<T, false, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  kernel<<<static_cast<unsigned>(blocks), kThreadCount, kSmemBytes, stream>>>(maps, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_attention_kl_forward_hopper(const AttentionArgs<__nv_bfloat16>&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                 cudaStream_t);
template void launch_attention_kl_forward_hopper(const AttentionArgs<__half>&, const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const at::Tensor&, cudaStream_t);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
