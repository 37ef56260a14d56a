// The CUDA storage type of a torch scalar type: __nv_bfloat16 for at::BFloat16, __half for
// at::Half, the type itself otherwise; and the dispatch over the types the CUDA kernels take.
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
