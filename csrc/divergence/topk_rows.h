// The per-row math of the top-K teacher loss from hidden states, on [N, K] tensors (ATen, float64,
// on the inputs' device): shared by the CPU and CUDA ops, whose kernels supply the K student logits
// and the student's log-normalizer over the vocabulary (neither ever forms [N, V]).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <tuple>

#include "topk_params.h"

namespace nitrobrew {

// The student's logits at the ids from the products z [N, K] = xs[n] . ws[id_k]: scale * (z + bias[id_k])
// (bias [V_rows] in z's dtype, or undefined), in z's dtype.
at::Tensor model_logits_at_ids(const at::Tensor& z, const at::Tensor& ids, const at::Tensor& bias, double scale);

// Rows that take part: [N] bool, false where labels == ignore_index.
at::Tensor topk_valid_rows(const c10::optional<at::Tensor>& labels, const TopKParams& p, const at::Tensor& like);

// The loss [N] (float64) and the row statistics [N, kTopKLogitsColumn + K] (float64) from the K
// student logits z [N, K] (before the temperature) and, for normalize="full", the student's
// log-normalizer of z / tau over the vocabulary as [N, 2] (max, log of the sum relative to it);
// for "topk" it is renormalized over the K logits (the logit ops' row, any divergence: topk_rows.cpp) and
// student_norm is not read. Rows that are masked (or, for "full", whose teacher kept no mass) get loss 0;
// masked rows' statistics are 0; rows that the non-finite rule (divergence/nonfinite.h) makes undefined get
// a NaN loss and NaN gradient terms. acc_dtype is the kernels' accumulation dtype (float32, float64 for
// float64 inputs): for "full", s = z / tau is rounded to it, as the kernels round it, so that the largest
// logit's log-probability is exact; "topk" keeps s in float64 (its normalizer is formed from s alone).
std::tuple<at::Tensor, at::Tensor> topk_rows_forward(const at::Tensor& z, const at::Tensor& student_norm,
                                                      const at::Tensor& teacher_logprobs, const at::Tensor& valid,
                                                      const TopKParams& p, at::ScalarType acc_dtype);

// normalize="topk" from the student's logits zs [N, V] (the ops from logits; ids in range): the K logits
// gathered at the ids, then topk_rows_forward (loss float32, float64 for float64 zs). The backward
// scatters the ids' terms (topk_grad_terms) into a zero gradient [N, V] in zs's dtype; rows that are
// undefined (nonfinite.h) get a NaN row. acc_dtype as for topk_rows_forward.
std::tuple<at::Tensor, at::Tensor> topk_gathered_forward(const at::Tensor& zs, const at::Tensor& ids,
                                                          const at::Tensor& teacher_logprobs, const at::Tensor& valid,
                                                          const TopKParams& p, at::ScalarType acc_dtype);
at::Tensor topk_gathered_backward(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& ids,
                                  const at::Tensor& teacher_logprobs, const at::Tensor& valid,
                                  const at::Tensor& row_stats, const TopKParams& p, at::ScalarType acc_dtype);

// Merges R vocabulary shards' parts of each row (nitrobrew.distributed) and finishes the rows as
// topk_rows_forward does. partials [R, N, 2 + K] float64: each shard's student log-normalizer of
// z / tau over its rows as (max, log-sum; read for "full" only), then the K student logits z at the
// ids the shard holds, 0 at the others' (each id is one shard's).
std::tuple<at::Tensor, at::Tensor> topk_merge_shards(const at::Tensor& partials, const at::Tensor& teacher_logprobs,
                                                      const at::Tensor& valid, const TopKParams& p,
                                                      at::ScalarType acc_dtype);

// dLoss/dz of a row (without the upstream gradient) is dense[n] * p_v / tau over the vocabulary plus
// a sparse term at each id:
//   full: dense = sum_k q_k, and -(sum of the id's q_k) / tau at an id;
//   topk: dense = 0, and sum of the id's (p~_k - q~_k) / tau at an id.
// An id's entry is written once (write_ids holds -1 at an id's repeated occurrences), either as
//   dense entry + id_sparse   where the kernels keep dLoss/dz in float32 or float64: the dense entry
//                             then comes from the same logit as the log-normalizer, and the
//                             largest entry's p - q cancels as it does in the reference;
//   id_dense + id_sparse      where they keep it in 16 bits: rounding the dense entry first would
//                             cost a 16-bit rounding of p_id / tau, more than the difference between
//                             the gathered logit and the tile's (id_dense = dense * p_id / tau from
//                             the gathered logit).
// grad_rows [N, 3] float32 holds (student max, log-sum, dense) for the kernels; all are 0 on rows
// that take no part.
struct TopKGradTerms {
  at::Tensor dense;      // [N] float64
  at::Tensor write_ids;  // [N, K] int64
  at::Tensor id_sparse;  // [N, K] float64
  at::Tensor id_dense;   // [N, K] float64
  at::Tensor grad_rows;  // [N, 3] float32
};
TopKGradTerms topk_grad_terms(const at::Tensor& row_stats, const at::Tensor& teacher_ids,
                              const at::Tensor& teacher_logprobs, const at::Tensor& valid, const TopKParams& p,
                              at::ScalarType acc_dtype);

// normalize="topk" has no dense part: dxs[n] = sum_k coef[n, k] ws[id_k] and
// dws[v] = sum of coef[n, k] xs[n] over the (n, k) with id_k = v, where coef = g_n * id_sparse (in
// coef_dtype) and only write_ids >= 0 count. sorted_ids / order: write_ids flattened and stably
// sorted, with each entry's flat index n * K + k, so that an id's pairs are one run (the -1 first).
struct TopKSparseGrad {
  at::Tensor coef;        // [N, K]
  at::Tensor sorted_ids;  // [N * K] int64
  at::Tensor order;       // [N * K] int64
};
TopKSparseGrad topk_sparse_grad(const TopKGradTerms& terms, const at::Tensor& grad_loss, at::ScalarType coef_dtype);

}  // namespace nitrobrew
