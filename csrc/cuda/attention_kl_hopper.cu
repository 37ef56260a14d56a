// Attention-KL forward on Hopper (sm_90a): the fused-linear losses' TMA + wgmma machinery
// (hopper_gemm.cuh) with queries in the role of the hidden states and keys in the role of the
// vocabulary. A block owns 128 query rows of one head: thread 0 of a producer warpgroup streams
// 32-wide head-dim slabs of the query tile and of 256-key tiles of both models into the stage
// ring (4-D TMA boxes straight from the [B, N, H, D] tensors); each of two consumer warpgroups
// multiplies
// its 64 rows with wgmma.m64n256k16, parks the student's scores in shared memory while the
// teacher's occupy the registers, and folds both into the rows' one-pass KL states
// (TwoRowKL, shared with the mma.sync kernel). Compiled for every architecture, the kernel body
// exists only in the sm_90a pass; the host launches it only where that binary is loaded.
#include <c10/cuda/CUDAException.h>

#include "attention_tiles.cuh"
#include "hopper_gemm.cuh"
#include "tma.h"

namespace nitrobrew {
namespace cuda {
namespace attention {

// (Outside the anonymous namespace: in the passes where the kernel body is compiled out, an
// unused internal member function draws nvcc warning 177.)
struct AttentionMaps {
  CUtensorMap q_s, q_t, k_s, k_t;  // head_tensor_map: boxes of 128 query rows, 256 keys
};

// The producer: per key tile, the student's slabs of (queries, keys), then the teacher's.
struct AttentionLoader {
  const AttentionMaps* maps;
  uint8_t* smem;
  uint64_t* full;
  uint64_t* empty;
  int32_t batch, query_row;  // the block's batch and first query
  int32_t head, key_head_s, key_head_t;
  int tile, last;
  int k_slabs_s, k_slabs_t;
  int teacher = 0, ks = 0;
  hopper::RingSlot slot;

