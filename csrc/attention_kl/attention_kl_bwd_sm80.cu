// Attention-KL backward on CUDA: recomputes both score tiles from the inputs and turns them into
// dS = dLoss/dscore_s with the forward's per-row log-normalizers (the probabilities are never
// stored), then multiplies dS into the gradients on the tensor cores (dS rounded to the input
// dtype, as FlashAttention does).
//
// - dk kernel, one block per (64 keys, batch, student key head): walks the query tiles of every
//   query head of its GQA group and keeps dk for its keys in registers, so dk needs no atomics.
//   By default it also forms dq = dS . K_s for each tile and adds it into a float32 buffer with
//   atomics; the buffer covers a chunk of batches / key heads at a time (dq_accum_chunks).
// - dq kernel (deterministic=True), one block per (64 queries, batch, head): walks key tiles and
//   keeps dq in registers. Each gradient entry then has one writer and a fixed summation order,
//   so results are bitwise reproducible, at the price of computing the scores twice.
// Under the causal mask both skip the tiles no query of the block sees.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cstdlib>

#include "../divergence/row_stats.h"
#include "attention_kl_tiles.cuh"

namespace nitrobrew {
namespace cuda {
namespace attention {
namespace {

constexpr int kDsLen = kBlockCols + kRowPad;   // row length of the dS^T tile in shared memory


template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = pack2<T>(lo, hi);
}

// dst[0] += lo, dst[1] += hi atomically (dst 8-byte aligned: head dims are padded to multiples of 8);
// one vector atomic on Hopper, where they exist.
__device__ __forceinline__ void add_pair(float* dst, float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float2*>(dst), make_float2(lo, hi));
#else
  atomicAdd(dst, lo);
  atomicAdd(dst + 1, hi);
#endif
}

// ---------------------------------------------------------------- dq (deterministic) -----
template <typename T, int kDs, int kDt>
__global__ void __launch_bounds__(kThreads, 2) attention_kl_dq_kernel(const AttentionArgs<T> a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int d_t_pad = head_dim_pad<kDt>(a.d_t_pad);
  const int s_len = kDs + kRowPad, t_len = d_t_pad + kRowPad;
  T* q_s = reinterpret_cast<T*>(smem);
  T* q_t = q_s + kBlockRows * s_len;
  T* k_s = q_t + kBlockRows * t_len;  // [2 stages]
  T* k_t = k_s + 2 * kBlockRows * s_len;

  const int q_tiles = (a.n_q + kBlockRows - 1) / kBlockRows;
  const int64_t bh = blockIdx.x % (a.batch * a.heads);
  const int i0 = (q_tiles - 1 - static_cast<int>(blockIdx.x / (a.batch * a.heads))) * kBlockRows;
  const int64_t b = bh / a.heads;
  const int h = static_cast<int>(bh % a.heads);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows_valid = min(kBlockRows, a.n_q - i0);
  const float grad_scale = dscore_range_scale(a.grad_max, a.c_s);

  const int key_end = min(a.n_k, a.last_key(i0 + rows_valid - 1) + 1);
  const int k_tiles = key_end > 0 ? (key_end + kBlockCols - 1) / kBlockCols : 0;
  const int64_t k_stride_s = a.st_k_s.row, k_stride_t = a.st_k_t.row;
  const T* k_s_rows = a.rows(a.k_s, a.st_k_s, b, a.key_head_s(h), 0);
  const T* k_t_rows = a.rows(a.k_t, a.st_k_t, b, a.key_head_t(h), 0);
  auto load_keys = [&](int tile, int stage) {
    const int j0 = tile * kBlockCols;
    load_tile_async(k_s + stage * kBlockRows * s_len, kDs, k_s_rows + j0 * k_stride_s, k_stride_s, a.n_k - j0, a.d_s);
    load_tile_async(k_t + stage * kBlockRows * t_len, d_t_pad, k_t_rows + j0 * k_stride_t, k_stride_t, a.n_k - j0,
                    a.d_t);
  };
  if (k_tiles > 0) {
    load_tile_async(q_s, kDs, a.rows(a.q_s, a.st_q_s, b, h, i0), a.st_q_s.row, rows_valid, a.d_s);
    load_tile_async(q_t, d_t_pad, a.rows(a.q_t, a.st_q_t, b, h, i0), a.st_q_t.row, rows_valid, a.d_t);
    load_keys(0, 0);
    cp_async_commit();
  }

  const int row0 = i0 + warp * 16 + lane / 4;  // the thread's rows: row0 and row0 + 8
  const GradRow rows[2] = {load_grad_row(a, bh, row0, grad_scale), load_grad_row(a, bh, row0 + 8, grad_scale)};
  float dq[kDs / 8][4] = {};
  for (int tile = 0; tile < k_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < k_tiles) {
      load_keys(tile + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    ScoreAcc s, t;
    warp_scores<kDs>(s, q_s + warp * 16 * s_len, k_s + stage * kBlockRows * s_len, kDs);
    warp_scores<kDt>(t, q_t + warp * 16 * t_len, k_t + stage * kBlockRows * t_len, d_t_pad);
    const int j0 = tile * kBlockCols, col0 = j0 + 2 * (lane % 4);
    const bool masked = a.key_mask != nullptr || j0 + kBlockCols > a.n_k ||
                        (a.causal && j0 + kBlockCols - 1 > a.last_key(i0));
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const GradRow& r = rows[e / 2];
        const bool visible = !masked || a.visible(b, row0 + 8 * (e / 2), col0 + 8 * j + (e & 1));
        const float ds = r.grad * attention_grad(__fmul_rn(s[j][e], a.c_s), __fmul_rn(t[j][e], a.c_t), r, a.reverse);
        s[j][e] = visible ? ds : 0.f;
      }
    }
    uint32_t ds_a[4][4];
    acc_to_a_operand<T>(ds_a, s);
    warp_times_tile<T, kDs / 8>(dq, ds_a, k_s + stage * kBlockRows * s_len, s_len, 0);
    __syncthreads();  // the stage is refilled next iteration
  }

