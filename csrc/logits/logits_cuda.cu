// CUDA kernels of the logit-level losses (nitrobrew.logits: forward KL, reverse KL, JSD, the skew KLs
// and TVD from logits the caller holds). Memory-bound: one block per row streams the row's logits once per
// pass, in 16-byte loads where the rows allow it, and keeps the same per-row state as the
// fused-linear kernels (online_state.h):
//   forward:  KL pass (one-pass KL state -> loss and the row statistics), then for the divergences
//             with a second pass the mixture pass (second_pass_terms' sums, online_state.h);
//   backward: dLoss/dzs from the saved statistics, written in the logits' dtype.
// Non-finite entries follow nonfinite.h, as on the CPU: -inf (masked vocabulary) contributes 0; a
// NaN or +inf makes the row's loss and gradient NaN (the running maxima keep a NaN), and so does a
// row with no entry above -inf on one side.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <type_traits>

#include "../divergence/nonfinite.h"
#include "../divergence/row_folds.cuh"
#include "../divergence/row_partial.h"
#include "../divergence/row_stats.h"
#include "logits_params.h"
#include "../engine/cuda/cuda_types.h"
#include "../engine/cuda/row_kernels.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

// Calls f(s[k], t[k]) on chunks of the row, kN entries (one 16-byte load of each) or 1 entry at a
// time: each thread takes every blockDim.x-th chunk. The logits are scaled (and rounded) in
// scale_t, then converted to acc_t. f gets the chunk's entries and their first column.
template <int kN, typename T, typename acc_t, typename scale_t, typename F>
__device__ __forceinline__ void for_each_chunk(const T* zs, const T* zt, int64_t stride_s, int64_t stride_t,
                                               int64_t vocab, bool vectorized, scale_t inv_t, F&& f) {
  int64_t v = 0;
  if (vectorized) {
    const int64_t chunks = vocab / kN;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      const uint4 raw_s = reinterpret_cast<const uint4*>(zs)[c];
      const uint4 raw_t = reinterpret_cast<const uint4*>(zt)[c];
      const T* ps = reinterpret_cast<const T*>(&raw_s);
      const T* pt = reinterpret_cast<const T*>(&raw_t);
      acc_t s[kN], t[kN];
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        s[k] = static_cast<acc_t>(scale_logit(to_acc<scale_t>(ps[k]), inv_t));
        t[k] = static_cast<acc_t>(scale_logit(to_acc<scale_t>(pt[k]), inv_t));
      }
      f.template chunk<kN>(s, t, c * kN);
    }
    v = chunks * kN;
  }
  for (int64_t i = v + threadIdx.x; i < vocab; i += blockDim.x) {
    acc_t s[1] = {static_cast<acc_t>(scale_logit(to_acc<scale_t>(zs[i * stride_s]), inv_t))};
    acc_t t[1] = {static_cast<acc_t>(scale_logit(to_acc<scale_t>(zt[i * stride_t]), inv_t))};
    f.template chunk<1>(s, t, i);
  }
}

template <typename acc_t>
struct RowArgs {
  int64_t rows, vocab;
  const int64_t* labels;  // nullptr without labels
  int64_t ignore_index;
  acc_t inv_t;
  bool vectorized;
  DivergenceParams<acc_t> div;
  DivergenceParams<double> div64;  // for the mixture pass of float32 inputs (MixtureType)
  acc_t* loss;   // [N]
  acc_t* stats;  // [N, kNumRowStats]
  // A vocabulary shard's forward (logits_shard) writes these instead of loss and stats:
  acc_t* partial;   // [N, kNumPartialFields]: pass 1's unfinished states
  double* mixture;  // [N, 2]: a shard's second-pass sums
  __device__ __forceinline__ bool valid(int64_t n) const { return labels == nullptr || labels[n] != ignore_index; }
};