  __device__ __forceinline__ void load_next() {
    if (tile >= last) return;
    hopper::mbar_wait(&empty[slot.stage], slot.phase ^ 1);
    uint8_t* stage = smem + slot.stage * hopper::kStageBytes;
    hopper::mbar_arrive_expect_tx(&full[slot.stage], hopper::kStageBytes);
    const int32_t k = ks * hopper::kK;
    hopper::tma_load_4d(stage, teacher ? &maps->q_t : &maps->q_s, k, head, query_row, batch, &full[slot.stage]);
    hopper::tma_load_4d(stage + hopper::kXSlabBytes, teacher ? &maps->k_t : &maps->k_s, k,
                        teacher ? key_head_t : key_head_s, tile * hopper::kCols, batch, &full[slot.stage]);
    slot.advance();
    if (++ks == (teacher ? k_slabs_t : k_slabs_s)) {
      ks = 0;
      teacher ^= 1;
      if (!teacher) ++tile;
    }
  }
};

namespace {

template <int kN>
__device__ __forceinline__ void scale_scores(TileAcc<kN>& z, float c) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) z.v[j][e] = __fmul_rn(z.v[j][e], c);  // rounded once, as elsewhere
  }
}

// Folds a 256-column tile as four 64-column ones: the fold of one 256-wide tile kept ~1.4 KB of
// temporaries live and spilled; the merge is associative, so the result is the same.
template <bool kReverse, bool kMasked, int kOff = 0, typename Visible>
__device__ __forceinline__ void fold_wide(TwoRowKL& state, const hopper::ParkedTile& s, const hopper::WideAcc& t,
                                          Visible visible) {
  using hopper::TileSlice;
  state.fold<kReverse, kMasked>(TileSlice<hopper::ParkedTile, kOff>{s}, TileSlice<hopper::WideAcc, kOff>{t},
                                [&](int j, int e) { return visible(j + kOff, e); });
  if constexpr (kOff + 8 < hopper::WideAcc::kNTiles) {
    fold_wide<kReverse, kMasked, kOff + 8>(state, s, t, visible);
  }
}

template <typename T, bool kReverse>
__global__ void __launch_bounds__(hopper::kThreads, 1)
    attention_kl_fwd_hopper_kernel(const __grid_constant__ AttentionMaps maps, const AttentionArgs<T> a) {
#if NITROBREW_SM90A_DEVICE
  using namespace hopper;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  float* park = reinterpret_cast<float*>(smem + kStages * kStageBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes + kParkBytes);
  uint64_t* empty = full + kStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // Heaviest query tiles (the causal mask's last rows) first, all heads of one tile together.
  const int q_tiles = (a.n_q + kRows - 1) / kRows;
  const int64_t bh = blockIdx.x % (a.batch * a.heads);
  const int i0 = (q_tiles - 1 - static_cast<int>(blockIdx.x / (a.batch * a.heads))) * kRows;
  const int64_t b = bh / a.heads;
  const int h = static_cast<int>(bh % a.heads);
  const int rows_valid = min(kRows, a.n_q - i0);
  const int key_end = min(a.n_k, a.last_key(i0 + rows_valid - 1) + 1);
  const int k_tiles = key_end > 0 ? (key_end + kCols - 1) / kCols : 0;
  const int k_slabs_s = (a.d_s + kK - 1) / kK, k_slabs_t = (a.d_t + kK - 1) / kK;

  // As in the logit kernel (hopper_gemm.cuh): a producer warpgroup whose thread 0 only loads,
  // its registers given to the consumers; each role is one branch, for setmaxnreg.
  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x == 0) {
      AttentionLoader loader{&maps,
                             smem,
                             full,
                             empty,
                             static_cast<int32_t>(b),
                             i0,
                             h,
                             a.key_head_s(h),
                             a.key_head_t(h),
                             0,
                             k_tiles,
                             k_slabs_s,
                             k_slabs_t};
      while (loader.tile < k_tiles) loader.load_next();  // waits for each stage's release
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
    const int thread = threadIdx.x - kProducerThreads;
    const int consumer = thread / 128, warp = (thread / 32) % 4, lane = thread % 32;
    const ParkedTile s_parked{park + thread};
    Ring ring{smem, full, empty};
    WideAcc z;  // the student's scores, parked, then the teacher's
    TwoRowKL state;
    const int row0 = i0 + 64 * consumer + 16 * warp + lane / 4;  // the thread's rows: row0, row0 + 8
    for (int tile = 0; tile < k_tiles; ++tile) {
      ring.multiply<T>(z, k_slabs_s, consumer, lane);
      scale_scores(z, a.c_s);
      s_parked.park(z);
      ring.multiply<T>(z, k_slabs_t, consumer, lane);
      scale_scores(z, a.c_t);
      const int j0 = tile * kCols, col0 = j0 + 2 * (lane % 4);
      const bool masked =
          a.key_mask != nullptr || j0 + kCols > a.n_k || (a.causal && j0 + kCols - 1 > a.last_key(i0));
      if (masked) {
        fold_wide<kReverse, true>(state, s_parked, z, [&](int j, int e) {
          return a.visible(b, row0 + 8 * (e / 2), col0 + 8 * j + (e & 1));
        });
      } else {
        fold_wide<kReverse, false>(state, s_parked, z, [](int, int) { return true; });
      }
    }
    state.write_rows<kReverse>(a, bh, row0, lane);
  }
#endif
}

}  // namespace

template <typename T>
void launch_attention_kl_forward_hopper(const AttentionArgs<T>& a, const at::Tensor& q_s, const at::Tensor& k_s,
                                        const at::Tensor& q_t, const at::Tensor& k_t, cudaStream_t stream) {
  const AttentionMaps maps{head_tensor_map(q_s, hopper::kRows), head_tensor_map(q_t, hopper::kRows),
                           head_tensor_map(k_s, hopper::kCols), head_tensor_map(k_t, hopper::kCols)};
  auto* kernel = a.reverse ? &attention_kl_fwd_hopper_kernel<T, true> : &attention_kl_fwd_hopper_kernel<T, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hopper::kSmemBytes));
  const int64_t blocks = a.batch * a.heads * ((a.n_q + hopper::kRows - 1) / hopper::kRows);
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (batch, head, query tile) blocks: ", blocks);
  kernel<<<static_cast<unsigned>(blocks), hopper::kThreads, hopper::kSmemBytes, stream>>>(maps, a);
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
