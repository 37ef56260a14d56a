// topk_logprobs' row kernel: one block per row of float32 logits reads the row once, keeping the online
// log-sum-exp and entropy sums and a running top-k. Entries strictly above the k-th best kept so far go into
// a candidate buffer in shared memory; whenever it fills, a radix select keeps the k best (docs/notes/topk_logprobs.md).
//
// The kernel must keep up with the memory, so the walk spends few instructions a logit (an H200 has room for
// ~28): a round's eight logits per thread share one maximum and one rescale of the thread's float sums, the
// exponentials are base 2, full rounds carry no bounds checks, and a thread tests its eight logits against the
// threshold into a bit mask and branches once a round (rarely taken once a threshold exists). Selection is a
// radix select (a few 256-bin histogram passes), not a sort: the k survivors are sorted once, at the end.
// Each thread holds the next round's logits in registers (two 16-byte loads) while it works on this round's.
// Free of torch, so that tools/experiments/topk_rows_bench.cu can time it alone.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../engine/cuda/fast_math.cuh"
#include "../engine/numerics.h"
#include "topk_logprobs_limits.h"
#include "topk_order.cuh"

namespace nitrobrew {
namespace cuda {

constexpr int kTopKRowThreads = 256;
namespace topk_rows {

// Blocks an SM keeps (1024 threads), so that ptxas holds a thread to 64 registers.
constexpr int kMinBlocksPerSM = 4;

constexpr int kThreads = kTopKRowThreads;
constexpr int kVec = 4;                           // floats per load
constexpr int kLoads = 2;                         // loads a thread holds per round
constexpr int kPerThread = kVec * kLoads;         // logits a thread takes a round
constexpr int kRound = kThreads * kPerThread;     // 2048 ids a round
constexpr int kBuffer = 4096;                     // candidates: those kept (<= k) and a round's worth, twice over
constexpr int kKept = int(kMaxTopKLogprobsK);     // a selection's survivors, before they move to the buffer's front
constexpr int kBins = 256;                        // a radix pass's digits (8 bits)
// The floor of a base-2 exponent: 2^-200 flushes to 0, and a masked logit's exponent (-inf, or NaN for
// -inf - -inf) becomes this finite value, so that e * d stays 0 rather than 0 * inf.
constexpr float kMinExponent = -200.f;
static_assert(kBuffer >= kMaxTopKLogprobsK + kRound, "a round must fit behind the k kept candidates");
static_assert(kThreads == kBins, "one histogram bin a thread");

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

// The block's shared state.
struct Shared {
  float value[kBuffer];
  int32_t id[kBuffer];
  float kept_value[kKept];
  int32_t kept_id[kKept];
  int hist[kBins];
  RowSums warp_sums[kThreads / 32];
  int count;            // candidates in the buffer
  int kept_count;       // survivors moved so far by a selection
  uint32_t min_kept;    // the order bits of the smallest survivor's value
  float threshold;      // the k-th best kept so far (strictly better entries pass), once k are kept
  bool has_threshold;
  int digit, need, in_bin;  // a radix pass's outcome
  int undefined_row;
};

// The k best of the buffer's `n` candidates (n > k) to its front, and the threshold to the k-th: a radix select
// on order keys, 8 bits a pass from the top, until the digit's bin holds exactly the keys still needed (the keys
// are distinct, ids being so); the survivors are then the keys at or above the prefix found.
__device__ inline void select_k(Shared& sh, int n, int k) {
  const int lane = threadIdx.x % 32;
  uint64_t prefix = 0, mask = 0;
  int need = k;
  for (int shift = 56;; shift -= 8) {
    sh.hist[threadIdx.x] = 0;
    __syncthreads();
    for (int base = 0; base < n; base += kThreads) {  // warp-uniform trips: the lanes aggregate their adds
      const int i = base + threadIdx.x;
      uint32_t digit = 0xffffffffu;  // not counted
      if (i < n) {
        const uint64_t key = order_key(sh.value[i], sh.id[i]);
        if ((key & mask) == prefix) digit = uint32_t(key >> shift) & (kBins - 1);
      }
      const uint32_t peers = __match_any_sync(0xffffffffu, digit);
      if (digit != 0xffffffffu && lane == __ffs(peers) - 1) atomicAdd(&sh.hist[digit], __popc(peers));
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // the digit where the count from the top reaches `need`: lane l has digits 255 - 8l ...
      int c[8], total = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) total += c[j] = sh.hist[kBins - 1 - (lane * 8 + j)];
      int above = total;  // inclusive scan over the lanes, then exclusive
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, above, offset);
        if (lane >= offset) above += other;
      }
      above -= total;
      if (above < need && need <= above + total) {  // one lane
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (above < need && need <= above + c[j]) {
            sh.digit = kBins - 1 - (lane * 8 + j);
            sh.need = need - above;
            sh.in_bin = c[j];
          }
          above += c[j];
        }
      }
    }
    __syncthreads();
    prefix |= uint64_t(sh.digit) << shift;
    mask |= uint64_t(kBins - 1) << shift;
    need = sh.need;
    if (sh.in_bin == need || shift == 0) break;  // the same for every thread: read after the barrier
    // The next pass clears hist and, after its barriers, rewrites digit/need/in_bin: every thread has read them.
  }
  // The survivors (exactly k) to the kept area, and the smallest survivor's value.
  uint32_t min_order = 0xffffffffu;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + threadIdx.x;
    float v = 0.f;
    int32_t d = 0;
    bool keep = false;
    if (i < n) {
      v = sh.value[i];
      d = sh.id[i];
      keep = order_key(v, d) >= prefix;
    }
    const uint32_t ballot = __ballot_sync(0xffffffffu, keep);
    int slot = 0;
    if (lane == 0 && ballot != 0u) slot = atomicAdd(&sh.kept_count, __popc(ballot));
    slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(ballot & ((1u << lane) - 1u));
    if (keep) {
      sh.kept_value[slot] = v;
      sh.kept_id[slot] = d;
      min_order = min(min_order, float_order(v));
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) min_order = min(min_order, __shfl_xor_sync(0xffffffffu, min_order, offset));
  if (lane == 0) atomicMin(&sh.min_kept, min_order);
  __syncthreads();
  for (int j = threadIdx.x; j < k; j += kThreads) {
    sh.value[j] = sh.kept_value[j];
    sh.id[j] = sh.kept_id[j];
  }
  if (threadIdx.x == 0) {
    sh.count = k;
    sh.threshold = float_of_order(sh.min_kept);
    sh.has_threshold = true;
    sh.kept_count = 0;
    sh.min_kept = 0xffffffffu;
  }
  __syncthreads();
}

}  // namespace topk_rows

