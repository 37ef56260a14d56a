// Per-thread folds of the memory-bound row kernels, shared by the ops from logits (logits/logits_cuda.cu)
// and the training path's rows of stored products (fused_linear/fused_linear_product_rows.cu): each
// thread folds the entries of a row it is handed, chunk by chunk, and a block merge combines the
// threads. The state and its merge are online_state.h's and row_partial.h's.
#pragma once

#include <limits>
#include <type_traits>

#include "../engine/cuda/row_kernels.cuh"
#include "nonfinite.h"
#include "online_state.h"
#include "row_partial.h"

namespace nitrobrew {
namespace cuda {

// The KL pass's per-thread state: the one-pass KL state of the entries it saw, rescaled only
// when a chunk raises a running maximum. The direction is a template argument: choosing between
// the s and t arrays at run time made the compiler keep both in local memory.
template <typename T, typename acc_t, bool kWeightByStudent>
struct KLAccumulator {
  KLState<acc_t> st;

  template <int kN>
  __device__ __forceinline__ void chunk(const acc_t (&s)[kN], const acc_t (&t)[kN], int64_t) {
    const RowExp<T, acc_t> ex;
    const acc_t(&w)[kN] = kWeightByStudent ? s : t;
    const acc_t(&o)[kN] = kWeightByStudent ? t : s;
    acc_t max_w = kNegInf<acc_t>, max_o = kNegInf<acc_t>;
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      max_w = nan_max(max_w, w[k]);
      max_o = nan_max(max_o, o[k]);
    }
    // A NaN maximum passes these tests too and turns the sums NaN for good (NaN * 0 is NaN).
    if (!(max_w <= st.w.m)) {
      const acc_t r = rescale(st.w.m, max_w);  // 0 from an empty state
      st.w.l *= r;
      st.a *= r;
      st.w.m = max_w;
    }
    if (!(max_o <= st.o.m)) {
      st.o.l *= rescale(st.o.m, max_o);
      st.o.m = max_o;
    }
    // -inf entries have probability 0 and add nothing (0 log 0 = 0): with a finite running
    // maximum their exponential is exp(-inf) = 0, so they need no test of their own; while the
    // maximum is still -inf every entry so far was -inf and the chunk adds nothing.
    if (st.w.m != kNegInf<acc_t>) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const acc_t ew = ex(w[k] - st.w.m);
        st.w.l += ew;
        st.a += ew == acc_t(0) ? acc_t(0) : ew * (w[k] - o[k]);
      }
    }
    if (st.o.m != kNegInf<acc_t>) {
#pragma unroll
      for (int k = 0; k < kN; ++k) st.o.l += ex(o[k] - st.o.m);
    }
  }
};

// Block-wide merge of every thread's state (blocks of up to 1024 threads); the result is valid in
// thread 0.
template <typename acc_t>
__device__ KLState<acc_t> block_merge(KLState<acc_t> st) {
  __shared__ acc_t scratch[32][5];
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) {
    KLState<acc_t> other;
    other.w.m = shfl(st.w.m, mask);
    other.w.l = shfl(st.w.l, mask);
    other.o.m = shfl(st.o.m, mask);
    other.o.l = shfl(st.o.l, mask);
    other.a = shfl(st.a, mask);
    merge_sides(st, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    scratch[warp][0] = st.w.m;
    scratch[warp][1] = st.w.l;
    scratch[warp][2] = st.o.m;
    scratch[warp][3] = st.o.l;
    scratch[warp][4] = st.a;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < int(blockDim.x / 32); ++w) {
      KLState<acc_t> other;
      other.w.m = scratch[w][0];
      other.w.l = scratch[w][1];
      other.o.m = scratch[w][2];
      other.o.l = scratch[w][3];
      other.a = scratch[w][4];
      merge_sides(st, other);
    }
  }
  return st;
}

// The second pass of the divergences that have one (has_second_pass): second_pass_terms' sums (a, b)
// per row, with the log-normalizers of pass 1. The divergence is a template argument (kKind, div.kind's
// value): with every case in one loop the float64 pass of float32 inputs spilled (104 bytes, sm_90a).
template <typename T, typename acc_t, Divergence kKind>
struct MixtureSums {
  DivergenceParams<acc_t> div;
  LogNormalizer<acc_t> norm_s, norm_t;
  acc_t sum_a = 0, sum_b = 0;

  template <int kN>
  __device__ __forceinline__ void chunk(const acc_t (&s)[kN], const acc_t (&t)[kN], int64_t) {
    const RowExp<T, acc_t> ex;
    DivergenceParams<acc_t> d = div;
    d.kind = kKind;  // a constant: second_pass_terms' tests fold away
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const SecondPassTerms<acc_t> terms = second_pass_terms(d, s[k], t[k], norm_s, norm_t, ex);
      sum_a += terms.a;
      sum_b += terms.b;
    }
  }
};

// Calls launch(std::integral_constant<Divergence, kind>{}): kernels whose per-entry math is the divergence's
// compile one variant each (a run-time switch per entry costs registers and instructions).
template <typename F>
void with_divergence_kind(Divergence kind, F&& launch) {
  switch (kind) {
    case Divergence::kForwardKL: return launch(std::integral_constant<Divergence, Divergence::kForwardKL>{});
    case Divergence::kReverseKL: return launch(std::integral_constant<Divergence, Divergence::kReverseKL>{});
    case Divergence::kJSD: return launch(std::integral_constant<Divergence, Divergence::kJSD>{});
    case Divergence::kSkewForwardKL: return launch(std::integral_constant<Divergence, Divergence::kSkewForwardKL>{});
    case Divergence::kSkewReverseKL: return launch(std::integral_constant<Divergence, Divergence::kSkewReverseKL>{});
    default: return launch(std::integral_constant<Divergence, Divergence::kTVD>{});
  }
}