  const float unscale = 1.f / grad_scale;
  const int col = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row0 + 8 * r;
    if (i >= a.n_q) continue;
    T* out = a.dq + ((b * a.n_q + i) * a.heads + h) * static_cast<int64_t>(a.d_s);
#pragma unroll
    for (int j = 0; j < kDs / 8; ++j) {
      if (8 * j + col < a.d_s) store_pair(out + 8 * j + col, dq[j][2 * r] * unscale, dq[j][2 * r + 1] * unscale);
    }
  }
}

// ------------------------------------------------------------------------------ dk -----
// dS^T goes through shared memory for the dq product: in the teacher's query tile of the stage
// (dead once the scores are formed) when that is large enough, which keeps two blocks per SM at
// head dim 128; otherwise in a buffer of its own.
__host__ __device__ __forceinline__ bool ds_in_teacher_tile(int d_t_pad) {
  return d_t_pad + kRowPad >= kDsLen;
}

template <typename T, int kDs, int kDt>
__global__ void __launch_bounds__(kThreads, 2) attention_kl_dk_kernel(const AttentionArgs<T> a) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int d_t_pad = head_dim_pad<kDt>(a.d_t_pad);
  const int s_len = kDs + kRowPad, t_len = d_t_pad + kRowPad;
  T* k_s = reinterpret_cast<T*>(smem);
  T* k_t = k_s + kBlockRows * s_len;
  T* q_s = k_t + kBlockRows * t_len;  // [2 stages]
  T* q_t = q_s + 2 * kBlockRows * s_len;
  GradRow* grads = reinterpret_cast<GradRow*>(q_t + 2 * kBlockRows * t_len);  // [2 stages][64]
  T* ds_own = reinterpret_cast<T*>(grads + 2 * kBlockCols);                   // [64 keys][kDsLen], if used
  const bool ds_aliased = ds_in_teacher_tile(d_t_pad);

  // Key tiles seen by the most queries (the first ones, under the causal mask) first.
  const int64_t pairs = a.chunk_batches * a.chunk_key_heads;
  const int j0 = static_cast<int>(blockIdx.x / pairs) * kBlockRows;
  const int64_t b = a.chunk_b0 + (blockIdx.x % pairs) / a.chunk_key_heads;
  const int kh = a.chunk_kh0 + static_cast<int>((blockIdx.x % pairs) % a.chunk_key_heads);
  const int group = a.heads / a.key_heads_s;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float grad_scale = dscore_range_scale(a.grad_max, a.c_s);

  // The query tiles that see any of these keys, for each query head of the group.
  const int q_first = a.causal ? max(0, j0 - (a.n_k - a.n_q)) : 0;
  const int q_tiles = (a.n_q + kBlockCols - 1) / kBlockCols, first_tile = q_first / kBlockCols;
  const int per_head = max(0, q_tiles - first_tile), items = group * per_head;
  auto item_head = [&](int it) { return kh * group + it / per_head; };
  auto item_i0 = [&](int it) { return (first_tile + it % per_head) * kBlockCols; };
  auto load_item = [&](int it, int stage) {
    const int h = item_head(it), i0 = item_i0(it);
    load_tile_async(q_s + stage * kBlockCols * s_len, kDs, a.rows(a.q_s, a.st_q_s, b, h, i0), a.st_q_s.row,
                    a.n_q - i0, a.d_s);
    load_tile_async(q_t + stage * kBlockCols * t_len, d_t_pad, a.rows(a.q_t, a.st_q_t, b, h, i0), a.st_q_t.row,
                    a.n_q - i0, a.d_t);
    if (threadIdx.x < kBlockCols) {
      grads[stage * kBlockCols + threadIdx.x] = load_grad_row(a, b * a.heads + h, i0 + threadIdx.x, grad_scale);
    }
  };

  // The thread's two keys (rows of the dS^T tile) and whether the key mask lets them be seen.
  const int key0 = j0 + warp * 16 + lane / 4;
  bool key_ok[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key0 + 8 * r;
    key_ok[r] = j < a.n_k && (a.key_mask == nullptr || a.key_mask[b * a.n_k + j]);
  }

  int loaded_teacher_head = -1;
  if (items > 0) {
    load_tile_async(k_s, kDs, a.rows(a.k_s, a.st_k_s, b, kh, j0), a.st_k_s.row, a.n_k - j0, a.d_s);
    load_item(0, 0);
    cp_async_commit();
  }
  float dk[kDs / 8][4] = {};
  for (int it = 0; it < items; ++it) {
    const int stage = it & 1, h = item_head(it), i0 = item_i0(it);
    const int teacher_head = a.key_head_t(h);
    if (teacher_head != loaded_teacher_head) {  // k_t was last read before the previous barrier
      load_tile_async(k_t, d_t_pad, a.rows(a.k_t, a.st_k_t, b, teacher_head, j0), a.st_k_t.row, a.n_k - j0, a.d_t);
      cp_async_commit();
      loaded_teacher_head = teacher_head;
    }
    if (it + 1 < items) {
      load_item(it + 1, stage ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // dS^T for the warp's 16 keys against the tile's 64 queries.
    ScoreAcc s, t;
    warp_scores<kDs>(s, k_s + warp * 16 * s_len, q_s + stage * kBlockCols * s_len, kDs);
    warp_scores<kDt>(t, k_t + warp * 16 * t_len, q_t + stage * kBlockCols * t_len, d_t_pad);
    const GradRow* tile_grads = grads + stage * kBlockCols;
#pragma unroll
    for (int j = 0; j < kColTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = 8 * j + 2 * (lane % 4) + (e & 1), i = i0 + q, key = key0 + 8 * (e / 2);
        const bool visible = key_ok[e / 2] && i < a.n_q && key <= a.last_key(i);
        const GradRow& r = tile_grads[q];
        const float ds = r.grad * attention_grad(__fmul_rn(s[j][e], a.c_s), __fmul_rn(t[j][e], a.c_t), r, a.reverse);
        s[j][e] = visible ? ds : 0.f;
      }
    }
    uint32_t ds_a[4][4];
    acc_to_a_operand<T>(ds_a, s);
    warp_times_tile<T, kDs / 8>(dk, ds_a, q_s + stage * kBlockCols * s_len, s_len, 0);

    if (a.dq_accum != nullptr) {
      // dq[queries] += dS . K_s: dS^T goes through shared memory, each warp takes 16 queries.
      T* ds_t = ds_aliased ? q_t + stage * kBlockCols * t_len : ds_own;
      if (ds_aliased) __syncthreads();  // every warp is done reading the teacher's query tile
#pragma unroll
      for (int j = 0; j < kColTiles; ++j) {
        const int key_row = warp * 16 + lane / 4, q = 8 * j + 2 * (lane % 4);
        store_pair(ds_t + key_row * kDsLen + q, s[j][0], s[j][1]);
        store_pair(ds_t + (key_row + 8) * kDsLen + q, s[j][2], s[j][3]);
      }
      __syncthreads();
      uint32_t ds_rows[4][4];  // A operand: dS[16 queries x 64 keys], read transposed
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        ldmatrix_x4_trans(ds_rows[k], ds_t + (16 * k + (lane & 7) + (lane >> 4) * 8) * kDsLen + warp * 16 +
                                          ((lane >> 3) & 1) * 8);
      }
      const int h_local = h - a.chunk_kh0 * group, heads_local = a.chunk_key_heads * group;
      const float unscale = 1.f / grad_scale;
#pragma unroll
      for (int n0 = 0; n0 < kDs; n0 += 64) {
        if (n0 >= a.d_s) break;
        float part[8][4] = {};
        warp_times_tile<T, 8>(part, ds_rows, k_s, s_len, n0);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = i0 + warp * 16 + lane / 4 + 8 * r;
          if (i >= a.n_q) continue;
          float* out = a.dq_accum + (((b - a.chunk_b0) * a.n_q + i) * heads_local + h_local) * static_cast<int64_t>(a.d_s);
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int col = n0 + 8 * j + 2 * (lane % 4);
            if (col < a.d_s) add_pair(out + col, part[j][2 * r] * unscale, part[j][2 * r + 1] * unscale);
          }
        }
      }
    }
    __syncthreads();  // the stage, k_t and dS^T are refilled next iteration
  }

  const float unscale = 1.f / grad_scale;
  const int col = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key0 + 8 * r;
    if (j >= a.n_k) continue;
    T* out = a.dk + ((b * a.n_k + j) * a.key_heads_s + kh) * static_cast<int64_t>(a.d_s);
