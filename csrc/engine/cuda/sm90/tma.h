// Host helpers of the TMA-fed (sm_90a) kernels: tensor-map descriptors of 16-bit operands in the
// 64-byte swizzled layout that wgmma reads (tma.cu).
#pragma once

#include <ATen/core/Tensor.h>
#include <cuda.h>

namespace nitrobrew {
namespace cuda {

// TMA addresses rows with 32-bit coordinates from a 16-byte-aligned base at a stride that is a
// multiple of 16 bytes: whether a 2-D operand qualifies.
bool tma_addressable(const at::Tensor& t);

// TMA descriptor of the first `rows` rows of a row-major [rows x D] 16-bit matrix, in boxes of
// box_rows x 32 values with the 64-byte swizzle that wgmma reads; out-of-range reads are 0.
CUtensorMap tensor_map(const at::Tensor& t, int64_t rows, int box_rows);

// TMA descriptor of a 16-bit [B, N, H, D] view as the 4-D tensor (D, H, N, B), at any B, N, H
// strides that are multiples of 16 bytes (D contiguous, D % 8 == 0, a 16-byte aligned base), in boxes
// of 32 values x one head x box_rows rows of one batch, with the 64-byte swizzle that wgmma reads;
// rows past N (and values past D) read as 0.
CUtensorMap head_tensor_map(const at::Tensor& t, int box_rows);

}  // namespace cuda
}  // namespace nitrobrew
