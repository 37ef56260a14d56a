// The vocabulary walk: the kernels that multiply tiles of x . w^T for every vocabulary tile and
// hand each tile, still on chip, to a *pass* that folds it into per-row state (a forward) or turns
// it into dLoss/dz (a backward), and their host launcher. Knows no loss: the passes come from the
// loss families (fused_linear/passes.cuh, topk_linear/passes.cuh).
//
// Two kernel families, one pass interface:
//   mma_logit_kernel (sm_80 mma.sync, runs on sm_90 too): blocks of 4 warps, 64 x 64 tiles
//     (tile_gemm_sm80.cuh), several blocks per SM;
//   hopper::hopper_logit_kernel (sm_90a wgmma + TMA): one block per SM of a producer warp and two
//     consumer warpgroups, 128 x 256 tiles streamed through the slab ring (sm90/ring.cuh). The
//     student's tile is parked in shared memory (ParkedTile) while the teacher's is multiplied in
//     the same registers: registers hold 128 x 128 of each, and 128 x 256 tiles ran 5% faster
//     than 128 x 128 ones with both tiles in registers.
// A wgmma accumulator of 64 x 256 has, per warp, the register layout of 32 mma.m16n8 tiles, so a
// pass serves both families unchanged.
//
// A pass type provides
//   Args      the kernel arguments: T* xs, xt, ws, wt; row strides ld_xs, ld_xt, ld_ws, ld_wt;
//             n_rows, d_s, d_t, vocab_size; labels (or nullptr) and ignore_index, which mask rows
//             (FragmentRows); model_s, model_t (ModelLogits: what turns each product tile into
//             the model's logits); whatever else the pass reads;
//   Params    the pass's own outputs and inputs;
//   kStudentOnly  true: only xs . ws^T is multiplied (the tile is passed as both arguments);
//   Pass(a, rows, params); tile(a, rows, v0, zs, zt) for each tile at vocabulary offset v0, read
//   with .at(j, k) (registers or shared memory); finish(a, rows, split);
// and optionally the overlap hooks kStudentPieces / student_piece (fold the student's side while
// the teacher's products run) or kTilePieces / tile_piece / folds_later (fold a parked tile while
// the next tile's products run).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>

#include <algorithm>
#include <type_traits>

#include "../numerics.h"
#include "arch.h"
#include "cuda_types.h"
#include "model_logits.cuh"
#include "vocab_walk.h"
#include "sm90/ring.cuh"
#include "sm90/tma.h"
#include "tile_gemm_sm80.cuh"

namespace nitrobrew {
namespace cuda {

// Which vocabulary tiles the blocks of a launch walk: tiles [first_tile, end_tile), cut into
// splits of tiles_per_split consecutive tiles, one split per block (and row tile).
struct VocabSchedule {
  int64_t first_tile, end_tile, tiles_per_split;
  __device__ __forceinline__ int64_t begin(int64_t split) const { return first_tile + split * tiles_per_split; }
  __device__ __forceinline__ int64_t end(int64_t split) const {
    return min(begin(split) + tiles_per_split, end_tile);
  }
};


// The two rows of a logit tile that a thread's accumulator fragment covers (see
// tile_gemm_sm80.cuh): rows first + lane/4 and first + lane/4 + 8, where `first` is the warp's
// first row. Rows past the batch or whose label is ignore_index are not valid.
struct FragmentRows {
  int64_t row[2];
  bool valid[2];
  int64_t label[2];

  template <typename Args>
  __device__ __forceinline__ FragmentRows(const Args& a, int64_t first) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row[i] = first + lane / 4 + 8 * i;
      label[i] = -1;
      valid[i] = row[i] < a.n_rows;
      if (valid[i] && a.labels != nullptr) {
        label[i] = a.labels[row[i]];
        valid[i] = label[i] != a.ignore_index;
      }
    }
  }
};


// Column of entry e (0/1) of n-tile j of this thread's fragment, relative to the tile.
__device__ __forceinline__ int fragment_col(int j, int e) { return 8 * j + 2 * (threadIdx.x % 4) + e; }