template <typename T, typename acc_t, bool kWeightByStudent>
__global__ void __launch_bounds__(kRowThreads) kl_pass_kernel(Rows<T> zs, Rows<T> zt, RowArgs<acc_t> a) {
  const int64_t n = blockIdx.x;
  if (a.partial != nullptr && !a.valid(n)) {
    if (threadIdx.x == 0) store_partial(RowPartial<acc_t>{}, a.partial + n * kNumPartialFields);
    return;
  }
  acc_t* stats = a.stats + n * kNumRowStats;
  if (!a.valid(n)) {  // masked rows: loss 0, statistics 0 (the backward writes zeros for them)
    if (threadIdx.x < kNumRowStats) stats[threadIdx.x] = acc_t(0);
    if (threadIdx.x == 0) a.loss[n] = acc_t(0);
    return;
  }
  KLAccumulator<T, acc_t, kWeightByStudent> acc{};
  for_each_chunk<16 / sizeof(T), T, acc_t>(zs.row(n), zt.row(n), zs.stride, zt.stride, a.vocab, a.vectorized, a.inv_t, acc);
  const KLState<acc_t> st = block_merge(acc.st);
  if (threadIdx.x != 0) return;
  if (a.partial != nullptr) {  // a shard: the state as it is, empty sides included
    store_partial(RowPartial<acc_t>{st, {}, acc_t(0)}, a.partial + n * kNumPartialFields);
    return;
  }
  if (st.w.m == kNegInf<acc_t> || st.o.m == kNegInf<acc_t>) {  // no finite logit on one side
    const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
    for (int k = 0; k < kNumRowStats; ++k) stats[k] = nan;
    a.loss[n] = nan;
    return;
  }
  a.loss[n] = store_kl_row(finish_kl_row(st, kWeightByStudent), stats);
  stats[kMaxCE] = acc_t(0);
  stats[kLogSumCE] = acc_t(0);
  stats[kEntropyS] = acc_t(0);  // the fused-linear forwards' alone, where asked for
}

template <typename T, typename acc_t, Divergence kKind>
__global__ void __launch_bounds__(kRowThreads) mixture_pass_kernel(Rows<T> zs, Rows<T> zt, RowArgs<acc_t> a) {
  using mix_t = MixtureType<T, acc_t>;
  const int64_t n = blockIdx.x;
  if (!a.valid(n)) {
    if (a.mixture != nullptr && threadIdx.x == 0) a.mixture[2 * n] = a.mixture[2 * n + 1] = 0.0;
    return;
  }
  acc_t* stats = a.stats + n * kNumRowStats;
  DivergenceParams<mix_t> div;
  if constexpr (std::is_same_v<mix_t, acc_t>) {
    div = a.div;
  } else {
    div = a.div64;
  }
  MixtureSums<T, mix_t, kKind> sums{div, {stats[kMaxS], stats[kLogSumS]}, {stats[kMaxT], stats[kLogSumT]}};
  for_each_chunk<16 / sizeof(T), T, mix_t>(zs.row(n), zt.row(n), zs.stride, zt.stride, a.vocab, a.vectorized,
                                           a.inv_t, sums);  // logits scaled (rounded) as in the other passes
  block_sum2(sums.sum_a, sums.sum_b);
  if (threadIdx.x != 0) return;
  if (a.mixture != nullptr) {  // a shard: its sums, added over the shards by merge_shards
    a.mixture[2 * n] = sums.sum_a;
    a.mixture[2 * n + 1] = sums.sum_b;
    return;
  }
  const SecondPassRow<mix_t> row = finish_second_pass(div, sums.sum_a, sums.sum_b);
  a.loss[n] = static_cast<acc_t>(row.loss);
  stats[kGradCenter] = static_cast<acc_t>(row.center);
}

// dLoss/dzs of a chunk, stored in the logits' dtype; kKind is div.kind.
template <typename T, typename acc_t, Divergence kKind>
struct GradWriter {
  DivergenceParams<acc_t> div;
  LogNormalizer<acc_t> norm_s, norm_t;
  acc_t center, scale;  // scale = g_n / temperature
  T* out;               // the row of dzs (contiguous)

  template <int kN>
  __device__ __forceinline__ void chunk(const acc_t (&s)[kN], const acc_t (&t)[kN], int64_t v0) {
    alignas(16) T g[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      // A student entry of -inf has probability 0: its gradient is -q (forward KL) or 0, never
      // the 0 * inf that the other divergences' formulas would form.
      const bool zero = kKind != Divergence::kForwardKL && s[k] == kNegInf<acc_t>;
      const acc_t d = zero ? acc_t(0)
                           : divergence_grad(div, s[k], t[k], norm_s, norm_t, center,
                                             RowExp<T, acc_t>{});
      g[k] = from_acc<T>(d * scale);
    }
    if constexpr (kN * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(out + v0) = *reinterpret_cast<const uint4*>(g);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) out[v0 + k] = g[k];
    }
  }
};

