// CUDA implementation of topk_logprobs, two paths (docs/notes/topk_logprobs.md):
//  - the walk (16-bit inputs, k <= 32, a vocabulary of 8192 at least): a cuBLAS product of an evenly spaced sample of the
//    vocabulary, read by the row kernel, gives each row a threshold tau, its sample's k-th largest logit, which at
//    least k of the row's logits reach; one vocabulary walk (topk_walk_pass.cuh) then folds the tiles into the rows' sums and keeps the
//    entries at or above tau (~k V / sample of them a row); a block per row selects the k best
//    (topk_candidates_kernel.cuh). A row whose list came out short of k, past its capacity, or with non-finite sums
//    is redone by the row path (so each row's answer is exact for the logits of the path that served it; the two
//    paths' products round differently in the last bits). No [N, V] products are stored. The flags are read on the
//    host once a call, so a stream being captured into a CUDA graph takes the row path, which reads nothing back.
//  - the row path (float32 inputs, k > 32, and the walk's flagged rows): token chunks of float32 logits from
//    cuBLAS (products_f32), each read once by topk_rows_kernel (topk_rows_kernel.cuh), a block per row.
// Memory beyond the outputs: one chunk of float32 products (the row path) or of sample products and candidate
// lists (the walk), at most kChunkBytes; on the walk also the sample's rows of w (2048 x D) and the splits' sums
// (24 bytes a row and split).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>

#include "../engine/cuda/cublas_gemm.h"
#include "../engine/cuda/vocab_walk.h"
#include "topk_candidates_kernel.cuh"
#include "topk_logprobs_params.h"
#include "topk_rows_kernel.cuh"
#include "topk_walk_launch.h"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int64_t kChunkBytes = int64_t(512) << 20;

// The walk's sample and each row's list capacity. A row's threshold is the sample's k-th largest logit, which
// ranks ~k V / sample in the row (the sample's columns spread over the vocabulary), so the list holds that many
// entries; the capacity is twice it plus 1024. The sample is 64 k columns, at least 2048: at k <= 32 (the walk's
// default range) 2048 columns, a product 1.3% of the whole on a 152k vocabulary, and ~V / 64 entries a row at k = 32.
struct WalkPlan {
  int64_t sample, cap;
};

WalkPlan walk_plan(int64_t k, int64_t vocab) {
  const int64_t sample = std::min(vocab, std::max<int64_t>(2048, 64 * k));
  const int64_t expected = (k * vocab + sample - 1) / sample;
  return {sample, (2 * expected + 1024 + 63) / 64 * 64};
}

// Whether the walk serves these inputs, and its plan: 16-bit inputs (the walk would multiply float32 ones on CUDA
// cores; not timed against the row path's cuBLAS products), k <= kWalkMaxK, and a vocabulary of four samples at
// least. At k = 128 and 256 (samples of 8192 and 16384 columns, 5-11% of the product, and longer lists) the row path
// was faster (H100, 2026-12-07; docs/notes/topk_logprobs.md). A development build's NITROBREW_TOPK_LOGPROBS_WALK
// overrides: "off", or "SAMPLE:CAP" to force the walk, float32 inputs included, with that sample and capacity
// (docs/development.md).
constexpr int64_t kWalkMaxK = 32;

bool use_walk(const at::Tensor& x, int64_t k, int64_t vocab, WalkPlan& plan) {
  plan = walk_plan(k, vocab);
  bool use = (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) && k <= kWalkMaxK &&
             4 * plan.sample <= vocab;
#ifdef NITROBREW_DEV_KNOBS
  if (const char* env = std::getenv("NITROBREW_TOPK_LOGPROBS_WALK")) {
    long long sample = 0, cap = 0;
    if (std::strcmp(env, "off") == 0) {
      use = false;
    } else if (std::sscanf(env, "%lld:%lld", &sample, &cap) == 2 && sample > 0 && cap > 0) {
      use = true;
      plan = {std::min<int64_t>(std::max<int64_t>(sample, k), vocab), cap};  // the sample holds k at least
    }
  }
#endif
  return use;
}

