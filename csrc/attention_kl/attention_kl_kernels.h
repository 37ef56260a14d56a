// The attention-KL CUDA kernels' interface to the host code (attention_kl_ops.cpp): their
// argument struct and launchers. Plain C++ (no device code), so a .cpp file can include it.
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "attention_kl_params.h"

namespace nitrobrew {
namespace cuda {
namespace attention {

// Where the rows of a [B, N, H, D] input lie: the element strides of its batch, row and head
// dims (its head dim is contiguous). Multiples of 8 elements, so every row starts 16-byte aligned;
// a [B, H, N, D] tensor viewed as [B, N, H, D] (layout="bhnd") is read in place.
struct HeadStrides {
  int64_t batch, row, head;
};

// The strides of a [B, N, H, D] input as the kernels read it. A dim of size 1 is only ever
// indexed at 0, so its stride (arbitrary in PyTorch) is replaced by D: harmless in an address and
// a multiple of 16 bytes, as TMA requires of every stride.
inline HeadStrides head_strides(const at::Tensor& t) {
  auto stride = [&](int dim) { return t.size(dim) == 1 ? t.size(3) : t.stride(dim); };
  return {stride(0), stride(1), stride(2)};
}

// Everything the kernels read, as plain pointers and sizes. Inputs are [B, N, H, D] views with D
// a multiple of 8, a contiguous head dim and 16-byte aligned rows at any B, N, H strides (the host
// pads and copies where needed). Outputs (dq, dk) are contiguous [B, N, H, D].
template <typename T>
struct AttentionArgs {
  const T *q_s, *k_s, *q_t, *k_t;
  HeadStrides st_q_s, st_k_s, st_q_t, st_k_t;  // the inputs' strides, in elements
  const bool* key_mask;  // [B, N_k] or nullptr
  int64_t batch;
  int n_q, n_k, heads, key_heads_s, key_heads_t;
  int d_s, d_t;          // head dims (multiples of 8)
  int d_s_pad, d_t_pad;  // the extents the products run over: multiples of 16, >= d
  float c_s, c_t;        // score = c * q.k with c = scale / temperature
  bool reverse, causal;
  // Forward outputs.
  float* loss;       // [B, H, N_q]
  float* row_stats;  // [B, H, N_q, 5]
  // Backward inputs and outputs.
  const float* grad_loss;  // [B, H, N_q]
  const float* grad_max;   // float16 only: max |grad_loss|, to scale dS into float16's range
  const float* grad_stats;  // the forward's row_stats [B, H, N_q, 5]
  // The Hopper backward's per-query data, [B * H, grad_rows_per_head, 6]: a GradRow per query
  // (the row stats and grad_loss * c_s), zero past N_q up to a multiple of 64 queries.
  const float* grad_rows;
  int64_t grad_rows_per_head;
  T* dq;                    // [B, N_q, H, D_s] (the deterministic dq kernel)
  T* dk;                    // [B, N_k, H_ks, D_s]
  // The dk kernel's grid covers batches [chunk_b0, + chunk_batches) and student key heads
  // [chunk_kh0, + chunk_key_heads); with dq_accum it also adds dq into that float32 buffer,
  // laid out [chunk_batches, N_q, chunk_key_heads * group, D_s] (null: deterministic mode).
  float* dq_accum;
  int64_t chunk_b0, chunk_batches;
  int chunk_kh0, chunk_key_heads;

  NB_HOST_DEVICE int key_head_s(int h) const { return h / (heads / key_heads_s); }
  NB_HOST_DEVICE int key_head_t(int h) const { return h / (heads / key_heads_t); }
  // The last key query i sees under the bottom-right causal mask (n_k - 1 without it).
  NB_HOST_DEVICE int last_key(int i) const { return causal ? i + n_k - n_q : n_k - 1; }
  NB_HOST_DEVICE bool visible(int64_t b, int i, int j) const {
    return i < n_q && j < n_k && j <= last_key(i) && (key_mask == nullptr || key_mask[b * n_k + j]);
  }
  // The first of a tile's rows (queries or keys, `st.row` elements apart) of batch b and head `head`.
  NB_HOST_DEVICE static const T* rows(const T* base, const HeadStrides& st, int64_t b, int head, int first_row) {
    return base + b * st.batch + static_cast<int64_t>(first_row) * st.row + static_cast<int64_t>(head) * st.head;
  }
};

// A chunk of the float32 dq buffer the atomic backwards accumulate into: batches [b0, + batches)
// by student key heads [kh0, + key_heads), within 256 MiB (NITROBREW_DQ_ACCUM_BYTES in a development
// build, which the tests set tiny): whole batches when one fits, else key heads of one batch.
struct DqChunk {
  int64_t b0, batches;
  int kh0, key_heads;
};
std::vector<DqChunk> dq_accum_chunks(int64_t batch, int64_t key_heads, int64_t bytes_per_key_head);

// Forward: fills a.loss and a.row_stats (every row; zeros where no key is visible).
template <typename T>
void launch_attention_kl_forward(const AttentionArgs<T>& a, cudaStream_t stream);

// Whether the sm_90a kernels (forward and backward) take these head dims: up to 128 each; the
// host keeps the mma.sync kernels for larger ones.
bool attention_kl_hopper_supports(int64_t d_s, int64_t d_t);

// The same on Hopper with the sm_90a kernel (TMA + wgmma, fwd_sm90.cu); the inputs in kernel
// layout ([B, N, H, D] views as AttentionArgs describes them, read through head_tensor_map).
// Only where use_sm90a_kernels() (tma.h) and attention_kl_hopper_supports.
template <typename T>
void launch_attention_kl_forward_hopper(const AttentionArgs<T>& a, const at::Tensor& q_s, const at::Tensor& k_s,
                                        const at::Tensor& q_t, const at::Tensor& k_t, cudaStream_t stream);

// Backward on Hopper with the sm_90a kernels, for head dims up to 128 (attention_kl_hopper_supports);
// inputs as for the forward's Hopper kernel. By default (bwd_sm90.cu) one
// kernel writes dk and adds dq into a float32 buffer (bulk reductions), then a second converts it
// into dq (a.dq); with_dq = false leaves dq out. Deterministic (bwd_dq_sm90.cu): a dq
// kernel, each entry with one writer, and the fused kernel for dk alone.
template <typename T>
void launch_attention_kl_backward_hopper(const AttentionArgs<T>& a, const at::Tensor& q_s, const at::Tensor& k_s,
                                         const at::Tensor& q_t, const at::Tensor& k_t, cudaStream_t stream);
template <typename T>
void launch_attention_kl_backward_hopper_fused(AttentionArgs<T> a, const at::Tensor& q_s, const at::Tensor& k_s,
                                               const at::Tensor& q_t, const at::Tensor& k_t, bool with_dq,
                                               cudaStream_t stream);

// Backward: fills a.dk and dq (a.dq points into it), with atomics into float32 chunks of dq, or
// with the deterministic dq kernel.
template <typename T>
void launch_attention_kl_backward(AttentionArgs<T> a, const AttentionKLParams& p, at::Tensor& dq,
                                  bool deterministic, cudaStream_t stream);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
