// The special-function unit's exponential, log and reciprocal, flushing denormals to zero, and the exponential
// of the row math built on them (RowExp).
//
// __expf and __logf compile to the same MUFU instructions, wrapped in checks of denormal arguments and results
// (an exponential's range check and two predicated multiplies; a log's rescale of a denormal input): 3-5
// instructions each, on kernels bound by the instructions they issue (docs/notes/divergences.md). A probability
// below 2^-126 adds nothing a float32 sum keeps, so the ftz forms lose nothing the outputs hold.
#pragma once

#include "../numerics.h"

namespace nitrobrew {
namespace cuda {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x, ~2 ulp; 0 below 2^-126.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2 x, ~2 ulp away from 1 (absolute error ~2^-22 near 1); -inf for 0 and denormals.
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 1 / x, ~1 ulp.
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float exp_approx(float x) { return exp2_approx(x * kLog2e); }
__device__ __forceinline__ float log_approx(float x) { return log2_approx(x) * kLn2; }

// The exponential, the mixtures' log u and q / M (online_state.h's Exp) of the row math in acc_t: the fast forms
// above for 16-bit inputs, whose gradients are rounded to 16 bits; the accurate ones for float32 and float64
// (float32 inputs keep their tighter accuracy).
template <typename T, typename acc_t>
struct RowExp {
  static constexpr bool kFast = sizeof(T) == 2 && sizeof(acc_t) == 4;

  __device__ __forceinline__ acc_t operator()(acc_t x) const {
    if constexpr (kFast) {
      return exp_approx(x);
    } else {
      return exp(x);
    }
  }
  // log u given u and u - 1, u in [min(w), 1] (mixture): lg2's absolute error near 1 is below what a 16-bit
  // gradient keeps.
  __device__ __forceinline__ acc_t log_u(acc_t u, acc_t u_minus_1) const {
    if constexpr (kFast) {
      return log_approx(u);
    } else {
      return log_near_one(u, u_minus_1);
    }
  }
  // a / u (the mixture's q / M; u in [min(w), 1]); IEEE division (a subroutine call on its slow path) otherwise.
  __device__ __forceinline__ acc_t over_u(acc_t a, acc_t u) const {
    if constexpr (kFast) {
      return a * rcp_approx(u);
    } else {
      return a / u;
    }
  }
};

}  // namespace cuda
}  // namespace nitrobrew
