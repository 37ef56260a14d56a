// The training path's stored products on the CPU (products_cpu.cpp): x . w[:vocab]^T in the accumulation
// dtype, for the chunk steps of fused_linear_grad_chunk and the nitrobrew::products op.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace nitrobrew {
namespace cpu {

// z[:, :] = x_acc . w[:vocab]^T, z [rows, vocab] in x_acc's dtype (the accumulation dtype): one product
// where w is in that dtype already, else w converted one vocabulary tile of vocab_tile rows at a time
// (never the whole of it at once).
void store_products(const at::Tensor& x_acc, const at::Tensor& w, at::Tensor& z, int64_t vocab_tile);

}  // namespace cpu
}  // namespace nitrobrew