template <typename T, typename acc_t, Divergence kKind>
__global__ void __launch_bounds__(kRowThreads)
    grad_kernel(Rows<T> zs, Rows<T> zt, RowArgs<acc_t> a, const acc_t* grad_loss, T* dzs) {
  const int64_t n = blockIdx.x;
  T* out = dzs + n * a.vocab;
  if (!a.valid(n)) {
    for (int64_t v = threadIdx.x; v < a.vocab; v += blockDim.x) out[v] = from_acc<T>(acc_t(0));
    return;
  }
  const acc_t* stats = a.stats + n * kNumRowStats;
  if (stats[kMaxS] != stats[kMaxS] || stats[kMaxT] != stats[kMaxT]) {  // an undefined row: NaN throughout
    for (int64_t v = threadIdx.x; v < a.vocab; v += blockDim.x) out[v] = from_acc<T>(kNaN<acc_t>);
    return;
  }
  DivergenceParams<acc_t> div = a.div;
  div.kind = kKind;  // a constant: divergence_grad's switch folds away
  GradWriter<T, acc_t, kKind> w{div, {stats[kMaxS], stats[kLogSumS]}, {stats[kMaxT], stats[kLogSumT]},
                                stats[kGradCenter], grad_loss[n] * a.inv_t, out};
  for_each_chunk<16 / sizeof(T), T, acc_t>(zs.row(n), zt.row(n), zs.stride, zt.stride, a.vocab, a.vectorized, a.inv_t, w);
}

// Whether every row of t starts 16 bytes aligned with unit column stride.
bool rows_vectorizable(const at::Tensor& t) {
  return t.stride(1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
         (t.stride(0) * t.element_size()) % 16 == 0;
}

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {reinterpret_cast<const T*>(t.data_ptr()), t.stride(0), t.stride(1)};
}

template <typename acc_t>
RowArgs<acc_t> row_args(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels,
                        const DistillParams& p, acc_t* loss, acc_t* stats) {
  RowArgs<acc_t> a;
  a.rows = p.num_rows;
  a.vocab = p.vocab_size;
  a.labels = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  a.ignore_index = p.ignore_index;
  a.inv_t = static_cast<acc_t>(p.inv_temperature);
  a.vectorized = rows_vectorizable(zs) && rows_vectorizable(zt);
  a.div = divergence_params<acc_t>(p);
  a.div64 = divergence_params<double>(p);
  a.loss = loss;
  a.stats = stats;
  a.partial = nullptr;
  a.mixture = nullptr;
  return a;
}

void check_cuda_inputs(const at::Tensor& zs, const at::Tensor&) {
  TORCH_CHECK(zs.is_cuda(), "zs must be a CUDA tensor here, got ", zs.device());
  TORCH_CHECK(zs.size(0) < (int64_t(1) << 31), "nitrobrew: at most 2^31 - 1 rows per call on CUDA");
}

