// What turns a model's products x . w^T into its logits, for the kernels that form the products (the
// vocabulary walk, vocab_walk.cuh) and those that read them stored (the training path, product_rows.cuh).
#pragma once

#include <cstdint>

#include "../numerics.h"
#include "cuda_types.h"

namespace nitrobrew {
namespace cuda {

// What turns a model's product tile x . w^T into its logits: softcap(scale * (z + bias[v]))
// (model_logit, numerics.h): an lm_head bias, a logit multiplier (Cohere, Granite), a soft-cap
// (Gemma). The passes see the logits; their backwards write dLoss/d(scale * (z + bias)) and fold
// `scale` into the upstream gradient.
template <typename T>
struct ModelLogits {
  const T* bias;  // [>= vocab_size] or nullptr
  float scale;    // 1: none
  float softcap;  // <= 0: none
};

#if defined(__CUDACC__)
// The model's logit of product z at vocabulary column v (< vocab_size), one entry at a time.
template <typename T>
__device__ __forceinline__ float model_logit_at(const ModelLogits<T>& f, float z, int64_t v) {
  if (f.bias != nullptr) z += to_acc<float>(f.bias[v]);
  return model_logit(z, f.scale, f.softcap);
}
#endif

}  // namespace cuda
}  // namespace nitrobrew
