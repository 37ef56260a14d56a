// CUDA implementation of topk_logprobs: token chunks of float32 logits from cuBLAS (products_f32), each
// then read once by topk_rows_kernel (topk_rows_kernel.cuh), a block per row.
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
#include "topk_logprobs_params.h"
#include "topk_rows_kernel.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int64_t kChunkBytes = int64_t(512) << 20;  // the float32 products of a chunk of rows

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
  TORCH_CHECK(vocab <= INT32_MAX - topk_rows::kRound, "nitrobrew.topk_logprobs: vocab_size must be at most 2^31 - 1 - ",
              topk_rows::kRound, " on CUDA (the row kernel's ids are 32-bit), got ", vocab);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor logprobs = at::empty({n, k}, f32);
  at::Tensor ids = at::empty({n, k}, x.options().dtype(at::kLong));
  at::Tensor stats = at::empty({n, kNumTopKLogprobsStats}, f32);
  if (n == 0) return {logprobs, ids, stats};
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t rows = std::max<int64_t>(1, std::min(n, kChunkBytes / (4 * ld)));
  at::Tensor z = at::empty({rows, ld}, f32);
  // The row kernel's 16-byte loads reach into the padding past the vocabulary, which cuBLAS never writes:
  // zeroed once, so that no uninitialized memory is read (the entries themselves are skipped).
  if (ld > vocab) z.narrow(1, vocab, ld - vocab).zero_();
  TopKRowArgs a;
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
    launch_topk_rows(a, count, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {logprobs, ids, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("topk_logprobs", &topk_logprobs_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
