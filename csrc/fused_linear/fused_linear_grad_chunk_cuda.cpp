// CUDA implementation of fused_linear_grad_chunk, the training path's step over a chunk of tokens
// (nitrobrew/_forward_grads.py): for every `product_rows` rows, cuBLAS forms both models' products in
// float32 (the logits' only rounding is the GEMM's, as in the kernels that never store them) and the
// row kernels (product_rows.cu) turn them into each row's loss and dLoss/dz. The caller then forms
// dxs, dws and dbias_s from dLoss/dz with cuBLAS: four products in all, none recomputed.
//
// Extra memory: the float32 products of `product_rows` rows of both models (8 bytes a column) and the
// chunk's dLoss/dz (the inputs' dtype), never O(N x V) beyond the chunk the caller chose.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "../engine/cuda/cublas_gemm.h"
#include "fused_linear_launch.h"
#include "fused_linear_params.h"
#include "fused_linear_product_rows.h"

namespace nitrobrew {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_linear_grad_chunk_cuda(
    const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
    const c10::optional<at::Tensor>& labels, const c10::optional<at::Tensor>& bias_s,
    const c10::optional<at::Tensor>& bias_t, const at::Tensor& row_scale, int64_t ignore_index,
    c10::string_view divergence, double beta, double temperature, double ce_weight, c10::optional<double> softcap_s,
    c10::optional<double> softcap_t, double logit_scale_s, double logit_scale_t, int64_t vocab_size,
    int64_t product_rows, bool entropy) {
  DistillParams p = make_fused_linear_params(xs, xt, ws, wt, labels, bias_s, bias_t, ignore_index, divergence, beta,
                                             temperature, ce_weight, softcap_s, softcap_t, logit_scale_s, logit_scale_t,
                                             vocab_size, /*chunk_v=*/0);
  p.entropy = entropy;
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
  at::Tensor row_entropy = at::zeros({entropy ? n : 0}, xs.options().dtype(at::kFloat));
  if (n == 0) return {loss, grad, row_entropy};
  const int64_t rows = std::min(product_rows, n);
  // Both models' products of `rows` rows, reused by every step of the chunk.
  at::Tensor products = at::empty({2, rows, ld}, xs.options().dtype(at::kFloat));
  const at::Tensor scale = row_scale.contiguous();
  float* const zs = products.data_ptr<float>();
  float* const zt = zs + rows * ld;
  for (int64_t r0 = 0; r0 < n; r0 += rows) {
    const int64_t count = std::min(rows, n - r0);
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
    l.entropy = entropy ? row_entropy.data_ptr<float>() + r0 : nullptr;
    launch_product_rows(l, p, xs.scalar_type());
  }
  return {loss, grad, row_entropy};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_grad_chunk", &fused_linear_grad_chunk_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
