// Attention-KL backward on Hopper (sm_90a): two TMA + wgmma kernels of one template, each with a
// single writer per gradient entry (no atomics, so the results are bitwise reproducible).
//
// A block owns 128 "rows" (two consumer warpgroups of 64) and keeps them in shared memory, with
// the rows of the other model beside them; a producer thread streams 64-wide tiles of "columns"
// of both models through a ring of stages. Per column tile each consumer warpgroup
//   1. multiplies its student and teacher rows by the tile's columns (wgmma, both operands in
//      shared memory, K-major): the two 64 x 64 score tiles, in registers;
//   2. turns them into dS = dLoss/dscore_s with the forward's per-query log-normalizers
//      (attention_grad, as the mma.sync kernels), masked, in the input dtype;
//   3. adds dS . C_s into its 64 x D_s gradient accumulator (wgmma with dS as the register
//      operand and the student's column tile read transposed from the same shared memory).
// The dq kernel takes queries as rows and walks key tiles; the dk kernel takes keys as rows and
// walks the query tiles of every query head of its GQA group (the teacher's key rows are
// reloaded when the teacher's key head changes). Head dims up to 128; the host keeps the
// mma.sync kernels for larger ones.
#include <c10/cuda/CUDAException.h>

#include "attention_tiles.cuh"
#include "tma.h"
#include "wgmma_ops.cuh"

namespace nitrobrew {
namespace cuda {
namespace attention {

// (Outside the anonymous namespace, as in attention_kl_hopper.cu.)
struct BackwardMaps {
  CUtensorMap rows_s, rows_t;  // boxes of 128 rows
  CUtensorMap cols_s, cols_t;  // boxes of 64 rows
};

namespace {

constexpr int kRows = 128;
constexpr int kCols = 64;
constexpr int kK = hopper::kK;  // 32 values: one 64-byte swizzled row, as head_tensor_map loads
constexpr int kMaxSlabs = 4;    // head dims up to 128
constexpr int kStages = 4;
constexpr int kRowSlabBytes = kRows * kK * 2;
constexpr int kColSlabBytes = kCols * kK * 2;
constexpr int kRowBytes = kMaxSlabs * kRowSlabBytes;   // one model's rows
constexpr int kStageBytes = 2 * kMaxSlabs * kColSlabBytes;
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreadCount = 384;
constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kStatsBytes = 2 * kCols * int(sizeof(GradRow));  // dk: two tiles' per-query data
constexpr int kSmemBytes = 1024 + 2 * kRowBytes + kStages * kStageBytes + kStatsBytes + (2 * kStages + 3) * 8;
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a block may have");

// What a block works on: its rows, and the column tiles ("items") it walks.
template <typename T, bool kKeyRows>
struct BackwardBlock {
  int64_t b;
  int head;        // dq: the query head; dk: the student's key head
  int row0;        // first row (query or key) of the block
  int rows_valid;  // rows < n
  int items;       // column tiles
  int first_tile, per_head, group;  // dk: query tiles [first_tile, + per_head) of each query head

