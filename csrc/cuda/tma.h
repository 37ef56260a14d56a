// Host helpers of the sm_90a (TMA + wgmma) kernels shared by the fused-linear and attention ops
// (defined in logit_passes.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda.h>

namespace nitrobrew {
namespace cuda {

// Whether the sm_90a kernels should run on the current device: Hopper with the sm_90a build
// loaded, and NITROBREW_FORCE_SM80 not set to 1.
bool use_sm90a_kernels();

// TMA descriptor of a contiguous [B, N, H, D] 16-bit tensor as the 4-D tensor (D, H, N, B), in
// boxes of 32 values x one head x box_rows rows of one batch, with the 64-byte swizzle that wgmma
// reads; rows past N (and values past D) read as 0.
CUtensorMap head_tensor_map(const at::Tensor& t, int box_rows);

}  // namespace cuda
}  // namespace nitrobrew
