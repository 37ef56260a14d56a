// Options of the top-K teacher ops (top-K from logits: logits/, from hidden states: topk_linear/): a
// divergence over the K tokens a teacher kept, against a student whose log-probabilities come from its
// logits. normalize="full" takes forward KL only; "topk" (both sides renormalized over the K ids) takes
// every divergence (topk_rows.h). Validated once, handed to the kernels as a struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include "online_state.h"

namespace nitrobrew {

// Columns of the top-K forward's per-row statistics (float64), as (max, log of the sum relative to it): the
// student's log-normalizer of temperature-scaled logits (over the vocabulary, or over the K ids when
// renormalizing) and the teacher's kept mass, log sum_k exp(teacher_logprobs_k) (max -inf: none); then,
// when renormalizing, the divergence's gradient centre over the K ids (RowStat kGradCenter of the logit
// ops, which compute the row: topk_rows.h), else 0.
enum TopKRowStat : int {
  kTopKMax = 0,
  kTopKLogSum,
  kTopKTeacherMax,
  kTopKTeacherLogSum,
  kTopKGradCenter,
  kNumTopKRowStats
};

// The top-K ops (from logits and from hidden states) save [N, kNumTopKRowStats + K] statistics: these
// columns, then the K student logits z_{id_k} (before the temperature) that the forward gathered.
constexpr int kTopKLogitsColumn = kNumTopKRowStats;

struct TopKParams {
  bool renormalize;  // normalize="topk": both distributions renormalized over the K ids
  Divergence kind;   // forward KL unless renormalizing
  double weight;     // the ops' `beta` argument: JSD's beta or the skew KLs' alpha (parse_divergence)
  double inv_temperature;
  double logit_scale;  // multiplier of the student's logits (ops from hidden states; 1 = none)
  int64_t ignore_index;
  int64_t num_rows, vocab_size, k;
  int64_t hidden;   // D of xs and ws (ops from hidden states; 0 for the ops from logits)
  int64_t chunk_v;  // vocabulary chunk width requested by the caller (0 = automatic; ops from hidden states)
};

// The teacher's ids [N, K] and log-probabilities, the temperature, the labels and the divergence (with
// its weight), against `rows_of` ([N, ...], named `name`) and a vocabulary of `vocab` entries. The range check reads the ids on the
// host: fine for the CPU ops; the CUDA ops check on the device instead (check_ids_on_host = false),
// without synchronizing. The caller fills in `hidden` and `chunk_v`.
TopKParams topk_teacher_params(const at::Tensor& rows_of, const char* name, int64_t vocab,
                               const at::Tensor& teacher_ids, const at::Tensor& teacher_logprobs,
                               const c10::optional<at::Tensor>& labels, int64_t ignore_index, double temperature,
                               bool renormalize, c10::string_view divergence, double weight,
                               bool check_ids_on_host);

// Sets p.kind and p.weight from the ops' divergence and beta arguments, after p.renormalize ("full" takes
// forward KL only).
void set_topk_divergence(TopKParams& p, c10::string_view divergence, double weight);

// The name of a divergence as the ops take it (the inverse of parse_divergence).
const char* divergence_name(Divergence kind);

// The teacher's ids and log-probabilities as the CUDA kernels take them: each id outside [0, vocab)
// replaced by 0 and its log-probability by NaN, so that its row's loss and gradient come out NaN
// (the non-finite rule, nonfinite.h) and no kernel reads outside the row. Elementwise on the device,
// no synchronization: eager calls have raised an IndexError in Python before this; it serves
// torch.compile, CUDA-graph capture and direct calls of the ops, where a device-side assertion
// would end the process's CUDA context.
struct GuardedTopK {
  at::Tensor ids, logprobs;
};
GuardedTopK guard_topk_ids(const at::Tensor& teacher_ids, const at::Tensor& teacher_logprobs, int64_t vocab);

// grad_loss [N] and the forward's row statistics [N, columns] of a top-K backward, on `device`.
void check_topk_backward_inputs(const at::Tensor& grad_loss, const at::Tensor& row_stats, int64_t columns,
                                const TopKParams& p, const at::Device& device);

}  // namespace nitrobrew
