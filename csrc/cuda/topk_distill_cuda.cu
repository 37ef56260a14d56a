// CUDA kernels of the top-K teacher ops from logits (nitrobrew.logits.topk_kl): forward KL over the
// K ids a teacher kept, sum_k q_k (log q_k - log p_{id_k}), with the same math as the CPU op
// (csrc/cpu/topk_distill_cpu.cpp). One block per row:
//   forward:  the student's log-normalizer (normalize="full": one streaming pass over the row, the
//             sums in float64; "topk": over the K gathered logits), the teacher's kept mass, and the
//             K terms, all in float64;
//   backward: normalize="full" writes (sum_k q_k) p_v for every v, then each id's entry again with
//             its q's subtracted; "topk" writes zeros, then p~ - q~ at the ids. An id that appears
//             several times is written once, by its first occurrence, with every occurrence's
//             terms (O(K^2) comparisons per row: meant for K up to a few thousand).
// Ids outside [0, V) stop the kernel with a device-side assertion, as torch.gather's do (a check
// on the host would synchronize).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <type_traits>

#include "../online_state.h"
#include "../topk_params.h"
#include "fused_linear_common.cuh"
#include "row_kernels.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

template <typename T>
struct TopKArgs {
  Rows<T> zs;
  const int64_t* ids;   // [N, K] contiguous
  const double* lps;    // [N, K] contiguous, float64
  const int64_t* labels;  // nullptr without labels
  int64_t ignore_index, vocab, k;
  double inv_t;
  bool renormalize;
  __device__ __forceinline__ bool valid(int64_t n) const { return labels == nullptr || labels[n] != ignore_index; }
  __device__ __forceinline__ double s(int64_t n, int64_t v) const {
    return scale_logit(to_acc<double>(zs.row(n)[v * zs.stride]), inv_t);
  }
  __device__ __forceinline__ int64_t id(int64_t n, int64_t j) const {
    const int64_t v = ids[n * k + j];
    CUDA_KERNEL_ASSERT(v >= 0 && v < vocab && "teacher_ids must be in [0, V)");
    return v;
  }
};

// Block-wide maximum; valid in every thread.
__device__ double block_max(double x) {
  __shared__ double scratch[kRowThreads / 32];
  __shared__ double result;
  for (int mask = 16; mask >= 1; mask >>= 1) x = fmax(x, shfl(x, mask));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kRowThreads / 32; ++w) x = fmax(x, scratch[w]);
    result = x;
  }
  __syncthreads();
  return result;
}

// log of sum_j exp(x_j - max) for the block's values (max known to every thread; -inf: none).
__device__ LogNormalizer<double> block_normalizer(double max, double sum) {
  double unused = 0;
  block_sum2(sum, unused);
  __shared__ double result;
  if (threadIdx.x == 0) result = sum;
  __syncthreads();
  return {max, log(result)};
}

// The student's log-normalizer over the whole row: each thread an online (max, sum) over its
// entries, merged across the block. Logits and sums in float64; the exponentials of the (float64)
// differences in float32 for 16-bit and float32 inputs (a relative error of ~1e-7 per term, which
// averages out in the sum), in float64 for float64 inputs.
template <typename T>
__device__ LogNormalizer<double> full_normalizer(const TopKArgs<T>& a, int64_t n) {
  auto exp_diff = [](double x) -> double {
    if constexpr (std::is_same_v<T, double>) {
      return exp(x);
    } else {
      return static_cast<double>(expf(static_cast<float>(x)));
    }
  };
  double m = kNegInf, l = 0;
  for (int64_t v = threadIdx.x; v < a.vocab; v += blockDim.x) {
    const double s = a.s(n, v);
    if (s == kNegInf) continue;
    if (s > m) {
      l *= m == kNegInf ? 0.0 : exp_diff(m - s);
      m = s;
    }
    l += exp_diff(s - m);
  }
  const double row_max = block_max(m);
  const double scaled = m == kNegInf ? 0.0 : l * exp(m - row_max);
  return block_normalizer(row_max, scaled);
}