template <typename T>
__device__ __forceinline__ Operand<T> rows_of(const T* base, int64_t ld, int64_t first, int64_t total) {
  return Operand<T>{base + first * ld, ld, total - first};
}

// A thread's fragment of the product tile at vocabulary offset v0 into the model's logits. Nothing
// to do for most models; a bias costs two loads per 8-column n-tile, which the block's other
// threads mostly find in L1. Columns past the vocabulary get no bias (the passes skip them).
template <typename T, int kN>
__device__ __forceinline__ void apply_model_logits(TileAcc<kN>& z, const ModelLogits<T>& f, int64_t v0,
                                                   int64_t vocab_size) {
  if (f.bias != nullptr) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = v0 + fragment_col(j, e);
        const float b = col < vocab_size ? to_acc<float>(f.bias[col]) : 0.f;
        z.v[j][e] += b;
        z.v[j][2 + e] += b;
      }
    }
  }
  // Separate loops, each behind its own uniform branch: one loop of model_logit (a multiply, then the
  // soft-cap's division and tanh behind a per-entry branch) cost the forward 35% with a scale alone,
  // its code inlined at every call site (N = 8192, Qwen shape, H100).
  if (f.scale != 1.f) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) z.v[j][e] *= f.scale;
    }
  }
  if (f.softcap > 0.f) {
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) z.v[j][e] = softcap(z.v[j][e], f.softcap);
    }
  }
}

// Computes the student and teacher logit tiles at vocabulary offset v0.
template <typename T, bool kVec, typename Args>
__device__ __forceinline__ void logit_tiles(Acc& zs, Acc& zt, SmemTile<T>& smem, const Args& a,
                                            int64_t row0, int64_t v0) {
  tile_gemm<T, kVec>(zs, smem, rows_of(a.xs, a.ld_xs, row0, a.n_rows), rows_of(a.ws, a.ld_ws, v0, a.vocab_size), a.d_s);
  tile_gemm<T, kVec>(zt, smem, rows_of(a.xt, a.ld_xt, row0, a.n_rows), rows_of(a.wt, a.ld_wt, v0, a.vocab_size), a.d_t);
  apply_model_logits(zs, a.model_s, v0, a.vocab_size);
  apply_model_logits(zt, a.model_t, v0, a.vocab_size);
}

// The blocks per SM an sm_80 kernel's pass asks the compiler to fit (__launch_bounds__' second argument):
// Pass::kMinBlocksPerSM where the pass sets it, else 1 (the compiler's choice).
template <typename Pass, typename = void>
constexpr int kMinBlocksPerSM = 1;
template <typename Pass>
constexpr int kMinBlocksPerSM<Pass, std::void_t<decltype(Pass::kMinBlocksPerSM)>> = Pass::kMinBlocksPerSM;

// The sm_80 path (mma.sync; runs on sm_90 too). Grid: (row tiles of 64, splits). Each block
// walks the vocabulary tiles of its split and hands each pair of logit tiles to the pass
// (e.g. fused_linear/passes.cuh), which folds it into per-row state or turns it into dLoss/dz.
template <typename T, bool kVec, typename Pass>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM<Pass>)
    mma_logit_kernel(typename Pass::Args a, VocabSchedule sched, typename Pass::Params params) {
  __shared__ SmemTile<T> smem;
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows, split = blockIdx.y;
  const FragmentRows rows(a, row0 + (threadIdx.x / 32) * 16);
  Pass pass(a, rows, params);
  Acc zs, zt;
  for (int64_t tile = sched.begin(split); tile < sched.end(split); ++tile) {
    const int64_t v0 = tile * kTileCols;
    if constexpr (Pass::kStudentOnly) {
      tile_gemm<T, kVec>(zs, smem, rows_of(a.xs, a.ld_xs, row0, a.n_rows), rows_of(a.ws, a.ld_ws, v0, a.vocab_size),
                         a.d_s);
      apply_model_logits(zs, a.model_s, v0, a.vocab_size);
      pass.tile(a, rows, v0, zs, zs);
    } else {
      logit_tiles<T, kVec>(zs, zt, smem, a, row0, v0);
      pass.tile(a, rows, v0, zs, zt);
    }
  }
  pass.finish(a, rows, split);
}

