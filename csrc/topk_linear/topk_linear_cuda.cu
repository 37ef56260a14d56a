// CUDA ops of the top-K teacher loss from hidden states (nitrobrew.topk_kl); the algorithm and the
// per-row math are the CPU op's (topk_linear_cpu.cpp, divergence/topk_rows.h).
//   forward:  for normalize="full" the fused-linear kernels' student-only pass (StudentNormPass)
//             folds every tile of xs . ws^T into a softmax state per row and vocabulary split
//             (float64 sums), merged by merge_norm_kernel, and picks the K student logits z_{id_k}
//             out of its tiles (IdPicker, passes.cuh); "topk" has no vocabulary pass, and
//             gather_logits_kernel forms them as xs[n] . ws[id_k] (float32 sums of the gathered
//             rows). The per-row terms are [N, K] ATen ops.
//   backward: "full": per vocabulary chunk (engine/cuda/chunked_grads.h), StudentGradPass recomputes the
//             tiles and writes the dense part of dLoss/dz, write_id_entries_kernel the K ids'
//             entries, and cuBLAS forms dxs and dws from the chunk. "topk" has only the K ids'
//             terms: sparse_dxs_kernel gathers K rows of ws per token, sparse_dws_kernel sums the
//             xs rows of each id (ids sorted into runs), and the bias's coefficients.
// An lm_head bias and a logit scale enter as the fused-linear losses' do (ModelLogits,
// engine/cuda/vocab_walk.cuh): the walk forms scale * (xs . ws^T + bias), "topk" applies them to
// the gathered products, and the backwards fold the scale into the upstream gradient.
// Ids outside [0, V) arrive as id 0 with a NaN log-probability (guard_topk_ids): their rows come out
// NaN (nonfinite.h), with no device-side assertion and no read outside ws.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <tuple>

#include "../engine/cuda/chunked_grads.h"
#include "../engine/cuda/cuda_types.h"
#include "../engine/cuda/row_kernels.cuh"
#include "topk_linear_launch.h"
#include "topk_linear_params.h"
#include "../divergence/topk_rows.h"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int kGatherThreads = 256;

// One block per row; each warp takes every 8th of the row's K ids and reduces xs[n] . ws[id] over
// the hidden dimension, in 16-byte loads where both rows allow them.
template <typename T>
__global__ void __launch_bounds__(kGatherThreads)
    gather_logits_kernel(const T* __restrict__ xs, int64_t ld_x, const T* __restrict__ ws, int64_t ld_w,
                         const int64_t* __restrict__ ids, int64_t k, int64_t hidden, bool vectorized,
                         float* __restrict__ out) {
  constexpr int kPerLoad = 16 / sizeof(T);
  const int64_t n = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* x = xs + n * ld_x;
  for (int64_t j = warp; j < k; j += kGatherThreads / 32) {
    const int64_t id = ids[n * k + j];  // in [0, V)
    const T* w = ws + id * ld_w;
    float sum = 0.f;
    if (vectorized) {
      for (int64_t d = int64_t(lane) * kPerLoad; d < hidden; d += 32 * kPerLoad) {
        const uint4 xv = *reinterpret_cast<const uint4*>(x + d), wv = *reinterpret_cast<const uint4*>(w + d);
        const T* xe = reinterpret_cast<const T*>(&xv);
        const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
        for (int e = 0; e < kPerLoad; ++e) sum = fmaf(to_acc<float>(xe[e]), to_acc<float>(we[e]), sum);
      }
    } else {
      for (int64_t d = lane; d < hidden; d += 32) sum = fmaf(to_acc<float>(x[d]), to_acc<float>(w[d]), sum);
    }
#pragma unroll
    for (int mask = 16; mask >= 1; mask >>= 1) sum += shfl(sum, mask);
    if (lane == 0) out[n * k + j] = sum;
  }
}

