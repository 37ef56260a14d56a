// Attention-KL backward on Hopper (sm_90a), deterministic=True: dq by a kernel of its own, each
// dq entry with a single writer (no atomics, so the results are bitwise reproducible); dk comes
// from the fused kernel (bwd_sm90.cu) without its dq part.
//
// A block owns 128 query rows of one head (two consumer warpgroups of 64) and keeps both models'
// rows in shared memory; a producer thread streams 64-key tiles of both models through a ring of
// stages. Per key tile each consumer warpgroup
//   1. multiplies its student and teacher rows by the tile's keys (wgmma, both operands in shared
//      memory, K-major): the two 64 x 64 score tiles, in registers;
//   2. turns them into dS = dLoss/dscore_s with the forward's per-query log-normalizers
//      (attention_grad, as the mma.sync kernels), masked, in the input dtype;
//   3. adds dS . K_s into its 64 x D_s dq accumulator (wgmma with dS as the register operand and
//      the student's key tile read transposed from the same shared memory).
// Head dims up to 128; the host keeps the mma.sync kernels for larger ones.
#include <c10/cuda/CUDAException.h>

#include "../engine/cuda/sm90/tma.h"
#include "../engine/cuda/sm90/wgmma_forms.cuh"
#include "attention_kl_rows_sm90.cuh"
#include "attention_kl_tiles.cuh"

namespace nitrobrew {
namespace cuda {
namespace attention {

// (Outside the anonymous namespace, as in fwd_sm90.cu.)
struct DqMaps {
  CUtensorMap q_s, q_t;  // boxes of 128 queries
  CUtensorMap k_s, k_t;  // boxes of 64 keys
};

namespace {

constexpr int kRows = 128;
constexpr int kCols = 64;
constexpr int kStages = 4;
[[maybe_unused]] constexpr int kProducerThreads = 128;  // read only in the kernel body (sm_90a alone)
constexpr int kConsumerThreads = 256, kThreadCount = 384;
constexpr int kConsumerWarps = kConsumerThreads / 32;
using Layout = RowsAndKeyRing<kRows, kCols, kStages, kConsumerWarps>;
// The kernel body's constants ([[maybe_unused]]: the passes for other architectures compile it out).
[[maybe_unused]] constexpr int kMaxSlabs = Layout::kMaxSlabs, kK = Layout::kK;
[[maybe_unused]] constexpr int kRowSlabBytes = Layout::kRowSlabBytes, kColSlabBytes = Layout::kColSlabBytes;
[[maybe_unused]] constexpr int kStageBytes = Layout::kStageBytes;
constexpr int kSmemBytes = Layout::kSmemBytes;
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a block may have");

template <typename T, int kDs>
__global__ void __launch_bounds__(kThreadCount, 1)
    attention_kl_bwd_hopper_kernel(const __grid_constant__ DqMaps maps, const AttentionArgs<T> a) {
#if NITROBREW_SM90A_DEVICE
  using namespace hopper;
  extern __shared__ uint8_t smem_raw[];
  const Layout smem(smem_raw);
  const QueryTile<kRows, kCols> block(a);  // the block's 128 queries of (b, head) and their key tiles
  const int64_t bh = block.bh, b = block.b;
  const int head = block.head, row0 = block.row0, items = block.key_tiles;
  const int slabs_s = (a.d_s + kK - 1) / kK, slabs_t = (a.d_t + kK - 1) / kK;
  const float grad_scale = dscore_range_scale(a.grad_max, a.c_s);

  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x != 0 || items == 0) return;
    smem.produce(a, &maps.q_s, &maps.q_t, &maps.k_s, &maps.k_t, static_cast<int32_t>(b), head, row0, items, slabs_s,
                 slabs_t, [](int) {});
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  const int thread = threadIdx.x - kProducerThreads;
  // consumer read through a shuffle from lane 0, so that the descriptors derived from it stay in
  // uniform registers (as in fwd_sm90.cu).
  const int consumer = __shfl_sync(0xffffffffu, thread / 128, 0);
  const int warp = (thread / 32) % 4, lane = thread % 32;
  const int my_row0 = row0 + 64 * consumer + 16 * warp + lane / 4;  // the thread's queries: +0, +8
  TileAcc<kDs / 8> grad;
  grad.zero();
  const GradRow row_stats[2] = {load_grad_row(a, bh, my_row0, grad_scale), load_grad_row(a, bh, my_row0 + 8, grad_scale)};
  if (items > 0) mbar_wait(smem.rows_full, 0);
  const uint64_t rows_desc_s = smem_desc(smem.rows_s + consumer * (kRowSlabBytes / 2));
  const uint64_t rows_desc_t = smem_desc(smem.rows_t + consumer * (kRowSlabBytes / 2));
  const uint64_t ring_desc = smem_desc(smem.ring), ring_mn_desc = mn_major_desc(smem.ring, kColSlabBytes);
  const uint32_t full_addr = smem_addr(smem.full), empty_addr = smem_addr(smem.empty);
  RingPosition<kStages> slot;
  for (int it = 0; it < items; ++it) {
    mbar_wait(full_addr + 8 * slot.stage, slot.phase);

    // 1. The student's and the teacher's 64 x 64 scores.
    TileAcc<8> s, t;
    wgmma_scores_of_stage<T, kRowSlabBytes, kColSlabBytes, kMaxSlabs>(
        s, t, rows_desc_s, rows_desc_t, ring_desc + slot.stage * desc_step(kStageBytes), slabs_s, slabs_t);
    wgmma_wait<0>();
    fence_acc(s);
    fence_acc(t);

    // 2. dS, masked, as the register operand (n-tiles 2k, 2k + 1 of the scores = k-step k).
    const int key0 = it * kCols;
    const bool masked = a.key_mask != nullptr || row0 + kRows > a.n_q || key0 + kCols > a.n_k ||
                        (a.causal && key0 + kCols - 1 > a.last_key(row0));
    uint32_t ds[4][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int query = my_row0 + 8 * (e / 2), key = key0 + 8 * j + 2 * (lane % 4) + (e & 1);
        const GradRow& g = row_stats[e / 2];
        const bool visible = !masked || a.visible(b, query, key);
        const float grad_s =
            g.grad * attention_grad(__fmul_rn(s.v[j][e], a.c_s), __fmul_rn(t.v[j][e], a.c_t), g, a.reverse);
        v[e] = visible ? grad_s : 0.f;
      }
      ds[j / 2][2 * (j % 2)] = pack2<T>(v[0], v[1]);
      ds[j / 2][2 * (j % 2) + 1] = pack2<T>(v[2], v[3]);
    }

