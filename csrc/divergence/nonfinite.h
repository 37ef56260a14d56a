// The non-finite rule of every loss (docs/design.md, "Non-finite inputs"), as the CPU and CUDA
// kernels apply it:
//   - -inf logits or log-probabilities are probability 0: their terms are 0 (0 log 0 = 0);
//   - NaN, and +inf where it is no legal value (a logit, a log-probability), make the row's loss
//     and gradient NaN; other rows are unaffected;
//   - a distribution with no entry above -inf is undefined: NaN too (a logit row all -inf, a
//     top-K teacher renormalized over K log-probabilities that are all -inf).
#pragma once

#include <limits>
#include <type_traits>

#include "../engine/numerics.h"

namespace nitrobrew {

template <typename T>
constexpr T kNaN = std::numeric_limits<T>::quiet_NaN();

// max(a, b) that keeps a NaN (fmax and std::max drop it): a row's running maximum must not lose a
// NaN whose neighbours are all -inf. On sm_80 and later GPUs one instruction (max.NaN) for float, where the
// compare-and-select took three per entry of the row kernels' maxima.
template <typename T>
NB_HOST_DEVICE T nan_max(T a, T b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<T, float>) {
    float y;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
    return y;
  }
#endif
  return (a > b || a != a) ? a : b;
}

// A teacher log-probability as its row's maximum is taken over it: NaN counts as +inf, so that
// the maximum is +inf exactly when the row holds a NaN or +inf (teacher_row_max maps it to NaN).
template <typename T>
NB_HOST_DEVICE T teacher_max_key(T lp) {
  return lp != lp ? std::numeric_limits<T>::infinity() : lp;
}

// The row's teacher maximum as the statistics keep it: NaN for a row holding a NaN or +inf.
template <typename T>
NB_HOST_DEVICE T teacher_row_max(T max_key) {
  return max_key == std::numeric_limits<T>::infinity() ? kNaN<T> : max_key;
}

// Whether a normalize="full" top-K row's loss (and gradient) is NaN: its teacher held a NaN or +inf.
// (All -inf keeps every q_k = 0: loss 0. normalize="topk" rows are the logit ops' rows, with their rule:
// K log-probabilities that are all -inf leave the teacher no distribution, NaN.)
template <typename T>
NB_HOST_DEVICE bool topk_row_undefined(T teacher_max) {
  return teacher_max != teacher_max;
}

}  // namespace nitrobrew