// Merges each row's vocabulary splits (in split order: deterministic) into its log-normalizer
// [N, 2] = (max, log-sum), float64; masked rows get zeros (their partial states were never written).
__global__ void merge_norm_kernel(const double* __restrict__ partial, int64_t splits, int64_t n_rows,
                                  const int64_t* __restrict__ labels, int64_t ignore_index,
                                  double* __restrict__ norm) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= n_rows) return;
  SoftmaxState<double> st{0.0, 1.0};
  if (labels == nullptr || labels[n] != ignore_index) {
    st = SoftmaxState<double>{};
    for (int64_t s = 0; s < splits; ++s) {
      const double* in = partial + (s * n_rows + n) * 2;
      merge(st, SoftmaxState<double>{in[0], in[1]});
    }
  }
  const LogNormalizer<double> r = log_normalizer(st);
  norm[n * 2] = r.max;
  norm[n * 2 + 1] = r.log_sum;
}

// Each id's entry of the chunk [c0, c0 + cols) (divergence/topk_rows.h): float32 chunks add the sparse term to
// the dense entry the gradient pass wrote; 16-bit chunks get id_dense + sparse. Repeated
// occurrences of an id carry id -1 and are skipped, so every entry has one writer.
template <typename T>
__global__ void write_id_entries_kernel(const int64_t* __restrict__ write_ids, const float* __restrict__ sparse,
                                        const float* __restrict__ id_dense, int64_t entries, int64_t k, int64_t c0,
                                        int64_t cols, T* __restrict__ dz, int64_t ld) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= entries) return;
  const int64_t v = write_ids[i] - c0;
  if (v < 0 || v >= cols) return;
  T* entry = dz + (i / k) * ld + v;
  if constexpr (std::is_same_v<T, float>) {
    *entry += sparse[i];
  } else {
    *entry = from_acc<T, float>(id_dense[i] + sparse[i]);
  }
}

// normalize="topk", dxs[n] = sum_k coef[n, k] ws[id_k] (divergence/topk_rows.h): one block per token, each
// thread a run of kPerLoad hidden entries (16-byte loads where the rows allow), ids in order.
template <typename T>
__global__ void __launch_bounds__(kGatherThreads)
    sparse_dxs_kernel(const T* __restrict__ ws, int64_t ld_w, const int64_t* __restrict__ ids,
                      const float* __restrict__ coef, int64_t k, int64_t hidden, bool vectorized,
                      T* __restrict__ dxs) {
  constexpr int kPerLoad = 16 / sizeof(T);
  const int64_t n = blockIdx.x;
  const int step = vectorized ? kPerLoad : 1;
  for (int64_t d0 = int64_t(threadIdx.x) * step; d0 < hidden; d0 += int64_t(kGatherThreads) * step) {
    float acc[kPerLoad] = {};
    for (int64_t j = 0; j < k; ++j) {
      const int64_t id = ids[n * k + j];
      if (id < 0) continue;  // a repeated occurrence: its term is in the first one's
      const float c = coef[n * k + j];
      const T* w = ws + id * ld_w + d0;
      if (vectorized) {
        const uint4 wv = *reinterpret_cast<const uint4*>(w);
        const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
        for (int e = 0; e < kPerLoad; ++e) acc[e] = fmaf(c, to_acc<float>(we[e]), acc[e]);
      } else {
        acc[0] = fmaf(c, to_acc<float>(w[0]), acc[0]);
      }
    }
    T* out = dxs + n * hidden + d0;
    if (vectorized) {
#pragma unroll
      for (int e = 0; e < kPerLoad; ++e) out[e] = from_acc<T, float>(acc[e]);
    } else {
      out[0] = from_acc<T, float>(acc[0]);
    }
  }
}

