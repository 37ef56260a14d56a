// topk_logprobs' row kernel: one block per row of float32 logits reads the row once, keeping the online
// log-sum-exp and entropy sums (in double, as the CPU walk does) and a running top-k: entries strictly
// above the k-th best so far go into a candidate buffer in shared memory, which a bitonic sort cuts back
// to the k best whenever it fills (docs/notes/topk_logprobs.md).
//
// The kernel has to run at the memory's speed to stay small beside the product that feeds it: each
// thread holds the next round's entries in registers (two 16-byte loads) while it works on this round's,
// so that a block keeps its loads in flight across the round's barriers.
// Free of torch, so that tools/experiments/topk_rows_bench.cu can time it alone.
#pragma once

#include <cstdint>

#include "../engine/numerics.h"
#include "topk_logprobs_limits.h"

namespace nitrobrew {
namespace cuda {

constexpr int kTopKRowThreads = 256;
namespace topk_rows {

// Blocks an SM keeps (1024 threads): without this floor ptxas targets 5 on sm_90a and spills the held loads.
constexpr int kMinBlocksPerSM = 4;

constexpr int kThreads = kTopKRowThreads;
constexpr int kVec = 4;                        // floats per load
constexpr int kLoads = 2;                      // loads a thread holds per round
constexpr int kRound = kThreads * kVec * kLoads;  // 2048 ids a round
constexpr int kBuffer = 4096;                  // candidates: k (<= 1024) kept + a round's worth, twice over
static_assert(kBuffer >= kMaxTopKLogprobsK + kRound, "a round must fit behind the k kept candidates");

struct RowSums {  // (max m, sum of exp(s - m), sum of exp(s - m) * (s - m)); the sums in double
  float max;
  double sum, centered;
};

__device__ inline RowSums merge(RowSums a, RowSums b) {
  if (a.max == kNegInf<float>) return b;
  if (b.max == kNegInf<float>) return a;
  const float m = fmaxf(a.max, b.max);
  const double da = a.max - m, db = b.max - m, ea = exp(da), eb = exp(db);
  return {m, ea * a.sum + eb * b.sum, ea * (a.centered + da * a.sum) + eb * (b.centered + db * b.sum)};
}

// The output's order: larger value first, ties to the lower id.
__device__ inline bool before(float va, int32_t ia, float vb, int32_t ib) {
  return va > vb || (va == vb && ia < ib);
}

// Sorts the first n (a power of two) candidates by `before` (bitonic), every thread of the block taking part.
__device__ inline void sort_candidates(float* value, int32_t* id, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n / 2; i += kThreads) {
        const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
        const bool descending_block = (lo & size) == 0;  // this half sorts into the output order
        const bool swap = descending_block ? before(value[hi], id[hi], value[lo], id[lo])
                                           : before(value[lo], id[lo], value[hi], id[hi]);
        if (swap) {
          const float v = value[lo];
          value[lo] = value[hi];
          value[hi] = v;
          const int32_t t = id[lo];
          id[lo] = id[hi];
          id[hi] = t;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace topk_rows

struct TopKRowArgs {
  const float* z;      // [rows, ld] products x . w^T of the chunk; ld a multiple of 4, rows 16-byte aligned
  int64_t ld, vocab;   // entries at or past vocab are padding
  const float* bias;   // [vocab] or null
  float scale, cap, inv_t;
  int k;
  float* logprobs;  // [rows, k]
  int64_t* ids;     // [rows, k]
  float* stats;     // [rows, kNumTopKLogprobsStats]
};

// static: one translation unit of the extension includes it (and the standalone benchmark).
static __global__ void __launch_bounds__(kTopKRowThreads, topk_rows::kMinBlocksPerSM) topk_rows_kernel(TopKRowArgs a) {
  using namespace topk_rows;
  __shared__ float value[kBuffer];
  __shared__ int32_t id[kBuffer];
  __shared__ int count;
  __shared__ float threshold;  // the k-th best kept so far (strictly better entries pass), once k are kept
  __shared__ bool has_threshold;
  __shared__ RowSums warp_sums[kThreads / 32];
  __shared__ int undefined_row;
  const int64_t row = blockIdx.x;
  const float* z = a.z + row * a.ld;
  if (threadIdx.x == 0) {
    count = 0;
    has_threshold = false;
    threshold = kNegInf<float>;
    undefined_row = 0;
  }
  __syncthreads();
  RowSums sums{kNegInf<float>, 0.0, 0.0};
  bool undefined = false;

  // Keeps the k best candidates, sorted, and sets the threshold to the k-th.
  auto select = [&]() {
    int n = 1;
    while (n < count) n <<= 1;
    for (int i = count + threadIdx.x; i < n; i += kThreads) {  // padding after every real entry
      value[i] = kNegInf<float>;
      id[i] = INT32_MAX;
    }
    __syncthreads();
    sort_candidates(value, id, n);
    if (threadIdx.x == 0) {
      count = min(count, a.k);
      if (count == a.k) {
        threshold = value[a.k - 1];
        has_threshold = true;
      }
    }
    __syncthreads();
  };

  // Load l of a round covers ids [base + l * kThreads * kVec, + kThreads * kVec): a warp reads 512
  // contiguous bytes. A load starting below the vocabulary may reach its padding (up to a multiple of 4 <= ld,
  // zeroed by the host); those entries are skipped.
  auto load_round = [&](int64_t base, float4 (&held)[kLoads]) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int64_t v = base + (l * kThreads + threadIdx.x) * kVec;
      if (v < a.vocab) held[l] = __ldcs(reinterpret_cast<const float4*>(z + v));  // read once: stream it
    }
  };

  float4 held[kLoads] = {};  // lanes past the vocabulary keep zeros, never used
  load_round(0, held);
  for (int64_t base = 0; base < a.vocab; base += kRound) {
    float4 now[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) now[l] = held[l];
    if (base + kRound < a.vocab) load_round(base + kRound, held);  // in flight while this round is worked
    if (a.bias != nullptr) {  // the round's biases, loaded together (the bias may sit at any 4-byte offset)
#pragma unroll
      for (int l = 0; l < kLoads; ++l) {
        const int64_t v0 = base + (l * kThreads + threadIdx.x) * kVec;
        now[l].x += v0 < a.vocab ? a.bias[v0] : 0.f;
        now[l].y += v0 + 1 < a.vocab ? a.bias[v0 + 1] : 0.f;
        now[l].z += v0 + 2 < a.vocab ? a.bias[v0 + 2] : 0.f;
        now[l].w += v0 + 3 < a.vocab ? a.bias[v0 + 3] : 0.f;
      }
    }
    const float tau = threshold;
    const bool filtered = has_threshold;
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const float entries[kVec] = {now[l].x, now[l].y, now[l].z, now[l].w};
      const int64_t v0 = base + (l * kThreads + threadIdx.x) * kVec;
#pragma unroll
      for (int c = 0; c < kVec; ++c) {
        const int64_t v = v0 + c;
        if (v >= a.vocab) break;
        float s = entries[c];
        s = scale_logit(model_logit(s, a.scale, a.cap), a.inv_t) + 0.f;  // + 0: -0.0 ties with +0.0
        if (isnan(s) || s == INFINITY) {
          undefined = true;
          continue;
        }
        if (s > sums.max) {
          if (sums.max == kNegInf<float>) {
            sums = {s, 1.0, 0.0};
          } else {
            const double shift = sums.max - s, e = exp(shift);
            sums = {s, e * sums.sum + 1.0, e * (sums.centered + shift * sums.sum)};
          }
        } else if (s != kNegInf<float>) {
          const float d = s - sums.max, e = __expf(d);
          sums.sum += e;
          sums.centered += static_cast<double>(e) * d;
        }
        // Later rounds hold higher ids: an entry equal to the k-th kept loses the tie, so strictly better only.
        if (!filtered || s > tau) {
          const int slot = atomicAdd(&count, 1);
          value[slot] = s;
          id[slot] = static_cast<int32_t>(v);
        }
      }
    }
    __syncthreads();
    const bool full = count > kBuffer - kRound;
    __syncthreads();  // every thread has read count before the next round's appends move it
    if (full) select();
  }
  if (undefined) undefined_row = 1;
  // The row's sums: within each warp, then across warps.
  for (int offset = 16; offset > 0; offset >>= 1) {
    const RowSums other{__shfl_xor_sync(0xffffffffu, sums.max, offset), __shfl_xor_sync(0xffffffffu, sums.sum, offset),
                        __shfl_xor_sync(0xffffffffu, sums.centered, offset)};
    sums = merge(sums, other);
  }
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sums;
  select();  // ends with a barrier: warp_sums and undefined_row are complete
  RowSums row_sums = warp_sums[0];
  for (int w = 1; w < kThreads / 32; ++w) row_sums = merge(row_sums, warp_sums[w]);

  float* lp = a.logprobs + row * a.k;
  int64_t* ids = a.ids + row * a.k;
  float* stats = a.stats + row * kNumTopKLogprobsStats;
  if (undefined_row || row_sums.max == kNegInf<float>) {  // no distribution: NaN, ids 0..k-1
    for (int j = threadIdx.x; j < a.k; j += kThreads) {
      lp[j] = NAN;
      ids[j] = j;
    }
    if (threadIdx.x == 0) stats[kLogNormalizer] = stats[kEntropy] = NAN;
    return;
  }
  const double log_sum = log(row_sums.sum), lse = row_sums.max + log_sum;
  for (int j = threadIdx.x; j < a.k; j += kThreads) {
    lp[j] = static_cast<float>(value[j] - lse);
    ids[j] = id[j];
  }
  if (threadIdx.x == 0) {
    stats[kLogNormalizer] = static_cast<float>(lse);
    stats[kEntropy] = static_cast<float>(log_sum - row_sums.centered / row_sums.sum);
  }
}

}  // namespace cuda
}  // namespace nitrobrew