std::tuple<at::Tensor, at::Tensor> logits_fwd_cuda(const at::Tensor& zs_in, const at::Tensor& zt_in,
                                                         const c10::optional<at::Tensor>& labels_in,
                                                         int64_t ignore_index, c10::string_view divergence, double beta, double temperature) {
  const DistillParams p = make_logits_params(zs_in, zt_in, labels_in, ignore_index, divergence, beta, temperature);
  const c10::cuda::CUDAGuard guard(zs_in.device());
  const at::Tensor &zs = zs_in, &zt = zt_in;
  check_cuda_inputs(zs, zt);
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "logits_fwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    using acc_t = at::opmath_type<scalar_t>;
    const auto acc_options = zs.options().dtype(c10::CppTypeToScalarType<acc_t>::value);
    at::Tensor loss = at::empty({p.num_rows}, acc_options);
    at::Tensor stats = at::empty({p.num_rows, kNumRowStats}, acc_options);
    if (p.num_rows > 0) {
      const RowArgs<acc_t> a = row_args<acc_t>(zs, zt, labels, p, loss.data_ptr<acc_t>(), stats.data_ptr<acc_t>());
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
      const unsigned grid = static_cast<unsigned>(p.num_rows);
      const auto kl_pass = p.kind == Divergence::kReverseKL ? kl_pass_kernel<T, acc_t, true> : kl_pass_kernel<T, acc_t, false>;
      kl_pass<<<grid, kRowThreads, 0, stream>>>(rows_of<T>(zs), rows_of<T>(zt), a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (has_second_pass(p.kind)) {
        with_second_pass_kind(p.kind, [&](auto kind) {
          mixture_pass_kernel<T, acc_t, decltype(kind)::value>
              <<<grid, kRowThreads, 0, stream>>>(rows_of<T>(zs), rows_of<T>(zt), a);
        });
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    out = {loss, stats};
  });
  return out;
}

// A vocabulary shard's forward (nitrobrew.distributed): pass 1's unfinished row states, or with
// row_stats (the whole vocabulary's log-normalizers) the second pass's sums over this shard.
at::Tensor logits_shard_cuda(const at::Tensor& zs, const at::Tensor& zt, const c10::optional<at::Tensor>& labels_in,
                                 const c10::optional<at::Tensor>& row_stats, int64_t ignore_index,
                                 c10::string_view divergence, double beta, double temperature) {
  const DistillParams p = make_logits_params(zs, zt, labels_in, ignore_index, divergence, beta, temperature);
  const c10::cuda::CUDAGuard guard(zs.device());
  check_cuda_inputs(zs, zt);
  if (row_stats.has_value()) {
    TORCH_CHECK(row_stats->dim() == 2 && row_stats->size(0) == p.num_rows && row_stats->size(1) == kNumRowStats &&
                    row_stats->device() == zs.device(),
                "row_stats must be [N, ", int(kNumRowStats), "] on ", zs.device(), " as merge_shards returns it");
    TORCH_CHECK(has_second_pass(p.kind), "row_stats are given only to a second pass (jsd, the skew KLs, tvd)");
  }
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  at::Tensor out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "logits_shard_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    using acc_t = at::opmath_type<scalar_t>;
    const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
    const bool mixture = row_stats.has_value();
    out = at::empty({p.num_rows, mixture ? 2 : int64_t(kNumPartialFields)},
                    zs.options().dtype(mixture ? at::kDouble : acc_dtype));
    if (p.num_rows == 0) return;
    const at::Tensor stats = mixture ? row_stats->to(acc_dtype).contiguous() : at::Tensor();
    RowArgs<acc_t> a = row_args<acc_t>(zs, zt, labels, p, nullptr,
                                       mixture ? const_cast<acc_t*>(stats.data_ptr<acc_t>()) : nullptr);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    const unsigned grid = static_cast<unsigned>(p.num_rows);
    if (mixture) {
      a.mixture = out.data_ptr<double>();
      with_second_pass_kind(p.kind, [&](auto kind) {
        mixture_pass_kernel<T, acc_t, decltype(kind)::value>
            <<<grid, kRowThreads, 0, stream>>>(rows_of<T>(zs), rows_of<T>(zt), a);
      });
    } else {
      a.partial = out.data_ptr<acc_t>();
      const auto kl_pass = p.kind == Divergence::kReverseKL ? kl_pass_kernel<T, acc_t, true> : kl_pass_kernel<T, acc_t, false>;
      kl_pass<<<grid, kRowThreads, 0, stream>>>(rows_of<T>(zs), rows_of<T>(zt), a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor logits_bwd_cuda(const at::Tensor& grad_loss, const at::Tensor& zs_in, const at::Tensor& zt_in,
                                  const c10::optional<at::Tensor>& labels_in, const at::Tensor& row_stats,
                                  int64_t ignore_index, c10::string_view divergence, double beta, double temperature) {
  const DistillParams p = make_logits_params(zs_in, zt_in, labels_in, ignore_index, divergence, beta, temperature);
  TORCH_CHECK(grad_loss.dim() == 1 && grad_loss.size(0) == p.num_rows, "grad_loss must be [N] = [", p.num_rows,
              "], got ", grad_loss.sizes());
  TORCH_CHECK(row_stats.dim() == 2 && row_stats.size(0) == p.num_rows && row_stats.size(1) == kNumRowStats,
              "row_stats must be [N, ", int(kNumRowStats), "] as the forward returns it, got ", row_stats.sizes());
  TORCH_CHECK(grad_loss.device() == zs_in.device() && row_stats.device() == zs_in.device(),
              "grad_loss and row_stats must be on ", zs_in.device());
  const c10::cuda::CUDAGuard guard(zs_in.device());
  const at::Tensor &zs = zs_in, &zt = zt_in;
  check_cuda_inputs(zs, zt);
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  at::Tensor dzs = at::empty({p.num_rows, p.vocab_size}, zs.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "logits_bwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    using acc_t = at::opmath_type<scalar_t>;
    if (p.num_rows == 0) return;
    const at::Tensor stats = row_stats.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    const at::Tensor g = grad_loss.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    RowArgs<acc_t> a = row_args<acc_t>(zs, zt, labels, p, nullptr, const_cast<acc_t*>(stats.data_ptr<acc_t>()));
    a.vectorized = a.vectorized && rows_vectorizable(dzs);
    with_divergence_kind(p.kind, [&](auto kind) {
      grad_kernel<T, acc_t, decltype(kind)::value>
          <<<static_cast<unsigned>(p.num_rows), kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              rows_of<T>(zs), rows_of<T>(zt), a, g.data_ptr<acc_t>(), reinterpret_cast<T*>(dzs.data_ptr()));
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dzs;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("logits_fwd", &logits_fwd_cuda);
  m.impl("logits_bwd", &logits_bwd_cuda);
  m.impl("logits_shard", &logits_shard_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
