// CUDA implementation of fused_linear_grad_chunk, the training path's step over a chunk of tokens
// (nitrobrew/_forward_grads.py): for every `product_rows` rows, cuBLAS forms both models' products in
// float32 (the logits' only rounding is the GEMM's, as in the kernels that never store them) and the
// row kernels (product_rows.cu) turn them into each row's loss and dLoss/dz. The caller then forms
// dxs, dws and dbias_s from dLoss/dz with cuBLAS: four products in all, none recomputed.
//
// Extra memory: the float32 products of `product_rows` rows of both models (8 bytes a column) and the
// chunk's dLoss/dz (the inputs' dtype), never O(N x V) beyond the chunk the caller chose.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>

#include "../engine/cuda/cublas_gemm.h"
#include "fused_linear_launch.h"
#include "fused_linear_params.h"
#include "fused_linear_product_rows.h"

namespace nitrobrew {
namespace cuda {
namespace {

// Row kernels overlapped with the next step's products (an experiment, development builds only:
// NITROBREW_ROW_OVERLAP=half|full; docs/notes/fused_linear_training_path.md). The row kernels are
// memory-bound and the products compute-bound, so the row kernels of step k run on a second stream while
// cuBLAS forms the products of step k + 1 into the other of two buffers. "half": two buffers of
// product_rows / 2 rows (the same memory as one step); "full": two of product_rows.
enum class RowOverlap { kNone, kHalf, kFull };

RowOverlap row_overlap() {
#ifdef NITROBREW_DEV_KNOBS
  if (const char* env = std::getenv("NITROBREW_ROW_OVERLAP"); env != nullptr) {
    if (std::strcmp(env, "half") == 0) return RowOverlap::kHalf;
    if (std::strcmp(env, "full") == 0) return RowOverlap::kFull;
    TORCH_CHECK(env[0] == '\0' || std::strcmp(env, "none") == 0,
                "NITROBREW_ROW_OVERLAP must be none, half or full, got ", env);
  }
#endif
  return RowOverlap::kNone;
}

// Makes `main` wait for all work queued on `side` when it goes out of scope, also while an exception unwinds:
// the tensors declared before it (the products, the outputs) go back to `main`'s pool only after the side
// stream's kernels that use them. Raw calls that warn rather than throw.
class JoinStreams {
 public:
  JoinStreams(cudaStream_t main, cudaStream_t side) : main_(main), side_(side) {}
  JoinStreams(const JoinStreams&) = delete;
  JoinStreams& operator=(const JoinStreams&) = delete;
  ~JoinStreams() {
    cudaEvent_t done;
    C10_CUDA_CHECK_WARN(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    C10_CUDA_CHECK_WARN(cudaEventRecord(done, side_));
    C10_CUDA_CHECK_WARN(cudaStreamWaitEvent(main_, done, 0));
    C10_CUDA_CHECK_WARN(cudaEventDestroy(done));  // released once the wait is satisfied
  }

 private:
  cudaStream_t main_, side_;
};

std::tuple<at::Tensor, at::Tensor> fused_linear_grad_chunk_cuda(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const at::Tensor& row_scale, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size,
    int64_t product_rows) {
  const DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence,
                                                   beta, temperature, ce_weight, softcap_s, softcap_t, logit_scale_s,
                                                   logit_scale_t, vocab_size, /*chunk_v=*/0);
  TORCH_CHECK(xs.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  TORCH_CHECK(row_scale.dim() == 0 && row_scale.scalar_type() == at::kFloat && row_scale.device() == xs.device(),
              "row_scale must be a float32 scalar tensor on ", xs.device(), ", got ", row_scale.scalar_type(), " ",
              row_scale.sizes(), " on ", row_scale.device());
  TORCH_CHECK(product_rows >= 1, "product_rows must be positive, got ", product_rows);
  const c10::cuda::CUDAGuard guard(xs.device());
  const FusedLinearOperands in = prepare_operands(xs, xt, ws, wt, labels, bias_s, bias_t);
  const int64_t n = p.num_rows, vocab = p.vocab_size, ld = product_row_stride(vocab);
  at::Tensor loss = at::zeros({n}, xs.options().dtype(at::kFloat));  // masked rows: 0
  at::Tensor grad = at::empty({n, ld}, xs.options()).narrow(1, 0, vocab);
  if (n == 0) return {loss, grad};
  const RowOverlap overlap = row_overlap();
  const int64_t step_rows = overlap == RowOverlap::kHalf ? std::max<int64_t>(1, product_rows / 2) : product_rows;
  const int64_t rows = std::min(step_rows, n);
  const int64_t buffers = overlap == RowOverlap::kNone || rows == n ? 1 : 2;
  // Both models' products of `rows` rows per buffer, reused by every step of the chunk.
  at::Tensor products = at::empty({buffers, 2, rows, ld}, xs.options().dtype(at::kFloat));
  const at::Tensor scale = row_scale.contiguous();
  const c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream();
  // With two buffers: the row kernels' stream (a pool stream, which other users of the pool may share:
  // a development knob), and per buffer the events "products written" (main -> rows) and "products read"
  // (rows -> main, before the buffer is written again). The rows' stream joins the main stream when `join`
  // goes out of scope, so every later use or free of these tensors on the main stream (and a CUDA graph's
  // capture) is ordered after it.
  std::optional<c10::cuda::CUDAStream> rows_stream;
  at::cuda::CUDAEvent written[2], read[2];
  bool read_pending[2] = {false, false};
  if (buffers == 2) rows_stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, xs.device().index());
  std::optional<JoinStreams> join;
  if (rows_stream) join.emplace(main.stream(), rows_stream->stream());
  float* const products_base = products.data_ptr<float>();
  for (int64_t r0 = 0, step = 0; r0 < n; r0 += rows, ++step) {
    const int64_t count = std::min(rows, n - r0), b = step % buffers;
    float* zs = products_base + 2 * b * rows * ld;
    float* zt = zs + rows * ld;
    if (read_pending[b]) read[b].block(main);
    products_f32(in.xs.narrow(0, r0, count), in.ws, vocab, zs, ld);
    products_f32(in.xt.narrow(0, r0, count), in.wt, vocab, zt, ld);
    ProductRowsLaunch l;
    l.zs = zs;
    l.zt = zt;
    l.ld = ld;
    l.rows = count;
    l.labels = in.labels.has_value() ? in.labels->data_ptr<int64_t>() + r0 : nullptr;
    l.bias_s = in.bias_s.has_value() ? in.bias_s->data_ptr() : nullptr;
    l.bias_t = in.bias_t.has_value() ? in.bias_t->data_ptr() : nullptr;
    l.row_scale = scale.data_ptr<float>();
    l.loss = loss.data_ptr<float>() + r0;
    l.grad = static_cast<char*>(grad.data_ptr()) + r0 * ld * grad.element_size();
    l.ld_grad = ld;
    if (!rows_stream) {
      launch_product_rows(l, p, xs.scalar_type());
      continue;
    }
    written[b].record(main);
    written[b].block(*rows_stream);
    {
      const c10::cuda::CUDAStreamGuard on_rows(*rows_stream);  // the kernels and their scratch on this stream
      launch_product_rows(l, p, xs.scalar_type());
    }
    read[b].record(*rows_stream);
    read_pending[b] = true;
  }
  return {loss, grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_grad_chunk", &fused_linear_grad_chunk_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