// normalize="topk", dws[v] = sum of coef * xs[n] and dbias[v] = sum of coef over the pairs of id v
// (either output may be nullptr): one warp per position of the sorted ids; the warp at the start of
// an id's run sums the run (in sorted order: deterministic) and writes the row once. Rows of no id
// stay as zeroed.
template <typename T>
__global__ void __launch_bounds__(kGatherThreads)
    sparse_dws_kernel(const T* __restrict__ xs, int64_t ld_x, const int64_t* __restrict__ sorted_ids,
                      const int64_t* __restrict__ order, const float* __restrict__ coef, int64_t entries,
                      int64_t k, int64_t hidden, bool vectorized, T* __restrict__ dws, int64_t ld_w,
                      float* __restrict__ dbias) {
  constexpr int kPerLoad = 16 / sizeof(T);
  const int64_t pos = int64_t(blockIdx.x) * (kGatherThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (pos >= entries) return;
  const int64_t v = sorted_ids[pos];
  if (v < 0 || (pos > 0 && sorted_ids[pos - 1] == v)) return;  // not the start of an id's run
  if (dbias != nullptr && lane == 0) {
    float sum = 0.f;
    for (int64_t q = pos; q < entries && sorted_ids[q] == v; ++q) sum += coef[order[q]];
    dbias[v] = sum;
  }
  if (dws == nullptr) return;
  const int step = vectorized ? kPerLoad : 1;
  for (int64_t d0 = int64_t(lane) * step; d0 < hidden; d0 += 32 * step) {
    float acc[kPerLoad] = {};
    for (int64_t q = pos; q < entries && sorted_ids[q] == v; ++q) {
      const int64_t flat = order[q];
      const float c = coef[flat];
      const T* x = xs + (flat / k) * ld_x + d0;
      if (vectorized) {
        const uint4 xv = *reinterpret_cast<const uint4*>(x);
        const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
        for (int e = 0; e < kPerLoad; ++e) acc[e] = fmaf(c, to_acc<float>(xe[e]), acc[e]);
      } else {
        acc[0] = fmaf(c, to_acc<float>(x[0]), acc[0]);
      }
    }
    T* out = dws + v * ld_w + d0;
    if (vectorized) {
#pragma unroll
      for (int e = 0; e < kPerLoad; ++e) out[e] = from_acc<T, float>(acc[e]);
    } else {
      out[0] = from_acc<T, float>(acc[0]);
    }
  }
}

bool gather_vectorizable(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * t.element_size()) % 16 == 0 &&
         (t.size(1) * t.element_size()) % 16 == 0;
}

struct Inputs {
  at::Tensor xs, ws;
  c10::optional<at::Tensor> labels, bias;
  at::Tensor ids, logprobs;  // ids in [0, V) (guard_topk_ids)
};

c10::optional<at::Tensor> contiguous_or_none(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? c10::optional<at::Tensor>(t->contiguous()) : c10::nullopt;
}

