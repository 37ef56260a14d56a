// Every schema of the nitrobrew library, defined once. Device implementations register
// themselves next to their kernels (each family's cpu.cpp and CUDA sources) with TORCH_LIBRARY_IMPL.
//
// `divergence` names the loss: "forward_kl" KL(q||p), "reverse_kl" KL(p||q) or "jsd" (generalized
// JSD with mixture weight `beta`, which the two KLs do not read; JSD(0) and JSD(1) are the two KLs).
// p is the student's distribution, q the teacher's (divergence/online_state.h).
#include <Python.h>
#include <torch/library.h>

// `import nitrobrew._C` loads this shared object, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(nitrobrew, m) {
  // Fused-linear distillation (fused_linear/), forward. Student logits
  // softcap_s(logit_scale_s * (xs . ws^T + bias_s)) / temperature, teacher logits likewise, over the
  // first vocab_size rows of ws and wt (biases [V_rows] in the weights' dtype, or None).
  // Returns (loss [N], row_stats [N, 8]) in float32 (float64 for float64 inputs); the
  // columns of row_stats are listed by RowStat in divergence/row_stats.h. Rows whose label
  // is ignore_index get zeros. With entropy, row_stats' last column holds each row's student entropy
  // (0 without; it costs the KL pass an exponential per student logit). The backward takes every
  // option but entropy.
  m.def(
      "fused_linear_fwd(Tensor xs, Tensor xt, Tensor ws, Tensor wt, Tensor? labels, Tensor? bias_s, "
      "Tensor? bias_t, int ignore_index, str divergence, float beta, float temperature, float ce_weight, "
      "float? softcap_s, float? softcap_t, float logit_scale_s, float logit_scale_t, int vocab_size, "
      "int chunk_v, bool entropy=False) -> (Tensor, Tensor)");
  // Recompute backward: given the per-row upstream gradient and the forward's per-row
  // statistics, returns (dxs, dws, dbias_s); each is an empty tensor when not requested.
  m.def(
      "fused_linear_bwd(Tensor grad_loss, Tensor xs, Tensor xt, Tensor ws, Tensor wt, "
      "Tensor? labels, Tensor? bias_s, Tensor? bias_t, Tensor row_stats, int ignore_index, "
      "str divergence, float beta, float temperature, float ce_weight, float? softcap_s, float? softcap_t, "
      "float logit_scale_s, float logit_scale_t, int vocab_size, int chunk_v, bool compute_dxs, "
      "bool compute_dws, bool compute_dbias_s) -> (Tensor, Tensor, Tensor)");

  // The training path's step over a chunk of rows (nitrobrew/_forward_grads.py): each row's loss [N]
  // (float32, float64 for float64 inputs) and G = dLoss_n/dz [N, vocab_size] for every row, in the
  // inputs' dtype on CUDA (the dtype of the tensor-core products that consume it) and in the
  // accumulation dtype on the CPU, with a row stride of vocab_size rounded up to 8. G is scaled by the
  // scalar tensor row_scale (the reduction's weight, in the loss's dtype, on the inputs' device) and
  // logit_scale_s; masked rows hold 0. With entropy, also each row's student entropy [N] in the loss's
  // dtype (masked rows 0), else an empty tensor.
  // The logits' products are formed once, product_rows rows at a time, in the accumulation dtype.
  m.def(
      "fused_linear_grad_chunk(Tensor xs, Tensor xt, Tensor ws, Tensor wt, Tensor? labels, Tensor? bias_s, "
      "Tensor? bias_t, Tensor row_scale, int ignore_index, str divergence, float beta, float temperature, "
      "float ce_weight, float? softcap_s, float? softcap_t, float logit_scale_s, float logit_scale_t, "
      "int vocab_size, int product_rows, bool entropy=False) -> (Tensor, Tensor, Tensor)");

  // The training path's stored products: x [N, D] . w[:vocab_size]^T [N, vocab_size] in the accumulation
  // dtype (float32; float64 for float64 inputs), the GEMM's only rounding, in rows with a stride of
  // vocab_size rounded up to 8. The top-K training path's logits (_forward_grads.py).
  m.def("products(Tensor x, Tensor w, int vocab_size) -> Tensor");

  // The teacher's side of top-K distillation (topk_logprobs/): the k most likely tokens of each row of the
  // logits softcap(logit_scale * (x . w[:vocab_size]^T + bias)) / temperature, in one walk over the
  // vocabulary. Returns (logprobs [N, k] over the whole vocabulary, sorted descending with ties to the lower
  // id; ids [N, k] int64; stats [N, 2]: the log-normalizer and the entropy), float32 (float64 for float64
  // inputs). A row with a NaN or +inf logit, or none above -inf, gets NaN log-probabilities and statistics
  // and ids 0..k-1. No gradients.
  m.def(
      "topk_logprobs(Tensor x, Tensor w, int k, Tensor? bias, float temperature, float? softcap, "
      "float logit_scale, int vocab_size, int chunk_v) -> (Tensor, Tensor, Tensor)");
  // acc [V, D] float32 = g^T . x + beta * acc, g [N, V] and x [N, D] of one dtype (unit-stride rows), the
  // products accumulated in float32 and added to acc unrounded: how the training path accumulates dws over
  // many chunks without rounding it to 16 bits at each (_forward_grads.py).
  m.def("accumulate_grad(Tensor(a!) acc, Tensor g, Tensor x, float beta) -> ()");

  // The training path's stages over stored products, for vocabulary shards (nitrobrew/distributed.py), whose
  // rows are merged across ranks between them. zs, zt: [N, V_shard] products x . w^T (no bias) in the
  // accumulation dtype, from `products`; labels local as fused_linear_shard's; biases [>= V_shard].
  // dtype: the inputs' (the biases' on CUDA, whose kernels compute as the single-device step does for it).
  // product_partials: the unfinished row states [S, N, 11] of S column parts (merge_shards merges them, with
  // the other shards', in order); with row_stats (merge_shards' over the whole vocabulary; JSD only) the
  // mixture sums [S, N, 2] in float64. With entropy, the partials carry the student's entropy states too.
  m.def(
      "product_partials(Tensor zs, Tensor zt, Tensor? labels, Tensor? bias_s, Tensor? bias_t, Tensor? row_stats, "
      "int ignore_index, str divergence, float beta, float temperature, float ce_weight, float? softcap_s, "
      "float? softcap_t, float logit_scale_s, float logit_scale_t, ScalarType dtype, bool entropy=False) -> Tensor");
  // product_grads: G = dLoss/dz [N, V_shard] from the whole vocabulary's row_stats, times row_scale (a scalar
  // tensor: the reduction's weight) and logit_scale_s, in fused_linear_grad_chunk's dtype for `dtype` inputs
  // (the inputs' on CUDA, the accumulation dtype on the CPU); masked rows 0.
  m.def(
      "product_grads(Tensor zs, Tensor zt, Tensor? labels, Tensor? bias_s, Tensor? bias_t, Tensor row_stats, "
      "Tensor row_scale, int ignore_index, str divergence, float beta, float temperature, float ce_weight, "
      "float? softcap_s, float? softcap_t, float logit_scale_s, float logit_scale_t, ScalarType dtype) -> Tensor");

  // x * factor (a scalar tensor on x's device), computed in float32 (float64 for float64 x), in x's dtype:
  // how the training path's backward scales its saved gradients by the upstream gradient.
  m.def("scaled(Tensor x, Tensor factor) -> Tensor");

  // A vocabulary shard's forward (nitrobrew.distributed): ws, wt hold the shard's rows, labels are
  // local (a label outside [0, vocab_size) is another shard's: no column holds it, no error).
  // Without row_stats: pass 1's unfinished row states [N, 11] (PartialField in
  // divergence/row_partial.h; float32, float64 for float64 inputs), which merge_shards merges over
  // the shards; with entropy they carry the student's entropy states too (merge_shards finishes them
  // into row_stats' entropy column). With row_stats (merge_shards' output over the whole vocabulary;
  // JSD only): the shard's JSD mixture sums [N, 2] in float64, KL(q||M) and KL(p||M).
  m.def(
      "fused_linear_shard(Tensor xs, Tensor xt, Tensor ws, Tensor wt, Tensor? labels, Tensor? bias_s, "
      "Tensor? bias_t, Tensor? row_stats, int ignore_index, str divergence, float beta, float temperature, "
      "float ce_weight, float? softcap_s, float? softcap_t, float logit_scale_s, float logit_scale_t, "
      "int vocab_size, int chunk_v, bool entropy=False) -> Tensor");
  // Merges the R shards' row states (partials [R, N, 11], in shard order) and finishes the rows:
  // (loss [N], row_stats [N, 8]) as fused_linear_fwd / logits_fwd return them over the whole
  // vocabulary (vocab_size entries; labels global). JSD's loss also needs the shards' mixture sums
  // ([R, N, 2]); without them only its row statistics' log-normalizers are final.
  m.def(
      "merge_shards(Tensor partials, Tensor? mixture, Tensor? labels, int ignore_index, str divergence, "
      "float beta, float ce_weight, int vocab_size) -> (Tensor, Tensor)");

  // Distillation from logits (logits/, nitrobrew.logits), forward: the fused-linear losses from the
  // [N, V] logits zs, zt themselves (entries of -inf allowed: they have probability 0). Same outputs
  // and row statistics as fused_linear_fwd; every row needs a finite logit per model.
  m.def(
      "logits_fwd(Tensor zs, Tensor zt, Tensor? labels, int ignore_index, str divergence, float beta, "
      "float temperature) -> (Tensor, Tensor)");
  // A vocabulary shard's forward, as fused_linear_shard (zs, zt: the shard's [N, V_shard] logits).
  m.def(
      "logits_shard(Tensor zs, Tensor zt, Tensor? labels, Tensor? row_stats, int ignore_index, "
      "str divergence, float beta, float temperature) -> Tensor");
  // Recompute backward: dLoss/dzs [N, V] in zs's dtype from the per-row upstream gradient.
  m.def(
      "logits_bwd(Tensor grad_loss, Tensor zs, Tensor zt, Tensor? labels, Tensor row_stats, "
      "int ignore_index, str divergence, float beta, float temperature) -> Tensor");

  // Top-K teacher distillation from the student's [N, V] logits (logits/): a divergence over the K ids the
  // teacher kept ([N, K] int64 teacher_ids, any order; teacher_logprobs its log-probabilities over
  // its full vocabulary), the temperature on the student only. renormalize: both distributions
  // renormalized over the K ids ("topk"), and any divergence (divergence, beta as logits_fwd takes them);
  // else forward KL sum_k q_k (log q_k - log p_{id_k}) with the student's softmax over the vocabulary and
  // q_k as given ("full"). Returns loss [N] (float32, float64 for float64 inputs) and row_stats
  // [N, 5 + K] (float64: TopKRowStat in divergence/topk_params.h, then the K student logits at the ids).
  m.def(
      "topk_logits_fwd(Tensor zs, Tensor teacher_ids, Tensor teacher_logprobs, Tensor? labels, "
      "int ignore_index, float temperature, bool renormalize, str divergence, float beta) -> (Tensor, Tensor)");
  // Recompute backward: dLoss/dzs [N, V] in zs's dtype.
  m.def(
      "topk_logits_bwd(Tensor grad_loss, Tensor zs, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, Tensor row_stats, int ignore_index, float temperature, bool renormalize, str divergence, "
      "float beta) -> Tensor");

  // Top-K teacher distillation from the student's hidden states xs [N, D] and unembedding ws [V, D]
  // (topk_linear/): the loss of topk_logits_fwd for the logits logit_scale_s * (xs . ws^T + bias_s),
  // never formed: "full" walks the vocabulary online (chunk_v wide on the CPU, 0 = automatic) for the
  // log-normalizer and picks the K logits out of its tiles; "topk" takes the K logits as dot products
  // with gathered rows of ws. Returns loss [N] (float32, float64 for float64 inputs) and row_stats
  // [N, 5 + K] (float64: TopKRowStat, then the K student logits).
  m.def(
      "topk_linear_fwd(Tensor xs, Tensor ws, Tensor teacher_ids, Tensor teacher_logprobs, Tensor? labels, "
      "Tensor? bias_s, int ignore_index, float temperature, float logit_scale_s, bool renormalize, "
      "int chunk_v, str divergence, float beta) -> (Tensor, Tensor)");
  // Recompute backward: (dxs, dws, dbias_s), each an empty tensor when not requested.
  m.def(
      "topk_linear_bwd(Tensor grad_loss, Tensor xs, Tensor ws, Tensor teacher_ids, Tensor teacher_logprobs, "
      "Tensor? labels, Tensor? bias_s, Tensor row_stats, int ignore_index, float temperature, "
      "float logit_scale_s, bool renormalize, int chunk_v, str divergence, float beta, bool compute_dxs, "
      "bool compute_dws, bool compute_dbias_s) -> (Tensor, Tensor, Tensor)");

  // Merges the R vocabulary shards' top-K parts (partials [R, N, 2 + K] float64: each shard's student
  // log-normalizer of z / temperature over its rows, then the K student logits at the ids it holds, 0
  // at the others') and finishes the rows: (loss [N], row_stats [N, 5 + K]) as topk_linear_fwd returns
  // them over the whole vocabulary (loss float64 for float64 logits, else float32).
  m.def(
      "topk_merge_shards(Tensor partials, Tensor teacher_logprobs, Tensor? labels, int ignore_index, "
      "float temperature, bool renormalize, str divergence, float beta, bool float64_logits) -> (Tensor, Tensor)");

  // Attention-distribution KL (attention_kl/), forward. Layout [B, N, H, D]; scores
  // scale * q.k / temperature per model, keys hidden by key_mask ([B, N_k] bool, true = attended)
  // or by the bottom-right causal mask excluded. divergence: "forward_kl" KL(teacher || student)
  // or "reverse_kl" KL(student || teacher), per query row. Returns (loss [B, H, N_q], row_stats [B, H, N_q, 5]) in float32
  // (float64 for float64 inputs); rows that see no key get zeros.
  m.def(
      "attention_kl_fwd(Tensor q_s, Tensor k_s, Tensor q_t, Tensor k_t, Tensor? key_mask, str divergence, "
      "bool causal, float scale_s, float scale_t, float temperature, bool deterministic) -> (Tensor, Tensor)");
  // Recompute backward: given the per-row upstream gradient [B, H, N_q] and the forward's
  // row statistics, returns (dq_s, dk_s). deterministic: no floating-point atomics (the CUDA
  // kernels then recompute the scores once more; the forward ignores it, autograd passes it on).
  m.def(
      "attention_kl_bwd(Tensor grad_loss, Tensor q_s, Tensor k_s, Tensor q_t, Tensor k_t, Tensor? key_mask, "
      "Tensor row_stats, str divergence, bool causal, float scale_s, float scale_t, float temperature, "
      "bool deterministic) "
      "-> (Tensor, Tensor)");
}
