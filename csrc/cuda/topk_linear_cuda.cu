// CUDA ops of the top-K teacher loss from hidden states (nitrobrew.topk_kl); the algorithm and the
// per-row math are the CPU op's (csrc/cpu/topk_linear_cpu.cpp, csrc/topk_rows.h).
//   forward:  gather_logits_kernel forms the K student logits z_{id_k} = xs[n] . ws[id_k] (float32
//             sums of the gathered rows); for normalize="full" the fused-linear kernels' student-only
//             pass (StudentNormPass) folds every tile of xs . ws^T into a softmax state per row and
//             vocabulary split (float64 sums), merged by merge_norm_kernel; the per-row terms are
//             [N, K] ATen ops.
//   backward: per vocabulary chunk (chunked_grads.h), StudentGradPass recomputes the tiles and
//             writes the dense part of dLoss/dz, write_id_entries_kernel the K ids' entries, and
//             cuBLAS forms dxs and dws from the chunk.
// Ids outside [0, V) stop the gather with a device-side assertion (a host check would synchronize).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <tuple>

#include "../topk_rows.h"
#include "chunked_grads.h"
#include "fused_linear_common.cuh"
#include "row_kernels.cuh"
#include "student_passes.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int kGatherThreads = 256;

// One block per row; each warp takes every 8th of the row's K ids and reduces xs[n] . ws[id] over
// the hidden dimension, in 16-byte loads where both rows allow them.
template <typename T>
__global__ void __launch_bounds__(kGatherThreads)
    gather_logits_kernel(const T* __restrict__ xs, int64_t ld_x, const T* __restrict__ ws, int64_t ld_w,
                         const int64_t* __restrict__ ids, int64_t k, int64_t hidden, int64_t vocab, bool vectorized,
                         float* __restrict__ out) {
  constexpr int kPerLoad = 16 / sizeof(T);
  const int64_t n = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* x = xs + n * ld_x;
  for (int64_t j = warp; j < k; j += kGatherThreads / 32) {
    const int64_t id = ids[n * k + j];
    CUDA_KERNEL_ASSERT(id >= 0 && id < vocab && "teacher_ids must be in [0, V)");
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

// Each id's entry of the chunk [c0, c0 + cols) (topk_rows.h): float32 chunks add the sparse term to
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

bool gather_vectorizable(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * t.element_size()) % 16 == 0 &&
         (t.size(1) * t.element_size()) % 16 == 0;
}

// The fused-linear kernels' options for the student-only passes: student = teacher = (xs, ws).
FusedLinearParams student_pass_params(const TopKParams& p, bool has_labels) {
  FusedLinearParams f{};
  f.kind = LossKind::kForwardKL;
  f.beta = 0.0;
  f.inv_temperature = p.inv_temperature;
  f.ignore_index = p.ignore_index;
  f.num_rows = p.num_rows;
  f.hidden_s = f.hidden_t = p.hidden;
  f.vocab_size = p.vocab_size;
  f.chunk_v = p.chunk_v;
  f.has_labels = has_labels;
  return f;
}

struct Inputs {
  at::Tensor xs, ws;
  c10::optional<at::Tensor> labels;
  at::Tensor ids;
};

Inputs prepare(const at::Tensor& xs, const at::Tensor& ws, const at::Tensor& ids,
               const c10::optional<at::Tensor>& labels) {
  TORCH_CHECK(xs.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  return {unit_stride_rows(xs), unit_stride_rows(ws),
          labels.has_value() ? c10::optional<at::Tensor>(labels->contiguous()) : c10::nullopt, ids.contiguous()};
}

at::Tensor gather_logits(const Inputs& in, const TopKParams& p) {
  at::Tensor z = at::empty({p.num_rows, p.k}, in.xs.options().dtype(at::kFloat));
  if (p.num_rows == 0) return z;
  const bool vectorized = gather_vectorizable(in.xs) && gather_vectorizable(in.ws);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in.xs.scalar_type(), "nitrobrew_gather_logits", [&] {
    using T = cuda_type_t<scalar_t>;
    if constexpr (!std::is_same_v<T, double>) {
      gather_logits_kernel<T><<<static_cast<unsigned>(p.num_rows), kGatherThreads, 0, stream>>>(
          reinterpret_cast<const T*>(in.xs.data_ptr()), in.xs.stride(0), reinterpret_cast<const T*>(in.ws.data_ptr()),
          in.ws.stride(0), in.ids.data_ptr<int64_t>(), p.k, p.hidden, p.vocab_size, vectorized, z.data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return z;
}

at::Tensor student_log_normalizer(const Inputs& in, const TopKParams& p) {
  const LogitTilePasses passes(in.xs, in.xs, in.ws, in.ws, in.labels, student_pass_params(p, in.labels.has_value()));
  const auto options = in.xs.options().dtype(at::kDouble);
  at::Tensor partial = at::empty({passes.forward_splits(), p.num_rows, 2}, options);
  at::Tensor norm = at::empty({p.num_rows, 2}, options);
  if (p.num_rows == 0) return norm;
  passes.student_norm_pass(partial);
  const int blocks = static_cast<int>((p.num_rows + 255) / 256);
  merge_norm_kernel<<<blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
      partial.data_ptr<double>(), passes.forward_splits(), p.num_rows,
      in.labels.has_value() ? in.labels->data_ptr<int64_t>() : nullptr, p.ignore_index, norm.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return norm;
}

std::tuple<at::Tensor, at::Tensor> topk_linear_distill_fwd_cuda(const at::Tensor& xs_in, const at::Tensor& ws_in,
                                                               const at::Tensor& teacher_ids,
                                                               const at::Tensor& teacher_logprobs,
                                                               const c10::optional<at::Tensor>& labels_in,
                                                               int64_t ignore_index, double temperature,
                                                               bool renormalize, int64_t chunk_v) {
  // The ATen calls below (products, row math) compute in the op's precision even under autocast.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const TopKParams p = make_topk_linear_params(xs_in, ws_in, teacher_ids, teacher_logprobs, labels_in, ignore_index,
                                               temperature, renormalize, chunk_v, /*check_ids_on_host=*/false);
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const Inputs in = prepare(xs_in, ws_in, teacher_ids, labels_in);
  const at::Tensor z = gather_logits(in, p);
  const at::Tensor norm = renormalize ? at::Tensor() : student_log_normalizer(in, p);
  auto [loss, stats] =
      topk_rows_forward(z, norm, teacher_logprobs, topk_valid_rows(in.labels, p, in.xs), p, at::kFloat);
  return {loss.to(at::kFloat), stats};
}

std::tuple<at::Tensor, at::Tensor> topk_linear_distill_bwd_cuda(
    const at::Tensor& grad_loss, const at::Tensor& xs_in, const at::Tensor& ws_in, const at::Tensor& teacher_ids,
    const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels_in, const at::Tensor& row_stats,
    int64_t ignore_index, double temperature, bool renormalize, int64_t chunk_v, bool compute_dxs,
    bool compute_dws) {
  // The ATen calls below (products, row math) compute in the op's precision even under autocast.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const TopKParams p = make_topk_linear_params(xs_in, ws_in, teacher_ids, teacher_logprobs, labels_in, ignore_index,
                                               temperature, renormalize, chunk_v, /*check_ids_on_host=*/false);
  check_topk_backward_inputs(grad_loss, row_stats, kTopKLogitsColumn + p.k, p, xs_in.device());
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const Inputs in = prepare(xs_in, ws_in, teacher_ids, labels_in);
  const TopKGradTerms terms =
      topk_grad_terms(row_stats, in.ids, teacher_logprobs, topk_valid_rows(in.labels, p, in.xs), p, at::kFloat);
  const at::Tensor write_ids = terms.write_ids.contiguous();
  const at::Tensor sparse = terms.id_sparse.to(at::kFloat).contiguous(), id_dense = terms.id_dense.to(at::kFloat).contiguous();
  const LogitTilePasses passes(in.xs, in.xs, in.ws, in.ws, in.labels, student_pass_params(p, in.labels.has_value()));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t entries = p.num_rows * p.k;
  auto fill = [&](int64_t c0, int64_t cols, at::Tensor& dz) {
    if (renormalize) {
      dz.zero_();
    } else {
      passes.student_grad_pass(terms.grad_rows, c0, cols, dz);
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dz.scalar_type(), "nitrobrew_write_id_entries", [&] {
      using T = cuda_type_t<scalar_t>;
      if constexpr (!std::is_same_v<T, double>) {
        write_id_entries_kernel<T><<<static_cast<unsigned>((entries + 255) / 256), 256, 0, stream>>>(
            write_ids.data_ptr<int64_t>(), sparse.data_ptr<float>(), id_dense.data_ptr<float>(), entries, p.k, c0,
            cols, reinterpret_cast<T*>(dz.data_ptr()), dz.stride(0));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  };
  return chunked_matrix_grads(grad_loss, in.xs, in.ws, p.vocab_size, p.chunk_v, compute_dxs, compute_dws, fill);
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("topk_linear_distill_fwd", &topk_linear_distill_fwd_cuda);
  m.impl("topk_linear_distill_bwd", &topk_linear_distill_bwd_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