Inputs prepare(const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& ids, const at::Tensor& logprobs,
               const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias, const TopKParams& p) {
  TORCH_CHECK(xs.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  const GuardedTopK teacher = guard_topk_ids(ids, logprobs, p.vocab_size);
  return {unit_stride_rows(xs), unit_stride_rows(ws), contiguous_or_none(labels), contiguous_or_none(bias),
          teacher.ids.contiguous(), teacher.logprobs};
}

at::Tensor gather_logits(const Inputs& in, const TopKParams& p) {
  at::Tensor z = at::empty({p.num_rows, p.k}, in.xs.options().dtype(at::kFloat));
  if (p.num_rows == 0) return z;
  const bool vectorized = gather_vectorizable(in.xs) && gather_vectorizable(in.ws);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  NITROBREW_DISPATCH_CUDA_FLOATS(in.xs.scalar_type(), "nitrobrew_gather_logits",
    gather_logits_kernel<T><<<static_cast<unsigned>(p.num_rows), kGatherThreads, 0, stream>>>(
        reinterpret_cast<const T*>(in.xs.data_ptr()), in.xs.stride(0), reinterpret_cast<const T*>(in.ws.data_ptr()),
        in.ws.stride(0), in.ids.data_ptr<int64_t>(), p.k, p.hidden, vectorized, z.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  );
  return model_logits_at_ids(z, in.ids, in.bias.has_value() ? in.bias->to(at::kFloat) : at::Tensor(), p.logit_scale);
}

// normalize="full": one pass over the tiles of xs . ws^T gives the student's logits at the ids
// [N, K] (float32; zeros in masked rows) and its log-normalizer [N, 2] (float64, (max, log-sum)).
std::tuple<at::Tensor, at::Tensor> student_logits_and_log_normalizer(const Inputs& in, const TopKParams& p) {
  const StudentPasses passes(in.xs, in.ws, in.labels, in.bias, p);
  const auto options = in.xs.options().dtype(at::kDouble);
  at::Tensor partial = at::empty({passes.forward_splits(), p.num_rows, 2}, options);
  at::Tensor norm = at::empty({p.num_rows, 2}, options);
  at::Tensor z = at::zeros({p.num_rows, p.k}, in.xs.options().dtype(at::kFloat));
  if (p.num_rows == 0) return {z, norm};
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto [sorted, order] = at::sort(in.ids, /*stable=*/c10::optional<bool>(true), /*dim=*/1, /*descending=*/false);
  const at::Tensor sorted_ids = sorted.contiguous(), id_order = order.contiguous();
  const int blocks = static_cast<int>((p.num_rows + 255) / 256);
  passes.student_norm_pass(partial, sorted_ids, id_order, z);
  merge_norm_kernel<<<blocks, 256, 0, stream>>>(partial.data_ptr<double>(), passes.forward_splits(), p.num_rows,
                                                in.labels.has_value() ? in.labels->data_ptr<int64_t>() : nullptr,
                                                p.ignore_index, norm.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {z, norm};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> sparse_backward(const Inputs& in, const TopKGradTerms& terms,
                                                               const at::Tensor& grad_loss, const TopKParams& p,
                                                               bool compute_dxs, bool compute_dws,
                                                               bool compute_dbias) {
  const TopKSparseGrad sparse = topk_sparse_grad(terms, grad_loss, at::kFloat);
  const at::Tensor write_ids = terms.write_ids.contiguous();
  const bool vectorized = gather_vectorizable(in.xs) && gather_vectorizable(in.ws);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor dxs = at::empty({0}, in.xs.options()), dws = at::empty({0}, in.ws.options());
  at::Tensor dbias = at::empty({0}, in.ws.options());
  if (compute_dxs) dxs = at::empty({p.num_rows, p.hidden}, in.xs.options());
  if (compute_dws) dws = at::zeros(in.ws.sizes(), in.ws.options());
  if (compute_dbias) dbias = at::zeros({in.ws.size(0)}, in.ws.options().dtype(at::kFloat));
  const int64_t entries = p.num_rows * p.k;
  if (p.num_rows == 0) return {dxs, dws, dbias.to(in.ws.scalar_type())};
  NITROBREW_DISPATCH_CUDA_FLOATS(in.xs.scalar_type(), "nitrobrew_topk_sparse_grads",
    if (compute_dxs) {
      sparse_dxs_kernel<T><<<static_cast<unsigned>(p.num_rows), kGatherThreads, 0, stream>>>(
          reinterpret_cast<const T*>(in.ws.data_ptr()), in.ws.stride(0), write_ids.data_ptr<int64_t>(),
          sparse.coef.data_ptr<float>(), p.k, p.hidden, vectorized, reinterpret_cast<T*>(dxs.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (compute_dws || compute_dbias) {
      constexpr int kWarps = kGatherThreads / 32;
      sparse_dws_kernel<T><<<static_cast<unsigned>((entries + kWarps - 1) / kWarps), kGatherThreads, 0, stream>>>(
          reinterpret_cast<const T*>(in.xs.data_ptr()), in.xs.stride(0), sparse.sorted_ids.data_ptr<int64_t>(),
          sparse.order.data_ptr<int64_t>(), sparse.coef.data_ptr<float>(), entries, p.k, p.hidden, vectorized,
          compute_dws ? reinterpret_cast<T*>(dws.data_ptr()) : nullptr, compute_dws ? dws.stride(0) : 0,
          compute_dbias ? dbias.data_ptr<float>() : nullptr);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  );
  return {dxs, dws, dbias.to(in.ws.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor> topk_linear_fwd_cuda(const at::Tensor& xs_in, const at::Tensor& ws_in,
                                                        const at::Tensor& teacher_ids,
                                                        const at::Tensor& teacher_logprobs,
                                                        const c10::optional<at::Tensor>& labels_in,
                                                        const c10::optional<at::Tensor>& bias_s, int64_t ignore_index,
                                                        double temperature, double logit_scale_s, bool renormalize,
                                                        int64_t chunk_v, c10::string_view divergence, double beta) {
  // The ATen calls below (products, row math) compute in the op's precision even under autocast.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const TopKParams p = make_topk_linear_params(xs_in, ws_in, teacher_ids, teacher_logprobs, labels_in, bias_s,
                                               ignore_index, temperature, logit_scale_s, renormalize, chunk_v,
                                               divergence, beta, /*check_ids_on_host=*/false);
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const Inputs in = prepare(xs_in, ws_in, teacher_ids, teacher_logprobs, labels_in, bias_s, p);
  at::Tensor z, norm;
  if (renormalize) {
    z = gather_logits(in, p);
  } else {
    std::tie(z, norm) = student_logits_and_log_normalizer(in, p);
  }
  auto [loss, stats] =
      topk_rows_forward(z, norm, in.logprobs, topk_valid_rows(in.labels, p, in.xs), p, at::kFloat);
  return {loss.to(at::kFloat), stats};
}

// The gradients of dLoss/d(scale * (xs . ws^T + bias)): the scale's factor rides on the upstream gradient.
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_linear_bwd_cuda(
    const at::Tensor& grad_loss_in, const at::Tensor& xs_in, const at::Tensor& ws_in, const at::Tensor& teacher_ids,
    const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels_in,
    const c10::optional<at::Tensor>& bias_s, const at::Tensor& row_stats, int64_t ignore_index, double temperature,
    double logit_scale_s, bool renormalize, int64_t chunk_v, c10::string_view divergence, double beta,
    bool compute_dxs, bool compute_dws, bool compute_dbias_s) {
  // The ATen calls below (products, row math) compute in the op's precision even under autocast.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const TopKParams p = make_topk_linear_params(xs_in, ws_in, teacher_ids, teacher_logprobs, labels_in, bias_s,
                                               ignore_index, temperature, logit_scale_s, renormalize, chunk_v,
                                               divergence, beta, /*check_ids_on_host=*/false);
  check_topk_backward_inputs(grad_loss_in, row_stats, kTopKLogitsColumn + p.k, p, xs_in.device());
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const Inputs in = prepare(xs_in, ws_in, teacher_ids, teacher_logprobs, labels_in, bias_s, p);
  const bool compute_dbias = compute_dbias_s && in.bias.has_value();
  const at::Tensor grad_loss = p.logit_scale == 1.0 ? grad_loss_in : grad_loss_in * p.logit_scale;
  const TopKGradTerms terms =
      topk_grad_terms(row_stats, in.ids, in.logprobs, topk_valid_rows(in.labels, p, in.xs), p, at::kFloat);
  const at::Tensor write_ids = terms.write_ids.contiguous();
  const at::Tensor sparse = terms.id_sparse.to(at::kFloat).contiguous(), id_dense = terms.id_dense.to(at::kFloat).contiguous();
  if (renormalize) return sparse_backward(in, terms, grad_loss, p, compute_dxs, compute_dws, compute_dbias);
  const StudentPasses passes(in.xs, in.ws, in.labels, in.bias, p);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t entries = p.num_rows * p.k;
  auto fill = [&](int64_t c0, int64_t cols, at::Tensor& dz) {
    passes.student_grad_pass(terms.grad_rows, c0, cols, dz);
    NITROBREW_DISPATCH_CUDA_FLOATS(dz.scalar_type(), "nitrobrew_write_id_entries",
      write_id_entries_kernel<T><<<static_cast<unsigned>((entries + 255) / 256), 256, 0, stream>>>(
          write_ids.data_ptr<int64_t>(), sparse.data_ptr<float>(), id_dense.data_ptr<float>(), entries, p.k, c0,
          cols, reinterpret_cast<T*>(dz.data_ptr()), dz.stride(0));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    );
  };
  const int64_t chunk_cols =
      passes.grad_chunk_cols(grad_chunk_cap(p.num_rows, in.xs.element_size(), p.vocab_size, p.chunk_v));
  return chunked_matrix_grads(grad_loss, in.xs, in.ws, p.vocab_size, chunk_cols, compute_dxs, compute_dws,
                              compute_dbias, fill);
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("topk_linear_fwd", &topk_linear_fwd_cuda);
  m.impl("topk_linear_bwd", &topk_linear_bwd_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