#pragma unroll
    for (int n = 0; n < kDs / 8; ++n) {
      if (8 * n + col < a.d_s) store_pair(out + 8 * n + col, dk[n][2 * r] * unscale, dk[n][2 * r + 1] * unscale);
    }
  }
}

// ------------------------------------------------------------------------------ host -----
template <typename T, int kDs, int kDt>
void launch_dq(const AttentionArgs<T>& a, cudaStream_t stream) {
  const size_t smem = 3 * (tile_bytes<T>(kDs) + tile_bytes<T>(a.d_t_pad));
  auto* kernel = &attention_kl_dq_kernel<T, kDs, kDt>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = a.batch * a.heads * ((a.n_q + kBlockRows - 1) / kBlockRows);
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (batch, head, query tile) blocks: ", blocks);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int kDs, int kDt>
void launch_dk(const AttentionArgs<T>& a, cudaStream_t stream) {
  const size_t ds_bytes = a.dq_accum != nullptr && !ds_in_teacher_tile(a.d_t_pad) ? kBlockRows * kDsLen * sizeof(T) : 0;
  const size_t smem = 3 * (tile_bytes<T>(kDs) + tile_bytes<T>(a.d_t_pad)) + 2 * kBlockCols * sizeof(GradRow) + ds_bytes;
  auto* kernel = &attention_kl_dk_kernel<T, kDs, kDt>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  const int64_t blocks = (a.n_k + kBlockRows - 1) / kBlockRows * a.chunk_batches * a.chunk_key_heads;
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (key tile, batch, key head) blocks: ", blocks);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// kDt = kDs when the teacher's padded head dim matches the student's (the dq kernel unrolls its
// teacher scores then), else 0.
template <typename T, int kDs, int kDt>
void backward(AttentionArgs<T> a, const AttentionKLParams& p, at::Tensor& dq, bool deterministic,
              cudaStream_t stream) {
  const int64_t group = p.heads / p.key_heads_s;
  if (deterministic) {
    launch_dq<T, kDs, kDt>(a, stream);
    a.chunk_b0 = 0;
    a.chunk_batches = p.batch;
    a.chunk_kh0 = 0;
    a.chunk_key_heads = static_cast<int>(p.key_heads_s);
    launch_dk<T, kDs, 0>(a, stream);  // unrolling its teacher scores spilled
    return;
  }
  // dq in float32 through atomics, a chunk of (batches x key heads) at a time to bound the buffer.
  const int64_t per_key_head = p.n_queries * group * a.d_s * static_cast<int64_t>(sizeof(float));
  for (const DqChunk& c : dq_accum_chunks(p.batch, p.key_heads_s, per_key_head)) {
    a.chunk_b0 = c.b0;
    a.chunk_batches = c.batches;
    a.chunk_kh0 = c.kh0;
    a.chunk_key_heads = c.key_heads;
    at::Tensor accum =
        at::zeros({c.batches, p.n_queries, c.key_heads * group, a.d_s}, dq.options().dtype(at::kFloat));
    a.dq_accum = accum.data_ptr<float>();
    launch_dk<T, kDs, 0>(a, stream);  // unrolling its teacher scores spilled
    dq.narrow(0, c.b0, c.batches).narrow(2, c.kh0 * group, c.key_heads * group).copy_(accum);
  }
}

}  // namespace

std::vector<DqChunk> dq_accum_chunks(int64_t batch, int64_t key_heads, int64_t bytes_per_key_head) {
  int64_t budget = int64_t{256} << 20;
#ifdef NITROBREW_DEV_KNOBS
  // Development builds only (docs/development.md): NITROBREW_DEV_KNOBS=1 at build time lets the tests
  // force small chunks.
  if (const char* env = std::getenv("NITROBREW_DQ_ACCUM_BYTES")) budget = std::max<int64_t>(1, std::atoll(env));
#endif
  const int64_t per_batch = bytes_per_key_head * key_heads;
  const int64_t batches = std::clamp<int64_t>(budget / std::max<int64_t>(per_batch, 1), 1, batch);
  const int64_t heads =
      batches > 1 ? key_heads : std::clamp<int64_t>(budget / std::max<int64_t>(bytes_per_key_head, 1), 1, key_heads);
  std::vector<DqChunk> chunks;
  for (int64_t b0 = 0; b0 < batch; b0 += batches) {
    for (int64_t kh0 = 0; kh0 < key_heads; kh0 += heads) {
      chunks.push_back({b0, std::min(batches, batch - b0), static_cast<int>(kh0),
                        static_cast<int>(std::min(heads, key_heads - kh0))});
    }
  }
  return chunks;
}

template <typename T>
void launch_attention_kl_backward(AttentionArgs<T> a, const AttentionKLParams& p, at::Tensor& dq, bool deterministic,
                                  cudaStream_t stream) {
  // The gradient accumulators are D_s wide in registers: head dims are rounded up to 64, 128, 256.
  if (a.d_s <= 64) {
    a.d_s_pad = 64;
    if (a.d_t_pad == 64) {
      backward<T, 64, 64>(a, p, dq, deterministic, stream);
    } else {
      backward<T, 64, 0>(a, p, dq, deterministic, stream);
    }
  } else if (a.d_s <= 128) {
    a.d_s_pad = 128;
    if (a.d_t_pad == 128) {
      backward<T, 128, 128>(a, p, dq, deterministic, stream);
    } else {
      backward<T, 128, 0>(a, p, dq, deterministic, stream);
    }
  } else {
    a.d_s_pad = 256;
    if (a.d_t_pad == 256) {
      backward<T, 256, 256>(a, p, dq, deterministic, stream);
    } else {
      backward<T, 256, 0>(a, p, dq, deterministic, stream);
    }
  }
}

template void launch_attention_kl_backward(AttentionArgs<__nv_bfloat16>, const AttentionKLParams&, at::Tensor&, bool,
                                           cudaStream_t);
template void launch_attention_kl_backward(AttentionArgs<__half>, const AttentionKLParams&, at::Tensor&, bool,
                                           cudaStream_t);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
