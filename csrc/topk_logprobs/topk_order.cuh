// What topk_logprobs' kernels share about a row: its sums (merged across threads, warps and vocabulary splits)
// and the order of its entries (larger value first, ties to the lower id) as 64-bit keys. Free of torch, so that
// tools/experiments/topk_rows_bench.cu can include it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../engine/numerics.h"

namespace nitrobrew {
namespace cuda {
namespace topk_rows {

struct RowSums {  // (max m, sum of exp(s - m), sum of exp(s - m) * (s - m)); merged in double
  float max;
  double sum, centered;
};

__device__ inline RowSums merge(RowSums a, RowSums b) {
  if (a.max == kNegInf<float>) return b;
  if (b.max == kNegInf<float>) return a;
  const float m = fmaxf(a.max, b.max);
  const double da = double(a.max) - m, db = double(b.max) - m, ea = exp(da), eb = exp(db);  // no float overflow
  return {m, ea * a.sum + eb * b.sum, ea * (a.centered + da * a.sum) + eb * (b.centered + db * b.sum)};
}

// The output's order as one unsigned key: larger value first, ties to the lower id. The float's bits made
// monotone (negative values flipped), then the id's complement.
__device__ __forceinline__ uint32_t float_order(float v) {
  const uint32_t b = __float_as_uint(v);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float float_of_order(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ uint64_t order_key(float v, int32_t id) {
  return (uint64_t(float_order(v)) << 32) | uint32_t(~uint32_t(id));
}

// The output's order: larger value first, ties to the lower id.
__device__ inline bool before(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

}  // namespace topk_rows
}  // namespace cuda
}  // namespace nitrobrew
