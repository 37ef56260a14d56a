// Attention-KL forward on CUDA: one block per (64 query rows, batch, head). The block keeps its
// student and teacher query tiles in shared memory, streams tiles of 64 keys of both models
// through a double-buffered cp.async ring, computes both [64 x 64] score tiles with mma.sync
// (sm_80; also the kernel on sm_90) and folds them into each row's one-pass KL state
// (online_state.h) while they are in registers. Scores never leave the chip. Under the causal
// mask, key tiles past the block's last visible key are not visited; only tiles that straddle
// the diagonal, the end of the keys or a key mask pay for per-entry masking.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>


#include "attention_kl_tiles.cuh"

namespace nitrobrew {
namespace cuda {
namespace attention {
namespace {

// kDs, kDt: the head dims padded to 16 when fixed at compile time (64, 128), else 0.
template <typename T, bool kReverse, int kDs, int kDt>
__global__ void __launch_bounds__(kThreads, 2) attention_kl_fwd_kernel(const AttentionArgs<T> a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int d_s_pad = head_dim_pad<kDs>(a.d_s_pad), d_t_pad = head_dim_pad<kDt>(a.d_t_pad);
  const int s_len = d_s_pad + kRowPad, t_len = d_t_pad + kRowPad;
  T* q_s = reinterpret_cast<T*>(smem);
  T* q_t = q_s + kBlockRows * s_len;
  T* k_s = q_t + kBlockRows * t_len;  // [2 stages]
  T* k_t = k_s + 2 * kBlockRows * s_len;

  // Heaviest query tiles (the causal mask's last rows) first, all heads of one tile together.
  const int q_tiles = (a.n_q + kBlockRows - 1) / kBlockRows;
  const int64_t bh = blockIdx.x % (a.batch * a.heads);
  const int i0 = (q_tiles - 1 - static_cast<int>(blockIdx.x / (a.batch * a.heads))) * kBlockRows;
  const int64_t b = bh / a.heads;
  const int h = static_cast<int>(bh % a.heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_valid = min(kBlockRows, a.n_q - i0);

  const int key_end = min(a.n_k, a.last_key(i0 + rows_valid - 1) + 1);
  const int k_tiles = key_end > 0 ? (key_end + kBlockCols - 1) / kBlockCols : 0;
  const int64_t k_stride_s = a.st_k_s.row, k_stride_t = a.st_k_t.row;
  const T* k_s_rows = a.rows(a.k_s, a.st_k_s, b, a.key_head_s(h), 0);
  const T* k_t_rows = a.rows(a.k_t, a.st_k_t, b, a.key_head_t(h), 0);
  auto load_keys = [&](int tile, int stage) {
    const int j0 = tile * kBlockCols;
    load_tile_async(k_s + stage * kBlockRows * s_len, d_s_pad, k_s_rows + j0 * k_stride_s, k_stride_s, a.n_k - j0,
                    a.d_s);
    load_tile_async(k_t + stage * kBlockRows * t_len, d_t_pad, k_t_rows + j0 * k_stride_t, k_stride_t, a.n_k - j0,
                    a.d_t);
  };
  if (k_tiles > 0) {
    load_tile_async(q_s, d_s_pad, a.rows(a.q_s, a.st_q_s, b, h, i0), a.st_q_s.row, rows_valid, a.d_s);
    load_tile_async(q_t, d_t_pad, a.rows(a.q_t, a.st_q_t, b, h, i0), a.st_q_t.row, rows_valid, a.d_t);
    load_keys(0, 0);
    cp_async_commit();
  }

  TwoRowKL state = TwoRowKL::make<kReverse>(a.c_s, a.c_t);
  const int row0 = i0 + warp * 16 + lane / 4;  // the thread's rows: row0 and row0 + 8
  for (int tile = 0; tile < k_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < k_tiles) {
      load_keys(tile + 1, stage ^ 1);  // its stage was last read before the previous barrier
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    ScoreAcc s, t;
    warp_scores<kDs>(s, q_s + warp * 16 * s_len, k_s + stage * kBlockRows * s_len, d_s_pad);
    warp_scores<kDt>(t, q_t + warp * 16 * t_len, k_t + stage * kBlockRows * t_len, d_t_pad);
    __syncthreads();
    const int j0 = tile * kBlockCols;
    const int col0 = j0 + 2 * (lane % 4);
    const bool masked = a.key_mask != nullptr || j0 + kBlockCols > a.n_k ||
                        (a.causal && j0 + kBlockCols - 1 > a.last_key(i0));
    const ScoreTile s_tile{s}, t_tile{t};
    if (masked) {
      state.fold<kReverse, true>(
          s_tile, t_tile, [&](int j, int e) { return a.visible(b, row0 + 8 * (e / 2), col0 + 8 * j + (e & 1)); });
    } else {
      state.fold<kReverse, false>(s_tile, t_tile, [](int, int) { return true; });
    }
  }

  state.write_rows<kReverse>(a, bh, row0, lane);
}

// The forward kernel for the direction and head dims: unrolled for 64 and 128 on either side.
template <typename T, bool kReverse>
auto forward_kernel(int d_s_pad, int d_t_pad) -> void (*)(const AttentionArgs<T>) {
  if (d_s_pad == 64 && d_t_pad == 64) return &attention_kl_fwd_kernel<T, kReverse, 64, 64>;
  if (d_s_pad == 64 && d_t_pad == 128) return &attention_kl_fwd_kernel<T, kReverse, 64, 128>;
  if (d_s_pad == 128 && d_t_pad == 64) return &attention_kl_fwd_kernel<T, kReverse, 128, 64>;
  if (d_s_pad == 128 && d_t_pad == 128) return &attention_kl_fwd_kernel<T, kReverse, 128, 128>;
  return &attention_kl_fwd_kernel<T, kReverse, 0, 0>;
}

}  // namespace

template <typename T>
void launch_attention_kl_forward(const AttentionArgs<T>& a, cudaStream_t stream) {
  const size_t smem = 3 * (tile_bytes<T>(a.d_s_pad) + tile_bytes<T>(a.d_t_pad));  // q, and 2 stages of k
  auto* kernel = a.reverse ? forward_kernel<T, true>(a.d_s_pad, a.d_t_pad) : forward_kernel<T, false>(a.d_s_pad, a.d_t_pad);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = a.batch * a.heads * ((a.n_q + kBlockRows - 1) / kBlockRows);
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (batch, head, query tile) blocks: ", blocks);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void launch_attention_kl_forward(const AttentionArgs<__nv_bfloat16>&, cudaStream_t);
template void launch_attention_kl_forward(const AttentionArgs<__half>&, cudaStream_t);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