// The row's normalizers as the CPU op forms them (its row_norms), in every thread.
template <typename T>
__device__ void row_norms(const TopKArgs<T>& a, int64_t n, LogNormalizer<double>& student,
                          LogNormalizer<double>& teacher) {
  const double* lp = a.lps + n * a.k;
  double lp_max = kNegInf;
  for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) lp_max = fmax(lp_max, lp[j]);
  lp_max = block_max(lp_max);
  double mass = 0;
  if (lp_max != kNegInf) {
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) mass += exp(lp[j] - lp_max);
  }
  teacher = block_normalizer(lp_max, mass);
  if (a.renormalize) {
    double m = kNegInf;
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) m = fmax(m, a.s(n, a.id(n, j)));
    m = block_max(m);
    double sum = 0;
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) sum += m == kNegInf ? 0.0 : exp(a.s(n, a.id(n, j)) - m);
    student = block_normalizer(m, sum);
  } else {
    student = full_normalizer(a, n);
  }
}

__device__ __forceinline__ double teacher_log_prob(double lp, const LogNormalizer<double>& teacher, bool renormalize) {
  return renormalize ? log_prob(lp, teacher) : lp;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    topk_forward_kernel(TopKArgs<T> a, double* loss, double* stats) {
  const int64_t n = blockIdx.x;
  double* row = stats + n * kNumTopKRowStats;
  if (!a.valid(n)) {
    if (threadIdx.x < kNumTopKRowStats) row[threadIdx.x] = 0.0;
    if (threadIdx.x == 0) loss[n] = 0.0;
    return;
  }
  LogNormalizer<double> student, teacher;
  row_norms(a, n, student, teacher);
  const double* lp = a.lps + n * a.k;
  double total = 0, unused = 0;
  if (teacher.max != kNegInf) {
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) {
      if (lp[j] == kNegInf) continue;  // q = 0: 0 log 0 = 0
      const double log_q = teacher_log_prob(lp[j], teacher, a.renormalize);
      total += exp(log_q) * (log_q - log_prob(a.s(n, a.id(n, j)), student));
    }
  }
  block_sum2(total, unused);
  if (threadIdx.x != 0) return;
  row[kTopKMax] = student.max;
  row[kTopKLogSum] = student.log_sum;
  row[kTopKTeacherMax] = teacher.max;
  row[kTopKTeacherLogSum] = teacher.log_sum;
  loss[n] = total;
}

template <typename T>
__global__ void __launch_bounds__(kRowThreads)
    topk_backward_kernel(TopKArgs<T> a, const double* grad_loss, const double* stats, T* dzs) {
  const int64_t n = blockIdx.x;
  const double* row = stats + n * kNumTopKRowStats;
  T* out = dzs + n * a.vocab;
  const bool active = a.valid(n) && row[kTopKTeacherMax] != kNegInf;
  const LogNormalizer<double> student{row[kTopKMax], row[kTopKLogSum]}, teacher{row[kTopKTeacherMax],
                                                                               row[kTopKTeacherLogSum]};
  const double coef = grad_loss[n] * a.inv_t;
  const double mass = active ? exp(teacher.max + teacher.log_sum) : 0.0;
  // Phase 1: every entry as if no id were there.
  for (int64_t v = threadIdx.x; v < a.vocab; v += blockDim.x) {
    const double g = active && !a.renormalize ? coef * mass * exp(log_prob(a.s(n, v), student)) : 0.0;
    out[v] = from_acc<T>(g);
  }
  if (!active) return;
  __syncthreads();  // phase 1's stores are visible to the block before any id's entry is rewritten
  // Phase 2: each id's entry, written once by its first occurrence.
  const double* lp = a.lps + n * a.k;
  for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) {
    const int64_t v = a.id(n, j);
    bool first = true;
    for (int64_t i = 0; i < j && first; ++i) first = a.id(n, i) != v;
    if (!first) continue;
    const double p = exp(log_prob(a.s(n, v), student));
    double g = a.renormalize ? 0.0 : coef * mass * p;
    for (int64_t i = j; i < a.k; ++i) {
      if (a.id(n, i) != v) continue;
      const double q = lp[i] == kNegInf ? 0.0 : exp(teacher_log_prob(lp[i], teacher, a.renormalize));
      g += a.renormalize ? coef * (p - q) : -coef * q;
    }
    out[v] = from_acc<T>(g);
  }
}

