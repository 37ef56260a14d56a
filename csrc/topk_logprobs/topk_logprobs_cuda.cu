// CUDA implementation of topk_logprobs: token chunks of float32 logits from cuBLAS (products_f32), then one
// block per row reads its row once: the online log-sum-exp and entropy sums, and a running top-k through a
// candidate buffer in shared memory filtered by the k-th best value so far (docs/notes/topk_logprobs.md).
// Memory beyond the outputs: one chunk of float32 products, at most kChunkBytes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "../engine/cuda/cublas_gemm.h"
#include "../engine/numerics.h"
#include "topk_logprobs_params.h"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kPerThread = 8;                        // entries a thread reads per round
constexpr int kRound = kThreads * kPerThread;        // 2048 ids a round
constexpr int kBuffer = 4096;                        // candidates: k (<= 1024) kept + a round's worth, twice over
constexpr int64_t kChunkBytes = int64_t(512) << 20;  // the float32 products of a chunk of rows
static_assert(kBuffer >= kMaxTopKLogprobsK + kRound, "a round must fit behind the k kept candidates");

struct RowSums {  // (max m, sum of exp(s - m), sum of exp(s - m) * (s - m)); the sums in double, as on the CPU
  float max;
  double sum, centered;
};

__device__ RowSums merge(RowSums a, RowSums b) {
  if (a.max == kNegInf<float>) return b;
  if (b.max == kNegInf<float>) return a;
  const float m = fmaxf(a.max, b.max);
  const double da = a.max - m, db = b.max - m, ea = exp(da), eb = exp(db);
  return {m, ea * a.sum + eb * b.sum, ea * (a.centered + da * a.sum) + eb * (b.centered + db * b.sum)};
}

// The output's order: larger value first, ties to the lower id.
__device__ bool before(float va, int32_t ia, float vb, int32_t ib) { return va > vb || (va == vb && ia < ib); }

// Sorts the first n (a power of two) candidates by `before` (bitonic), every thread of the block taking part.
__device__ void sort_candidates(float* value, int32_t* id, int n) {
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

struct RowArgs {
  const float* z;  // [rows, ld] products x . w^T of the chunk
  int64_t ld, vocab;
  const float* bias;  // [vocab] or null
  float scale, cap, inv_t;
  int k;
  float* logprobs;  // [rows, k]
  int64_t* ids;     // [rows, k]
  float* stats;     // [rows, kNumTopKLogprobsStats]
};

__global__ void __launch_bounds__(kThreads) topk_rows_kernel(RowArgs a) {
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

  for (int64_t base = 0; base < a.vocab; base += kRound) {
    const float tau = threshold;
    const bool filtered = has_threshold;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int64_t v = base + j * kThreads + threadIdx.x;
      if (v >= a.vocab) break;
      float s = z[v];
      if (a.bias != nullptr) s += a.bias[v];
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_logprobs_cuda(const at::Tensor& x, const at::Tensor& w, int64_t k,
                                                                  const c10::optional<at::Tensor>& bias,
                                                                  double temperature, c10::optional<double> softcap,
                                                                  double logit_scale, int64_t vocab_size,
                                                                  int64_t chunk_v) {
  const TopKLogprobsParams p =
      make_topk_logprobs_params(x, w, k, bias, temperature, softcap, logit_scale, vocab_size, chunk_v);
  TORCH_CHECK_TYPE(x.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only, got them on ",
                   x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = p.num_rows, vocab = p.vocab_size, ld = (vocab + 7) / 8 * 8;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor logprobs = at::empty({n, k}, f32);
  at::Tensor ids = at::empty({n, k}, x.options().dtype(at::kLong));
  at::Tensor stats = at::empty({n, kNumTopKLogprobsStats}, f32);
  if (n == 0) return {logprobs, ids, stats};
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t rows = std::max<int64_t>(1, std::min(n, kChunkBytes / (4 * ld)));
  at::Tensor z = at::empty({rows, ld}, f32);
  RowArgs a;
  a.ld = ld;
  a.vocab = vocab;
  a.bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  a.scale = static_cast<float>(p.logit_scale);
  a.cap = static_cast<float>(p.softcap);
  a.inv_t = static_cast<float>(p.inv_temperature);
  a.k = static_cast<int>(k);
  a.z = z.data_ptr<float>();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t count = std::min(rows, n - r0);
    products_f32(xc.narrow(0, r0, count), wc, vocab, z.data_ptr<float>(), ld);
    a.logprobs = logprobs.data_ptr<float>() + r0 * k;
    a.ids = ids.data_ptr<int64_t>() + r0 * k;
    a.stats = stats.data_ptr<float>() + r0 * kNumTopKLogprobsStats;
    topk_rows_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {logprobs, ids, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("topk_logprobs", &topk_logprobs_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
