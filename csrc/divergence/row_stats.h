// The forward's per-row statistics, as the backward reads them: shared by the CPU and CUDA
// kernels.
#pragma once

#include "online_state.h"

namespace nitrobrew {

// Columns of the forward's per-row statistics, a [N, kNumRowStats] tensor that the
// backward reads: the log-normalizers of the student, the teacher and the cross-entropy
// add-on (temperature 1) as (max, log-sum), and the gradient's centre (divergence_grad in
// online_state.h): E_p[s - t] for reverse KL, KL(p||M) for JSD; then the student's entropy where a
// caller asked for it (0 elsewhere). Rows whose label is ignore_index hold zeros.
enum RowStat : int {
  kMaxS = 0,
  kLogSumS,
  kMaxT,
  kLogSumT,
  kGradCenter,
  kMaxCE,
  kLogSumCE,
  kEntropyS,
  kNumRowStats
};

// Writes a row's log-normalizers and gradient centre into its statistics; returns the KL.
template <typename T>
NB_HOST_DEVICE T store_kl_row(const KLRowResult<T>& r, T* row) {
  row[kMaxS] = r.norm_s.max;
  row[kLogSumS] = r.norm_s.log_sum;
  row[kMaxT] = r.norm_t.max;
  row[kLogSumT] = r.norm_t.log_sum;
  row[kGradCenter] = r.grad_center;
  return r.kl;
}

}  // namespace nitrobrew