template <typename T>
TopKArgs<T> topk_args(const at::Tensor& zs, const at::Tensor& ids, const at::Tensor& lps,
                      const c10::optional<at::Tensor>& labels, const TopKParams& p) {
  TopKArgs<T> a;
  a.zs = {reinterpret_cast<const T*>(zs.data_ptr()), zs.stride(0), zs.stride(1)};
  a.ids = ids.data_ptr<int64_t>();
  a.lps = lps.data_ptr<double>();
  a.labels = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  a.ignore_index = p.ignore_index;
  a.vocab = p.vocab_size;
  a.k = p.k;
  a.inv_t = p.inv_temperature;
  a.renormalize = p.renormalize;
  return a;
}

std::tuple<at::Tensor, at::Tensor> topk_logit_distill_fwd_cuda(const at::Tensor& zs, const at::Tensor& teacher_ids,
                                                              const at::Tensor& teacher_logprobs,
                                                              const c10::optional<at::Tensor>& labels_in,
                                                              int64_t ignore_index, double temperature,
                                                              bool renormalize) {
  const TopKParams p = make_topk_logit_params(zs, teacher_ids, teacher_logprobs, labels_in, ignore_index, temperature,
                                              renormalize, /*check_ids_on_host=*/false);
  TORCH_CHECK(zs.is_cuda() && zs.size(0) < (int64_t(1) << 31), "zs must be a CUDA tensor of fewer than 2^31 rows");
  const c10::cuda::CUDAGuard guard(zs.device());
  const at::Tensor ids = teacher_ids.contiguous(), lps = teacher_logprobs.to(at::kDouble).contiguous();
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  at::Tensor loss = at::empty({p.num_rows}, zs.options().dtype(at::kDouble));
  at::Tensor stats = at::empty({p.num_rows, kNumTopKRowStats}, zs.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "topk_logit_distill_fwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    if (p.num_rows == 0) return;
    topk_forward_kernel<T><<<static_cast<unsigned>(p.num_rows), kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        topk_args<T>(zs, ids, lps, labels, p), loss.data_ptr<double>(), stats.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  // The loss in the inputs' accumulation dtype (float32, float64 for float64), as on the CPU.
  const auto out_dtype = zs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return {loss.to(out_dtype), stats};
}

at::Tensor topk_logit_distill_bwd_cuda(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& teacher_ids,
                                       const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels_in,
                                       const at::Tensor& row_stats, int64_t ignore_index, double temperature,
                                       bool renormalize) {
  const TopKParams p = make_topk_logit_params(zs, teacher_ids, teacher_logprobs, labels_in, ignore_index, temperature,
                                              renormalize, /*check_ids_on_host=*/false);
  check_topk_backward_inputs(grad_loss, row_stats, kNumTopKRowStats, p, zs.device());
  const c10::cuda::CUDAGuard guard(zs.device());
  const at::Tensor ids = teacher_ids.contiguous(), lps = teacher_logprobs.to(at::kDouble).contiguous();
  const at::Tensor g = grad_loss.to(at::kDouble).contiguous(), stats = row_stats.to(at::kDouble).contiguous();
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  at::Tensor dzs = at::empty({p.num_rows, p.vocab_size}, zs.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "topk_logit_distill_bwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    if (p.num_rows == 0) return;
    topk_backward_kernel<T><<<static_cast<unsigned>(p.num_rows), kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        topk_args<T>(zs, ids, lps, labels, p), g.data_ptr<double>(), stats.data_ptr<double>(),
        reinterpret_cast<T*>(dzs.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dzs;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("topk_logit_distill_fwd", &topk_logit_distill_fwd_cuda);
  m.impl("topk_logit_distill_bwd", &topk_logit_distill_bwd_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