// The row kernel's arguments over float32 products z [rows, ld] of `vocab` columns (its padding zeroed), the
// model's transform with bias_f (float32, or undefined); the outputs left to the caller.
TopKRowArgs row_args(const TopKLogprobsParams& p, const at::Tensor& z, int64_t vocab, const at::Tensor& bias_f) {
  TopKRowArgs a{};
  a.z = z.data_ptr<float>();
  a.ld = z.size(1);
  a.vocab = vocab;
  a.bias = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  a.scale = static_cast<float>(p.logit_scale);
  a.cap = static_cast<float>(p.softcap);
  a.inv_t = static_cast<float>(p.inv_temperature);
  a.k = static_cast<int>(p.k);
  return a;
}

// The row path over rows of x into the outputs' rows.
void row_path(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias_f, const TopKLogprobsParams& p,
              int64_t k, at::Tensor& logprobs, at::Tensor& ids, at::Tensor& stats) {
  const int64_t n = x.size(0), vocab = p.vocab_size, ld = (vocab + 7) / 8 * 8;
  if (n == 0) return;
  const int64_t rows = std::max<int64_t>(1, std::min(n, kChunkBytes / (4 * ld)));
  at::Tensor z = at::empty({rows, ld}, x.options().dtype(at::kFloat));
  // The row kernel's 16-byte loads reach into the padding past the vocabulary, which cuBLAS never writes:
  // zeroed once, so that no uninitialized memory is read (the entries themselves are skipped).
  if (ld > vocab) z.narrow(1, vocab, ld - vocab).zero_();
  TopKRowArgs a = row_args(p, z, vocab, bias_f);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t count = std::min(rows, n - r0);
    products_f32(x.narrow(0, r0, count), w, vocab, z.data_ptr<float>(), ld);
    a.logprobs = logprobs.data_ptr<float>() + r0 * k;
    a.ids = ids.data_ptr<int64_t>() + r0 * k;
    a.stats = stats.data_ptr<float>() + r0 * kNumTopKLogprobsStats;
    launch_topk_rows(a, count, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// Each row's threshold tau [rows]: the k-th largest of its logits (over the temperature) at the sample's columns,
// by the row kernel over their float32 products ([rows, ld_sample] in z, its padding zeroed). At least k of the
// row's logits reach it; NaN for a row without a distribution, -inf where fewer than k sample logits exceed -inf.
at::Tensor thresholds(const at::Tensor& x, const at::Tensor& w_sample, const at::Tensor& bias_sample,
                      const TopKLogprobsParams& p, at::Tensor& z) {
  const int64_t rows = x.size(0), sample = w_sample.size(0), k = p.k;
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor tau = at::empty({rows}, f32), lp = at::empty({rows, k}, f32);
  at::Tensor st = at::empty({rows, kNumTopKLogprobsStats}, f32);
  at::Tensor ids = at::empty({rows, k}, x.options().dtype(at::kLong));
  products_f32(x, w_sample, sample, z.data_ptr<float>(), z.size(1));
  TopKRowArgs a = row_args(p, z, sample, bias_sample);
  a.logprobs = lp.data_ptr<float>();
  a.ids = ids.data_ptr<int64_t>();
  a.stats = st.data_ptr<float>();
  a.kth = tau.data_ptr<float>();
  launch_topk_rows(a, rows, c10::cuda::getCurrentCUDAStream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return tau;
}

// The walk path over all rows; returns the flags [n] (uint8) of the rows left to the row path.
at::Tensor walk_path(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                     const TopKLogprobsParams& p, const WalkPlan& plan, at::Tensor& logprobs, at::Tensor& ids,
                     at::Tensor& stats) {
  const int64_t n = x.size(0), k = p.k, vocab = p.vocab_size;
  at::Tensor fallback = at::zeros({n}, x.options().dtype(at::kByte));
  const at::Tensor columns =
      at::arange(plan.sample, x.options().dtype(at::kLong)).mul_(vocab).div_(plan.sample, "floor");
  const at::Tensor w_sample = w.index_select(0, columns);
  const at::Tensor bias_sample =
      bias.has_value() ? bias->index_select(0, columns).to(at::kFloat).contiguous() : at::Tensor();
  // Rows a chunk: its sample products and lists within kChunkBytes (beside them the sums, 24 bytes a row and
  // split, are small), the chunks of equal size.
  const int64_t ld_sample = (plan.sample + 7) / 8 * 8;
  const int64_t row_bytes = 4 * ld_sample + 8 * plan.cap + 8;
  const int64_t max_rows = std::max<int64_t>(1, kChunkBytes / row_bytes);
  const int64_t chunks = (n + max_rows - 1) / max_rows, rows = (n + chunks - 1) / chunks;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor keys = at::empty({rows, plan.cap}, x.options().dtype(at::kLong));
  at::Tensor count = at::empty({rows}, x.options().dtype(at::kInt));
  at::Tensor z_sample = at::empty({rows, ld_sample}, x.options().dtype(at::kFloat));
  // The row kernel's 16-byte loads reach into the padding, which cuBLAS never writes (row_path).
  if (ld_sample > plan.sample) z_sample.narrow(1, plan.sample, ld_sample - plan.sample).zero_();
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t m = std::min(rows, n - r0);
    const at::Tensor xm = x.narrow(0, r0, m);
    at::Tensor z_m = z_sample.narrow(0, 0, m);
    const at::Tensor tau = thresholds(xm, w_sample, bias_sample, p, z_m);  // NaN: no entry reaches it
    const TopKWalk walk(xm, w, bias, p);
    at::Tensor partial = at::empty({walk.splits(), m, kNumTopKWalkSums}, x.options().dtype(at::kDouble));
    at::Tensor count_m = count.narrow(0, 0, m).zero_();
    at::Tensor keys_m = keys.narrow(0, 0, m);
    walk.run(partial, tau, count_m, keys_m);
    TopKCandidateArgs a;
    a.partial = partial.data_ptr<double>();
    a.splits = walk.splits();
    a.rows = m;
    a.count = count_m.data_ptr<int32_t>();
    a.keys = reinterpret_cast<const uint64_t*>(keys_m.data_ptr<int64_t>());
    a.cap = plan.cap;
    a.k = static_cast<int>(k);
    a.logprobs = logprobs.data_ptr<float>() + r0 * k;
    a.ids = ids.data_ptr<int64_t>() + r0 * k;
    a.stats = stats.data_ptr<float>() + r0 * kNumTopKLogprobsStats;
    a.fallback = fallback.data_ptr<uint8_t>() + r0;
    launch_topk_candidates(a, stream);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return fallback;
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
  const int64_t n = p.num_rows, vocab = p.vocab_size;
  TORCH_CHECK(vocab <= INT32_MAX - topk_rows::kRound, "nitrobrew.topk_logprobs: vocab_size must be at most 2^31 - 1 - ",
              topk_rows::kRound, " on CUDA (the row kernel's ids are 32-bit), got ", vocab);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor logprobs = at::empty({n, k}, f32);
  at::Tensor ids = at::empty({n, k}, x.options().dtype(at::kLong));
  at::Tensor stats = at::empty({n, kNumTopKLogprobsStats}, f32);
  if (n == 0) return {logprobs, ids, stats};
  const at::Tensor xc = unit_stride_rows(x), wc = w.contiguous();
  const at::Tensor bias_f = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  WalkPlan plan;
  const bool capturing = c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
  if (capturing || !use_walk(xc, k, vocab, plan)) {
    row_path(xc, wc, bias_f, p, k, logprobs, ids, stats);
    return {logprobs, ids, stats};
  }
  const c10::optional<at::Tensor> bias_c =
      bias.has_value() ? c10::optional<at::Tensor>(bias->contiguous()) : c10::nullopt;
  const at::Tensor flagged = walk_path(xc, wc, bias_c, p, plan, logprobs, ids, stats).nonzero().squeeze(1);
  if (flagged.numel() > 0) {  // one host read: the rows whose lists did not hold their k best
    at::Tensor lp = at::empty({flagged.numel(), k}, f32), id = at::empty({flagged.numel(), k}, ids.options());
    at::Tensor st = at::empty({flagged.numel(), kNumTopKLogprobsStats}, f32);
    row_path(xc.index_select(0, flagged), wc, bias_f, p, k, lp, id, st);
    logprobs.index_copy_(0, flagged, lp);
    ids.index_copy_(0, flagged, id);
    stats.index_copy_(0, flagged, st);
  }
  return {logprobs, ids, stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("topk_logprobs", &topk_logprobs_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