namespace hopper {

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

// Launched in clusters of kCluster (1 or 2) blocks (VocabWalk::launch).
template <typename T, typename Pass, int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
    hopper_logit_kernel(const __grid_constant__ TensorMaps maps, typename Pass::Args a, BlockOrder order,
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
        apply_model_logits(z, a.model_s, tile * kCols, a.vocab_size);
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
        apply_model_logits(z, a.model_s, tile * kCols, a.vocab_size);
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
              apply_model_logits(z, a.model_t, tile * kCols, a.vocab_size);
              pass.tile_after_student(a, zs_parked, z);
              continue;
            }
          }
          ring.multiply<T>(z, k_slabs_t, lane);
          apply_model_logits(z, a.model_t, tile * kCols, a.vocab_size);
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

// ---- host ----

// Where a launch starts and how it cuts the vocabulary.
struct LaunchPlan {
  VocabSchedule sched;
  int64_t splits;
  int64_t group_row_blocks;  // the wgmma path's BlockOrder group
};

namespace detail {

// The sm_90a kernel in clusters of kCluster blocks. With an even number of row blocks they run in
// pairs that share each W slab (each block loads half of it, multicast to both): the KL and
// gradient passes ran ~3% faster so (N = 8192; docs/notes/fused_linear_forward.md, v12). An odd count runs
// unpaired rather than pair its last block with an empty one.
template <typename T, typename Pass, int kCluster>
void launch_hopper(const typename Pass::Args& a, const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                   const at::Tensor& wt, const LaunchPlan& plan, const typename Pass::Params& params,
                   cudaStream_t stream) {
  constexpr int kWBoxRows = hopper::Loader<kCluster>::kWBoxRows;
  const hopper::TensorMaps maps{tensor_map(xs, a.n_rows, hopper::kRows), tensor_map(xt, a.n_rows, hopper::kRows),
                                tensor_map(ws, a.vocab_size, kWBoxRows), tensor_map(wt, a.vocab_size, kWBoxRows)};
  const int64_t row_blocks = (a.n_rows + hopper::kRows - 1) / hopper::kRows;
  const int64_t row_units = (row_blocks + kCluster - 1) / kCluster;
  const int64_t blocks = kCluster * row_units * plan.splits;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "nitrobrew: too many blocks for one launch");
  const hopper::BlockOrder order{row_units, plan.splits, std::max<int64_t>(1, plan.group_row_blocks / kCluster),
                                 kCluster};
  auto kernel = hopper::hopper_logit_kernel<T, Pass, kCluster>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hopper::kSmemBytes));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(hopper::kThreads);
  config.dynamicSmemBytes = hopper::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, maps, a, order, plan.sched, params));
}

}  // namespace detail

template <typename T, typename Pass>
void VocabWalk::launch(const typename Pass::Args& a, const LaunchPlan& plan, const typename Pass::Params& params) const {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (path_ == KernelPath::kWgmma) {
    if constexpr (sizeof(T) == 2) {
      const int64_t row_blocks = (a.n_rows + hopper::kRows - 1) / hopper::kRows;
      if (row_blocks % 2 == 0) return detail::launch_hopper<T, Pass, 2>(a, xs_, xt_, ws_, wt_, plan, params, stream);
      return detail::launch_hopper<T, Pass, 1>(a, xs_, xt_, ws_, wt_, plan, params, stream);
    }
  }
  const int64_t row_tiles = (a.n_rows + kTileRows - 1) / kTileRows;
  TORCH_CHECK(row_tiles < (int64_t(1) << 31) && plan.splits < 65536, "nitrobrew: too many blocks for one launch");
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(plan.splits));
  if (vectorized_) {
    mma_logit_kernel<T, true, Pass><<<grid, kThreads, 0, stream>>>(a, plan.sched, params);
  } else {
    mma_logit_kernel<T, false, Pass><<<grid, kThreads, 0, stream>>>(a, plan.sched, params);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace nitrobrew
