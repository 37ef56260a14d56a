// CPU implementation of nitrobrew::products (registration.cpp) and the stored products of the training
// path's chunk steps (products.h).
#include "products.h"

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <algorithm>

namespace nitrobrew {
namespace cpu {

void store_products(const at::Tensor& x_acc, const at::Tensor& w, at::Tensor& z, int64_t vocab_tile) {
  // (mm_out, which torch.autocast leaves alone: the products stay in the accumulation dtype under it.)
  const int64_t vocab = z.size(1);
  if (w.scalar_type() == x_acc.scalar_type()) {  // nothing to convert: one product, straight into z
    at::mm_out(z, x_acc, w.narrow(0, 0, vocab).t());
    return;
  }
  at::Tensor tile = at::empty({z.size(0), std::min(vocab_tile, vocab)}, z.options());
  for (int64_t v0 = 0; v0 < vocab; v0 += vocab_tile) {
    const int64_t cols = std::min(vocab_tile, vocab - v0);
    at::Tensor out = tile.narrow(1, 0, cols);
    at::mm_out(out, x_acc, w.narrow(0, v0, cols).to(x_acc.scalar_type()).t());
    z.narrow(1, v0, cols).copy_(out);
  }
}

namespace {

constexpr int64_t kVocabTile = 1024;      // rows of w converted at a time
constexpr int64_t kRowStrideAlign = 8;  // as on CUDA

at::Tensor products_cpu(const at::Tensor& x, const at::Tensor& w, int64_t vocab_size) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x must be [N, D] and w [V, D], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(vocab_size >= 0 && vocab_size <= w.size(0), "vocab_size must be in [0, ", w.size(0), "], got ",
              vocab_size);
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && at::isFloatingType(x.scalar_type()),
              "x and w must share one floating dtype, got ", x.scalar_type(), " and ", w.scalar_type());
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t ld = (vocab_size + kRowStrideAlign - 1) / kRowStrideAlign * kRowStrideAlign;
  at::Tensor z = at::empty({x.size(0), ld}, x.options().dtype(acc)).narrow(1, 0, vocab_size);
  if (x.size(0) > 0 && vocab_size > 0) {
    store_products(x.to(acc).contiguous(), w, z, kVocabTile);
  }
  return z;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) { m.impl("products", &products_cpu); }

}  // namespace cpu
}  // namespace nitrobrew
