// Numerics shared by every kernel, CPU and CUDA, that know nothing of any loss: the host/device
// qualifier, -infinity, exponentials and the logit transforms (temperature, soft-cap).
#pragma once

#include <cmath>
#include <limits>

#if defined(__CUDACC__)
#define NB_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define NB_HOST_DEVICE inline
#endif

namespace nitrobrew {

// -infinity of a floating type: a masked logit, an empty softmax state's maximum.
template <typename T>
constexpr T kNegInf = -std::numeric_limits<T>::infinity();

template <typename T>
NB_HOST_DEVICE T exp_(T x) {
  using std::exp;
  return exp(x);
}

template <typename T>
NB_HOST_DEVICE T log_(T x) {
  using std::log;
  return log(x);
}

// s = z / tau, rounded once and identically wherever it is formed. With FMA contraction (on
// by default in nvcc) an expression like z * inv_t - m would skip the rounding of s, so the
// largest entry's log-probability would pick up s's rounding error (~1e-5 once tau = 0.1).
template <typename T>
NB_HOST_DEVICE T scale_logit(T z, T inv_t) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __fmul_rn(z, inv_t);
#endif
  return z * inv_t;
}

// Gemma-style soft-capping c * tanh(z / c); cap <= 0 means none.
template <typename T>
NB_HOST_DEVICE T softcap(T z, T cap) {
  using std::tanh;
  return cap > T(0) ? cap * tanh(z / cap) : z;
}

// A model's logit from its product x . w (plus bias): softcap(scale * z), the multiplier of
// Cohere's logit_scale or Granite's 1 / logits_scaling applied before Gemma's soft-cap. Its gradient
// with respect to z is scale * softcap_grad_from_capped: the backwards fold `scale` into the
// upstream gradient of every row.
template <typename T>
NB_HOST_DEVICE T model_logit(T z, T scale, T cap) {
  return softcap(scale == T(1) ? z : z * scale, cap);
}

// d softcap(z) / dz written in terms of the capped value y = c * tanh(z / c).
template <typename T>
NB_HOST_DEVICE T softcap_grad_from_capped(T y, T cap) {
  if (cap <= T(0)) return T(1);
  const T r = y / cap;
  return T(1) - r * r;
}

// log u from u and u - 1 formed without rounding at 1 (the mixtures' u = M / L, online_state.h): log1p where u
// is near 1, where u itself would have rounded at 1's ulp; log(u) where it is not, where u - 1 near -1 would
// make log1p's argument lose u's relative precision (JSD at beta = 0.999: 16x the float32 reference's error).
// In float64 (float32 inputs' math on CUDA, float64 inputs) log(u) alone is within 1e-16 of log u near 1, far
// below what the outputs keep; one log, not both candidates (nvcc evaluates both: 11-17% more instructions).
template <typename T>
NB_HOST_DEVICE T log_near_one(T u, T u_minus_1) {
  using std::log1p;
  if constexpr (sizeof(T) == 8) return log_(u);
  return u_minus_1 > T(-0.5) ? log1p(u_minus_1) : log_(u);
}

// The exponential (and the mixtures' log u) of the row math; the CUDA kernels pass faster ones for 16-bit
// inputs (the special-function unit's, ~2 ulp), whose rounding is far below the inputs'.
struct StdExp {
  template <typename T>
  NB_HOST_DEVICE T operator()(T x) const {
    return exp_(x);
  }
  template <typename T>
  NB_HOST_DEVICE T log_u(T u, T u_minus_1) const {
    return log_near_one(u, u_minus_1);
  }
  // a / u for the mixtures' q / M = (r or 1) / u, u in [min(w), 1].
  template <typename T>
  NB_HOST_DEVICE T over_u(T a, T u) const {
    return a / u;
  }
};

}  // namespace nitrobrew
