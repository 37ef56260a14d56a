// The CUDA storage type of a torch scalar type: __nv_bfloat16 for at::BFloat16, __half for
// at::Half, the type itself otherwise; conversions to and from it; and the dispatch over the types
// the CUDA kernels take.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace nitrobrew {
namespace cuda {

template <typename scalar_t>
using cuda_type_t = std::conditional_t<std::is_same_v<scalar_t, at::BFloat16>, __nv_bfloat16,
                                       std::conditional_t<std::is_same_v<scalar_t, at::Half>, __half, scalar_t>>;

#if defined(__CUDACC__)
// Conversions between a storage type and the math's type (16-bit types have no
// implicit conversions in torch's CUDA builds).
template <typename acc_t, typename T>
__device__ __forceinline__ acc_t to_acc(T x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(x);
  } else {
    return static_cast<acc_t>(x);
  }
}

template <typename T, typename acc_t>
__device__ __forceinline__ T from_acc(acc_t x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half(x);
  } else {
    return static_cast<T>(x);
  }
}
#endif

}  // namespace cuda
}  // namespace nitrobrew

// Runs the statements with T, the CUDA storage type of TYPE (bfloat16, float16 or float32; the CUDA
// kernels take no float64, which the ops refuse before dispatching).
#define NITROBREW_DISPATCH_CUDA_FLOATS(TYPE, NAME, ...)                                   \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, [&] {             \
    using T = ::nitrobrew::cuda::cuda_type_t<scalar_t>;                                  \
    if constexpr (!std::is_same_v<T, double>) {                                           \
      __VA_ARGS__                                                                         \
    }                                                                                     \
  })