    // 3. grad += dS . K_s, the student's key tile read [64 keys][head dim]. For a head dim under
    // kDs the product also reads slabs no copy wrote: they only reach output columns past the
    // head dim, which are never stored. The tile's rows past the batch's last key read as zeros
    // (4-D boxes), so nothing of the next batch reaches this one.
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(ds[k][e])::"memory");
    }
    fence_acc(grad);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      wgmma_rs<T, kDs / 8>(grad, ds[k], ring_mn_desc + slot.stage * desc_step(kStageBytes) + k * desc_step(1024), 1);
    }
    wgmma_commit();
    wgmma_wait<0>();
    fence_acc(grad);
    __syncwarp();  // the warp's reads of the stage before lane 0 releases it
    if (lane == 0) mbar_arrive(empty_addr + 8 * slot.stage);
    slot.advance();
  }

  // The thread's two rows of dq, scaled back from dS's range.
  const float unscale = 1.f / grad_scale;
  const int d = a.d_s, col = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = my_row0 + 8 * r;
    if (i >= a.n_q) continue;
    T* out = a.dq + ((b * a.n_q + i) * a.heads + head) * static_cast<int64_t>(d);
#pragma unroll
    for (int n = 0; n < kDs / 8; ++n) {
      if (8 * n + col < d) {
        *reinterpret_cast<uint32_t*>(out + 8 * n + col) =
            pack2<T>(grad.v[n][2 * r] * unscale, grad.v[n][2 * r + 1] * unscale);
      }
    }
  }
#endif
}

template <typename T, int kDs>
void launch(const DqMaps& maps, const AttentionArgs<T>& a, cudaStream_t stream) {
  auto* kernel = &attention_kl_bwd_hopper_kernel<T, kDs>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int64_t blocks = (a.n_q + kRows - 1) / kRows * a.batch * a.heads;
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
  const DqMaps maps{head_tensor_map(q_s, kRows), head_tensor_map(q_t, kRows), head_tensor_map(k_s, kCols),
                    head_tensor_map(k_t, kCols)};
  if (a.d_s <= 64) {
    launch<T, 64>(maps, a, stream);
  } else {
    launch<T, 128>(maps, a, stream);
  }
  launch_attention_kl_backward_hopper_fused(a, q_s, k_s, q_t, k_t, /*with_dq=*/false, stream);
}

template void launch_attention_kl_backward_hopper(const AttentionArgs<__nv_bfloat16>&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  cudaStream_t);
template void launch_attention_kl_backward_hopper(const AttentionArgs<__half>&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, cudaStream_t);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