  __device__ BackwardBlock(const AttentionArgs<T>& a) {
    if constexpr (!kKeyRows) {
      const int q_tiles = (a.n_q + kRows - 1) / kRows;
      const int64_t bh = blockIdx.x % (a.batch * a.heads);
      row0 = (q_tiles - 1 - static_cast<int>(blockIdx.x / (a.batch * a.heads))) * kRows;  // causal: heaviest first
      b = bh / a.heads;
      head = static_cast<int>(bh % a.heads);
      rows_valid = min(kRows, a.n_q - row0);
      const int key_end = min(a.n_k, a.last_key(row0 + rows_valid - 1) + 1);  // keys the rows see
      items = key_end > 0 ? (key_end + kCols - 1) / kCols : 0;
    } else {
      const int64_t pairs = a.batch * a.key_heads_s;
      row0 = static_cast<int>(blockIdx.x / pairs) * kRows;  // causal: the keys most queries see first
      b = (blockIdx.x % pairs) / a.key_heads_s;
      head = static_cast<int>((blockIdx.x % pairs) % a.key_heads_s);
      rows_valid = min(kRows, a.n_k - row0);
      group = a.heads / a.key_heads_s;
      const int q_first = a.causal ? max(0, row0 - (a.n_k - a.n_q)) : 0;
      first_tile = q_first / kCols;
      per_head = max(0, (a.n_q + kCols - 1) / kCols - first_tile);
      items = group * per_head;
    }
  }
  // dk: the query head and first query of item `it`.
  __device__ __forceinline__ int query_head(int it) const { return head * group + it / per_head; }
  __device__ __forceinline__ int query0(int it) const { return (first_tile + it % per_head) * kCols; }
  // The teacher's head of the rows in item `it`: dq, the query head; dk, the teacher's key head.
  __device__ __forceinline__ int teacher_row_head(const AttentionArgs<T>& a, int it) const {
    if constexpr (kKeyRows) {
      return a.key_head_t(query_head(it));
    } else {
      return head;
    }
  }
};

template <typename T, bool kKeyRows, int kDs>
__global__ void __launch_bounds__(kThreadCount, 1)
    attention_kl_bwd_hopper_kernel(const __grid_constant__ BackwardMaps maps, const AttentionArgs<T> a) {
#if NITROBREW_SM90A_DEVICE
  using namespace hopper;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* rows_s = smem;
  uint8_t* rows_t = smem + kRowBytes;
  uint8_t* ring = smem + 2 * kRowBytes;
  GradRow* col_stats = reinterpret_cast<GradRow*>(ring + kStages * kStageBytes);  // dk: [2][64 queries]
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kStages * kStageBytes + kStatsBytes);
  uint64_t* empty = full + kStages;
  uint64_t* rows_s_full = empty + kStages;
  uint64_t* rows_t_full = rows_s_full + 1;
  uint64_t* rows_t_empty = rows_t_full + 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    mbar_init(rows_s_full, 1);
    mbar_init(rows_t_full, 1);
    mbar_init(rows_t_empty, kConsumerWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const BackwardBlock<T, kKeyRows> blk(a);
  const int slabs_s = (a.d_s + kK - 1) / kK, slabs_t = (a.d_t + kK - 1) / kK;
  const int n_rows = kKeyRows ? a.n_k : a.n_q, n_cols = kKeyRows ? a.n_q : a.n_k;
  const float grad_scale = dscore_range_scale(a.grad_max, a.c_s);

  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (blk.items == 0) return;
    if (threadIdx.x == 0) {
      // Rows: dq, the queries of (b, head); dk, the keys of (b, key head).
      const int32_t batch = static_cast<int32_t>(blk.b);
      mbar_arrive_expect_tx(rows_s_full, slabs_s * kRowSlabBytes);
      for (int ks = 0; ks < slabs_s; ++ks) {
        tma_load_4d(rows_s + ks * kRowSlabBytes, &maps.rows_s, ks * kK, blk.head, blk.row0, batch, rows_s_full);
      }
      int loaded_t = -1, reloads = 0;
      RingPosition<kStages> slot;
      for (int it = 0; it < blk.items; ++it) {
        const int teacher_head = blk.teacher_row_head(a, it);
        if (teacher_head != loaded_t) {
          if (loaded_t >= 0) mbar_wait(rows_t_empty, (reloads++) & 1);
          mbar_arrive_expect_tx(rows_t_full, slabs_t * kRowSlabBytes);
          for (int ks = 0; ks < slabs_t; ++ks) {
            tma_load_4d(rows_t + ks * kRowSlabBytes, &maps.rows_t, ks * kK, teacher_head, blk.row0, batch,
                        rows_t_full);
          }
          loaded_t = teacher_head;
        }
        // Columns: dq, key tile `it` of the query head's key heads; dk, the item's query tile.
        int col_row, head_s, head_t;
        if constexpr (kKeyRows) {
          col_row = blk.query0(it);
          head_s = head_t = blk.query_head(it);
        } else {
          col_row = it * kCols;
          head_s = a.key_head_s(blk.head);
          head_t = a.key_head_t(blk.head);
        }
        mbar_wait(&empty[slot.stage], slot.phase ^ 1);
        uint8_t* stage = ring + slot.stage * kStageBytes;
        mbar_arrive_expect_tx(&full[slot.stage], (slabs_s + slabs_t) * kColSlabBytes);
        for (int ks = 0; ks < slabs_s; ++ks) {
          tma_load_4d(stage + ks * kColSlabBytes, &maps.cols_s, ks * kK, head_s, col_row, batch, &full[slot.stage]);
        }
        for (int ks = 0; ks < slabs_t; ++ks) {
          tma_load_4d(stage + (kMaxSlabs + ks) * kColSlabBytes, &maps.cols_t, ks * kK, head_t, col_row, batch,
                      &full[slot.stage]);
        }
        slot.advance();
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int thread = threadIdx.x - kProducerThreads;
    const int consumer = thread / 128, warp = (thread / 32) % 4, lane = thread % 32;
    const int my_row0 = blk.row0 + 64 * consumer + 16 * warp + lane / 4;  // the thread's rows: +0, +8
    TileAcc<kDs / 8> grad;
    grad.zero();
    // dq: the per-query data of the thread's two rows.
    GradRow row_stats[2] = {};
    if constexpr (!kKeyRows) {
      const int64_t bh = blk.b * a.heads + blk.head;
      row_stats[0] = load_grad_row(a, bh, my_row0, grad_scale);
      row_stats[1] = load_grad_row(a, bh, my_row0 + 8, grad_scale);
    }
    if (blk.items > 0) mbar_wait(rows_s_full, 0);
    int loaded_t = -1, reloads = 0;
    RingPosition<kStages> slot;
    for (int it = 0; it < blk.items; ++it) {
      const int teacher_head = blk.teacher_row_head(a, it);
      if (teacher_head != loaded_t) {
        mbar_wait(rows_t_full, (reloads++) & 1);
        loaded_t = teacher_head;
      }
      mbar_wait(&full[slot.stage], slot.phase);
      const uint8_t* stage = ring + slot.stage * kStageBytes;
      GradRow* stats = col_stats + (it & 1) * kCols;
      if constexpr (kKeyRows) {
        // dk: the tile's per-query data (a.grad_rows; the upstream gradient not yet range-scaled),
        // 64 GradRows copied by the consumers into one of two buffers and read after the named
        // barrier below: a buffer is rewritten two tiles later, after every consumer thread has
        // passed the next tile's barrier, so after it read this one.
        const float* src = a.grad_rows + ((blk.b * a.heads + blk.query_head(it)) * a.grad_rows_per_head +
                                          blk.query0(it)) * 6;
        float* dst = reinterpret_cast<float*>(stats);
        dst[thread] = src[thread];
        if (thread < kCols * 6 - kConsumerThreads) dst[thread + kConsumerThreads] = src[thread + kConsumerThreads];
      }

      // 1. The student's and the teacher's 64 x 64 scores.
      // (fence_acc at each step, as in hopper_gemm.cuh, keeps the accumulators in place: without
      // it ptxas serialized the products with warpgroup.arrive instructions of its own.)
      TileAcc<8> s, t;
      for (int ks = 0; ks < slabs_s; ++ks) {
        const uint64_t da = smem_desc(rows_s + ks * kRowSlabBytes + consumer * (kRowSlabBytes / 2));
        const uint64_t db = smem_desc(stage + ks * kColSlabBytes);
        fence_acc(s);
        wgmma_fence();
        wgmma_ss<T>(s, da, db, ks > 0);
        wgmma_ss<T>(s, da + 2, db + 2, 1);
      }
      for (int ks = 0; ks < slabs_t; ++ks) {
        const uint64_t da = smem_desc(rows_t + ks * kRowSlabBytes + consumer * (kRowSlabBytes / 2));
        const uint64_t db = smem_desc(stage + (kMaxSlabs + ks) * kColSlabBytes);
        fence_acc(t);
        wgmma_fence();
        wgmma_ss<T>(t, da, db, ks > 0);
        wgmma_ss<T>(t, da + 2, db + 2, 1);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(s);
      fence_acc(t);
      if (it + 1 < blk.items && blk.teacher_row_head(a, it + 1) != teacher_head && lane == 0) {
        mbar_arrive(rows_t_empty);  // this warp is done with the teacher's rows
      }

      // 2. dS, masked, as the register operand (n-tiles 2k, 2k + 1 of the scores = k-step k).
      const int col0 = kKeyRows ? blk.query0(it) : it * kCols;  // first query / key of the tile
      if constexpr (kKeyRows) asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
      bool masked = a.key_mask != nullptr || blk.row0 + kRows > n_rows || col0 + kCols > n_cols;
      if (a.causal) {
        masked = masked || (kKeyRows ? blk.row0 + kRows - 1 > a.last_key(col0)
                                     : col0 + kCols - 1 > a.last_key(blk.row0));
      }
      uint32_t ds[4][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = my_row0 + 8 * (e / 2), c = col0 + 8 * j + 2 * (lane % 4) + (e & 1);
          const int query = kKeyRows ? c : r, key = kKeyRows ? r : c;
          const GradRow& g = kKeyRows ? stats[c - col0] : row_stats[e / 2];
          const bool visible = !masked || a.visible(blk.b, query, key);
          const float grad_s =
              (kKeyRows ? g.grad * grad_scale : g.grad) * attention_grad(__fmul_rn(s.v[j][e], a.c_s), __fmul_rn(t.v[j][e], a.c_t), g, a.reverse);
          v[e] = visible ? grad_s : 0.f;
        }
        ds[j / 2][2 * (j % 2)] = pack2<T>(v[0], v[1]);
        ds[j / 2][2 * (j % 2) + 1] = pack2<T>(v[2], v[3]);
      }

      // 3. grad += dS . C_s, the student's column tile read [64 columns][head dim]. For a head dim
      // under kDs the product also reads slabs no copy wrote: they only reach output columns past
      // the head dim, which are never stored. The tile's rows past the batch's last column read
      // as zeros (4-D boxes), so nothing of the next batch reaches this one.
#pragma unroll
      for (int k = 0; k < 4; ++k) {
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(ds[k][e])::"memory");
      }
      fence_acc(grad);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) wgmma_rs<T, kDs / 8>(grad, ds[k], mn_major_desc(stage + k * 1024, kColSlabBytes), 1);
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(grad);
      __syncwarp();  // the warp's reads of the stage before lane 0 releases it
      if (lane == 0) mbar_arrive(&empty[slot.stage]);
      slot.advance();
    }

    // The thread's two rows of the gradient, scaled back from dS's range.
    const float unscale = 1.f / grad_scale;
    const int d = a.d_s, col = 2 * (lane % 4);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = my_row0 + 8 * r;
      if (i >= n_rows) continue;
      T* out = kKeyRows ? a.dk + ((blk.b * a.n_k + i) * a.key_heads_s + blk.head) * static_cast<int64_t>(d)
                        : a.dq + ((blk.b * a.n_q + i) * a.heads + blk.head) * static_cast<int64_t>(d);
#pragma unroll
      for (int n = 0; n < kDs / 8; ++n) {
        if (8 * n + col < d) {
          *reinterpret_cast<uint32_t*>(out + 8 * n + col) =
              pack2<T>(grad.v[n][2 * r] * unscale, grad.v[n][2 * r + 1] * unscale);
        }
      }
    }
  }
#endif
}

template <typename T, bool kKeyRows, int kDs>
void launch(const BackwardMaps& maps, const AttentionArgs<T>& a, cudaStream_t stream) {
  auto* kernel = &attention_kl_bwd_hopper_kernel<T, kKeyRows, kDs>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int64_t blocks = kKeyRows ? (a.n_k + kRows - 1) / kRows * a.batch * a.key_heads_s
                                  : (a.n_q + kRows - 1) / kRows * a.batch * a.heads;
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many blocks for the backward: ", blocks);
  if (blocks == 0) return;
  kernel<<<static_cast<unsigned>(blocks), kThreadCount, kSmemBytes, stream>>>(maps, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

template <typename T>
void launch_attention_kl_backward_hopper(const AttentionArgs<T>& a, const at::Tensor& q_s, const at::Tensor& k_s,
                                         const at::Tensor& q_t, const at::Tensor& k_t, cudaStream_t stream) {
  TORCH_CHECK(attention_kl_hopper_supports(a.d_s, a.d_t), "attention_kl: head dims over 128");
  const BackwardMaps dq_maps{head_tensor_map(q_s, kRows), head_tensor_map(q_t, kRows), head_tensor_map(k_s, kCols),
                             head_tensor_map(k_t, kCols)};
  const BackwardMaps dk_maps{head_tensor_map(k_s, kRows), head_tensor_map(k_t, kRows), head_tensor_map(q_s, kCols),
                             head_tensor_map(q_t, kCols)};
  if (a.d_s <= 64) {
    launch<T, false, 64>(dq_maps, a, stream);
    launch<T, true, 64>(dk_maps, a, stream);
  } else {
    launch<T, false, 128>(dq_maps, a, stream);
    launch<T, true, 128>(dk_maps, a, stream);
  }
}

template void launch_attention_kl_backward_hopper(const AttentionArgs<__nv_bfloat16>&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  cudaStream_t);
template void launch_attention_kl_backward_hopper(const AttentionArgs<__half>&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, cudaStream_t);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
