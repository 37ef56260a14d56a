// Every schema of the nitrobrew library, defined once. Device implementations register
// themselves next to their kernels (cpu/, cuda/) with TORCH_LIBRARY_IMPL.
#include <Python.h>
#include <torch/library.h>

// `import nitrobrew._C` loads this shared object, which runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(nitrobrew, m) {
  // Fused-linear distillation, forward. Student logits softcap_s(xs . ws^T) / temperature,
  // teacher logits likewise, over the first vocab_size rows of ws and wt. beta selects the
  // divergence: 0 forward KL(q||p), 1 reverse KL(p||q), otherwise JSD(beta).
  // Returns (loss [N], row_stats [N, 7]) in float32 (float64 for float64 inputs); the
  // columns of row_stats are listed by RowStat in fused_linear_params.h. Rows whose label
  // is ignore_index get zeros.
  m.def(
      "fused_linear_distill_fwd(Tensor xs, Tensor xt, Tensor ws, Tensor wt, Tensor? labels, "
      "int ignore_index, float beta, float temperature, float ce_weight, float? softcap_s, "
      "float? softcap_t, int vocab_size, int chunk_v) -> (Tensor, Tensor)");
  // Recompute backward: given the per-row upstream gradient and the forward's per-row
  // statistics, returns (dxs, dws); each is an empty tensor when not requested.
  m.def(
      "fused_linear_distill_bwd(Tensor grad_loss, Tensor xs, Tensor xt, Tensor ws, Tensor wt, "
      "Tensor? labels, Tensor row_stats, int ignore_index, "
      "float beta, float temperature, float ce_weight, float? softcap_s, float? softcap_t, "
      "int vocab_size, int chunk_v, bool compute_dxs, bool compute_dws) -> (Tensor, Tensor)");
}