struct TopKRowArgs {
  const float* z;      // [rows, ld] products x . w^T of the chunk; ld a multiple of 4, rows 16-byte aligned
  int64_t ld, vocab;   // entries at or past vocab are padding (vocab <= 2^31 - 1 - kRound)
  const float* bias;   // [vocab] or null
  float scale, cap, inv_t;
  int k;
  float* logprobs;  // [rows, k]
  int64_t* ids;     // [rows, k]
  float* stats;     // [rows, kNumTopKLogprobsStats]
  float* kth;       // [rows] or null: each row's k-th largest logit over the temperature (-inf where fewer than k
                    // exceed -inf, NaN for a row without a distribution): the walk's threshold (topk_logprobs_cuda.cu)
};

// kSoftcap: a.cap > 0 (the transform's tanh kept out of the loop otherwise). static: one translation unit of
// the extension includes it (and the standalone benchmark).
template <bool kSoftcap>
static __global__ void __launch_bounds__(kTopKRowThreads, topk_rows::kMinBlocksPerSM) topk_rows_kernel(TopKRowArgs a) {
  using namespace topk_rows;
  __shared__ Shared sh;
  const int64_t row = blockIdx.x;
  const float* z = a.z + row * a.ld;
  const int vocab = static_cast<int>(a.vocab), lane_base = threadIdx.x * kVec;
  if (threadIdx.x == 0) {
    sh.count = 0;
    sh.kept_count = 0;
    sh.min_kept = 0xffffffffu;
    sh.has_threshold = false;
    sh.threshold = kNegInf<float>;
    sh.undefined_row = 0;
  }
  __syncthreads();
  // The thread's running sums: its maximum m, sum of 2^d, sum of 2^d * d with d = (s - m) * log2 e, in float (a
  // thread covers at most V / 2048 rounds of eight).
  float m = kNegInf<float>, sum = 0.f, centered2 = 0.f;
  bool undefined = false;

  // Column of entry c of the thread's round at `base`: load c / kVec, lane c % kVec.
  auto column = [&](int base, int c) { return base + (c / kVec) * (kThreads * kVec) + lane_base + c % kVec; };

  auto load_round = [&](int base, float4 (&held)[kLoads]) {
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int v = column(base, l * kVec);
      // A load starting below the vocabulary may reach its padding (zeroed by the host; never used).
      if (v < vocab) held[l] = __ldcs(reinterpret_cast<const float4*>(z + v));  // read once: stream it
    }
  };

  // One round of the thread's eight logits: the sums, then the candidates. kTail: the round reaches past the
  // vocabulary, whose entries are skipped.
  auto work = [&](auto tail, int base, const float4 (&now)[kLoads]) {
    constexpr bool kTail = decltype(tail)::value;
    float s[kPerThread];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      s[l * kVec + 0] = now[l].x, s[l * kVec + 1] = now[l].y, s[l * kVec + 2] = now[l].z, s[l * kVec + 3] = now[l].w;
    }
    if (a.bias != nullptr) {  // the round's biases, loaded together (the bias may sit at any 4-byte offset)
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) {
        const int v = column(base, c);
        if (!kTail || v < vocab) s[c] += a.bias[v];
      }
    }
    if (a.scale != 1.f) {  // model_logit's multiplier, skipped when 1 as there
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) s[c] *= a.scale;
    }
    float round_max = kNegInf<float>;
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const bool valid = !kTail || column(base, c) < vocab;
      float x = s[c];
      if constexpr (kSoftcap) x = softcap(x, a.cap);
      x = scale_logit(x, a.inv_t);
      undefined |= valid && !(x < INFINITY);  // NaN or +inf: the row has no distribution
      s[c] = valid ? x : kNegInf<float>;
      round_max = fmaxf(round_max, s[c]);
    }
    if (round_max > m) {  // rescale the sums to the new maximum (rare after the first rounds)
      const float d = fmaxf((m - round_max) * kLog2e, kMinExponent), f = exp2_approx(d);
      centered2 = f * (centered2 + d * sum);
      sum *= f;
      m = round_max;
    }
    float round_sum = 0.f, round_centered = 0.f;
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      // s - m first: exact for nearby values, where s * log2 e - m * log2 e would carry m's rounding (~1e-8 |m|).
      const float d = fmaxf((s[c] - m) * kLog2e, kMinExponent), e = exp2_approx(d);
      round_sum += e;
      round_centered = fmaf(e, d, round_centered);
    }
    sum += round_sum;
    centered2 += round_centered;
    // Later rounds hold higher ids: an entry equal to the k-th kept loses the tie, so strictly better only.
    const float tau = sh.threshold;
    const bool filtered = sh.has_threshold;
    uint32_t pass = 0;