// with_divergence_kind for a divergence with a second pass.
template <typename F>
void with_second_pass_kind(Divergence kind, F&& launch) {
  switch (kind) {
    case Divergence::kSkewForwardKL: return launch(std::integral_constant<Divergence, Divergence::kSkewForwardKL>{});
    case Divergence::kSkewReverseKL: return launch(std::integral_constant<Divergence, Divergence::kSkewReverseKL>{});
    case Divergence::kTVD: return launch(std::integral_constant<Divergence, Divergence::kTVD>{});
    default: return launch(std::integral_constant<Divergence, Divergence::kJSD>{});
  }
}

// The second pass's arithmetic type: float64 for float32 inputs. JSD's per-entry terms
// q (log q - log M) are differences of nearly equal numbers when p ~ q, and in float32 the CUDA
// kernel's sums came out biased: JSD ~8e-9 per row came out as ~1e-9, where float64 arithmetic
// from the same (float32) row statistics is exact to 1e-13 (docs/notes/logits.md). 16-bit inputs
// keep float32: their gradients are rounded far more coarsely than that.
template <typename T, typename acc_t>
using MixtureType = std::conditional_t<std::is_same_v<T, float>, double, acc_t>;

// The cross-entropy add-on's per-thread state: the softmax state of the student's temperature-1 logits
// and, where the thread holds the row's label column, the logit there (0 elsewhere, so that a sum over
// the threads is that logit).
template <typename T, typename acc_t>
struct CEAccumulator {
  SoftmaxState<acc_t> st;
  acc_t label_logit = acc_t(0);
  int64_t label;  // the row's label column (no column matches one outside the vocabulary)

  template <int kN>
  __device__ __forceinline__ void chunk(const acc_t (&y)[kN], int64_t v0) {
    acc_t max_y = kNegInf<acc_t>;
#pragma unroll
    for (int k = 0; k < kN; ++k) max_y = nan_max(max_y, y[k]);
    if (!(max_y <= st.m)) {
      st.l *= rescale(st.m, max_y);
      st.m = max_y;
    }
    if (st.m != kNegInf<acc_t>) {
      const RowExp<T, acc_t> ex;
#pragma unroll
      for (int k = 0; k < kN; ++k) st.l += ex(y[k] - st.m);
    }
    // A compare per entry, not y[label - v0]: indexing the array at run time would place it, and the
    // caller's arrays it is part of, in local memory for every chunk.
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      if (v0 + k == label) label_logit = y[k];
    }
  }
};

// The student's entropy state of a thread's entries (where a caller asks for it): its own running maximum,
// rescaled only when a chunk raises it, and an exponential per entry.
template <typename T, typename acc_t>
struct EntropyAccumulator {
  EntropyState<acc_t> st;

  template <int kN>
  __device__ __forceinline__ void chunk(const acc_t (&s)[kN]) {
    acc_t max_s = kNegInf<acc_t>;
#pragma unroll
    for (int k = 0; k < kN; ++k) max_s = nan_max(max_s, s[k]);
    if (!(max_s <= st.m)) raise_max(st, max_s);  // a NaN maximum turns the state NaN for good
    if (st.m != kNegInf<acc_t>) {
      const RowExp<T, acc_t> ex;
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        const acc_t d = s[k] - st.m;
        const acc_t e = ex(d);
        st.l += e;
        st.c += e == acc_t(0) ? acc_t(0) : e * d;
      }
    }
  }
};

// Merge of the unfinished row states of a warp's lanes, in a fixed order (a butterfly): every lane
// ends with the warp's state.
template <typename acc_t>
__device__ __forceinline__ RowPartial<acc_t> warp_merge(RowPartial<acc_t> st) {
  constexpr int kFields = kNumPartialFields;
#pragma unroll
  for (int mask = 16; mask >= 1; mask >>= 1) {
    acc_t mine[kFields], other[kFields];
    store_partial(st, mine);
#pragma unroll
    for (int f = 0; f < kFields; ++f) other[f] = shfl(mine[f], mask);
    merge(st, load_partial<acc_t>(other));
  }
  return st;
}

// Block-wide merge of every thread's unfinished row state (KL, cross-entropy, label logit) in a fixed
// order (blocks of up to 1024 threads): each warp merges its lanes, then warp 0 the warps'. The result
// is valid in every lane of warp 0, which must be done with it before any thread calls again (a barrier
// between the calls).
template <typename acc_t>
__device__ RowPartial<acc_t> block_merge(const RowPartial<acc_t>& st) {
  __shared__ acc_t scratch[32][kNumPartialFields];
  const RowPartial<acc_t> warp_state = warp_merge(st);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) store_partial(warp_state, scratch[warp]);
  __syncthreads();
  RowPartial<acc_t> mine;  // empty for lanes past the warps
  if (warp == 0 && lane < int(blockDim.x / 32)) mine = load_partial<acc_t>(scratch[lane]);
  return warp == 0 ? warp_merge(mine) : mine;
}

}  // namespace cuda
}  // namespace nitrobrew
