// The attention-KL ops in plain ATen, for any device: CUDA runs float32 inputs here (its kernels
// take bfloat16 / float16 on tensor cores), and the test-only ops _attention_kl_chunked_fwd/bwd
// (attention_kl_chunked.cpp) reach it on any device.
//
// Per block of query rows (and of batches, where whole batches fit), both models' scores
// [batches, H, rows, keys] come from batched GEMMs in the inputs' dtype, with TF32 off for the
// call: exact float32 products, as the float64 reference expects, even where the user allowed TF32.
// The row math runs on the whole block, which is then dropped. A block's scores stay within a byte
// budget, so the [N_q x N_k] matrix is never formed unless it fits in that budget by itself.
//
// row_stats hold what the kernels' do (the RowStat columns kMaxS .. kGradCenter: each model's
// log-normalizer as (max, log of the sum) and E_w[w - o]); rows that see no key hold zeros.
// The backward recomputes each block's scores and turns them into dS with those statistics.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <tuple>

#include "attention_kl_params.h"

namespace nitrobrew {
namespace chunked {

// Bytes of one model's scores of a block by default. Up to about four such blocks are alive at
// once (both models' scores, their difference, the masks): some 256 MiB in all.
constexpr int64_t kScoreBlockBytes = int64_t{64} << 20;

// Forward: (loss [B, H, N_q], row_stats [B, H, N_q, 5]) in the inputs' dtype (float32 or float64).
// The inputs are [B, N, H, D] tensors of any strides; p from make_attention_kl_params.
std::tuple<at::Tensor, at::Tensor> attention_kl_forward(const AttentionKLParams& p, const at::Tensor& q_s,
                                                        const at::Tensor& k_s, const at::Tensor& q_t,
                                                        const at::Tensor& k_t,
                                                        const c10::optional<at::Tensor>& key_mask,
                                                        int64_t score_block_bytes = kScoreBlockBytes);

// Backward: (dq_s, dk_s), contiguous [B, N, H, D], from the per-row upstream gradient [B, H, N_q]
// and the forward's row_stats.
std::tuple<at::Tensor, at::Tensor> attention_kl_backward(const AttentionKLParams& p, const at::Tensor& grad_loss,
                                                         const at::Tensor& q_s, const at::Tensor& k_s,
                                                         const at::Tensor& q_t, const at::Tensor& k_t,
                                                         const c10::optional<at::Tensor>& key_mask,
                                                         const at::Tensor& row_stats,
                                                         int64_t score_block_bytes = kScoreBlockBytes);

}  // namespace chunked
}  // namespace nitrobrew
