// The training path's row kernels of the fused-linear losses (product_rows.cu), from the host: given a
// chunk of rows' stored products of both models, each row's loss and dLoss/dz.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "../divergence/distill_params.h"

namespace nitrobrew {
namespace cuda {

// The stored products and where the results go, for rows [0, rows) of a chunk.
struct ProductRowsLaunch {
  const float* zs;  // [rows, ld] float32: xs . ws^T, no bias
  const float* zt;  // [rows, ld] float32: xt . wt^T
  int64_t ld;       // a multiple of kProductAlign
  int64_t rows;
  const int64_t* labels;  // [rows] or nullptr
  const void* bias_s;     // [>= vocab_size] in the inputs' dtype, or nullptr
  const void* bias_t;
  const float* row_scale;  // device scalar: every unmasked row's dLoss/dz is multiplied by it (and logit_scale_s)
  float* loss;             // [rows], zeros: masked rows keep their 0
  void* grad;              // [rows, ld_grad] in the inputs' dtype: dLoss/dz * row_scale * logit_scale_s
  int64_t ld_grad;
  const float* row_stats = nullptr;  // [rows, kNumRowStats] over the whole vocabulary (a shard's stages)
  float* entropy = nullptr;          // [rows]: each row's student entropy (masked rows 0), where p.entropy
};

// The row stride (in entries) that the stored products and dLoss/dz of a row of `vocab` columns must have.
int64_t product_row_stride(int64_t vocab);

// Launches the row kernels for inputs of `dtype` (bfloat16, float16 or float32) on the current stream.
void launch_product_rows(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype);

// The same kernels as a vocabulary shard's stages (product_partials, product_grads), whose row states are
// merged across ranks between them: each row's unfinished state over the shard's columns into merged
// [rows, kNumPartialFields] (float32); JSD's mixture sums [rows, 2] (float64) from l.row_stats; G into
// l.grad from l.row_stats. loss is not read.
void launch_product_partials(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype, float* merged);
at::Tensor launch_product_mixture(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype);
void launch_product_grads(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype);

}  // namespace cuda
}  // namespace nitrobrew