#pragma unroll
    for (int c = 0; c < kPerThread; ++c) {
      const bool valid = !kTail || column(base, c) < vocab;
      pass |= uint32_t(valid && (!filtered || s[c] > tau)) << c;
    }
    if (__ballot_sync(0xffffffffu, pass != 0u) != 0u) {  // the warp's candidates, appended together
      const int lane = threadIdx.x % 32, n = __popc(pass);
      int offset = n;  // inclusive scan over the lanes
#pragma unroll
      for (int step = 1; step < 32; step <<= 1) {
        const int other = __shfl_up_sync(0xffffffffu, offset, step);
        if (lane >= step) offset += other;
      }
      int slot = 0;
      if (lane == 31) slot = atomicAdd(&sh.count, offset);
      slot = __shfl_sync(0xffffffffu, slot, 31) + offset - n;
#pragma unroll
      for (int c = 0; c < kPerThread; ++c) {
        if (pass >> c & 1u) {
          sh.value[slot] = s[c] + 0.f;  // + 0: -0.0 becomes +0.0, which it ties with (the order keys are bits)
          sh.id[slot] = column(base, c);
          ++slot;
        }
      }
    }
  };

  float4 held[kLoads] = {};  // a load past the vocabulary is skipped: its lanes keep old values, masked
  load_round(0, held);
  for (int base = 0; base < vocab; base += kRound) {
    float4 now[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) now[l] = held[l];
    if (base + kRound < vocab) load_round(base + kRound, held);  // in flight while this round is worked
    if (base + kRound <= vocab) {
      work(std::false_type{}, base, now);
    } else {
      work(std::true_type{}, base, now);
    }
    __syncthreads();
    const int count = sh.count;
    __syncthreads();  // every thread has read count before a selection or the next round's appends move it
    if (count > kBuffer - kRound) select_k(sh, count, a.k);
  }
  if (undefined) sh.undefined_row = 1;
  // The row's sums: the thread's in natural units and double, then within each warp, then across warps.
  RowSums sums{m, static_cast<double>(sum), static_cast<double>(centered2) * kLn2};
  if (m == kNegInf<float>) sums = {kNegInf<float>, 0.0, 0.0};
  for (int offset = 16; offset > 0; offset >>= 1) {
    const RowSums other{__shfl_xor_sync(0xffffffffu, sums.max, offset), __shfl_xor_sync(0xffffffffu, sums.sum, offset),
                        __shfl_xor_sync(0xffffffffu, sums.centered, offset)};
    sums = merge(sums, other);
  }
  if (threadIdx.x % 32 == 0) sh.warp_sums[threadIdx.x / 32] = sums;
  __syncthreads();
  const int count = sh.count;
  if (count > a.k) select_k(sh, count, a.k);  // ends with a barrier
  const int kept = count < a.k ? count : a.k;
  int n = 1;
  while (n < kept) n <<= 1;
  for (int i = kept + threadIdx.x; i < n; i += kThreads) {  // padding after every real entry
    sh.value[i] = kNegInf<float>;
    sh.id[i] = INT32_MAX;
  }
  __syncthreads();
  sort_candidates(sh.value, sh.id, n);  // ends with a barrier (n >= 2), or none is needed (n = 1: no padding)
  RowSums row_sums = sh.warp_sums[0];
  for (int w = 1; w < kThreads / 32; ++w) row_sums = merge(row_sums, sh.warp_sums[w]);

  float* lp = a.logprobs + row * a.k;
  int64_t* ids = a.ids + row * a.k;
  float* stats = a.stats + row * kNumTopKLogprobsStats;
  if (sh.undefined_row || row_sums.max == kNegInf<float>) {  // no distribution: NaN, ids 0..k-1
    for (int j = threadIdx.x; j < a.k; j += kThreads) {
      lp[j] = NAN;
      ids[j] = j;
    }
    if (threadIdx.x == 0) {
      stats[kLogNormalizer] = stats[kEntropy] = NAN;
      if (a.kth != nullptr) a.kth[row] = NAN;
    }
    return;
  }
  const double log_sum = log(row_sums.sum), lse = row_sums.max + log_sum;
  for (int j = threadIdx.x; j < a.k; j += kThreads) {
    lp[j] = static_cast<float>(sh.value[j] - lse);
    ids[j] = sh.id[j];
  }
  if (threadIdx.x == 0) {
    stats[kLogNormalizer] = static_cast<float>(lse);
    stats[kEntropy] = static_cast<float>(log_sum - row_sums.centered / row_sums.sum);
    if (a.kth != nullptr) a.kth[row] = sh.value[a.k - 1];  // padding (-inf) where fewer than k were kept
  }
}

// Launches the row kernel over `rows` rows.
static inline void launch_topk_rows(const TopKRowArgs& a, int64_t rows, cudaStream_t stream) {
  if (a.cap > 0.f) {
    topk_rows_kernel<true><<<static_cast<unsigned>(rows), kTopKRowThreads, 0, stream>>>(a);
  } else {
    topk_rows_kernel<false><<<static_cast<unsigned>(rows), kTopKRowThreads, 0, stream>>>(a);
  }
}

}  // namespace cuda
}  // namespace nitrobrew
