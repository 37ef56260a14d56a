// The vocabulary-chunk loop of the CUDA backwards (chunked_grads.h): for each chunk the caller's
// pass writes dLoss/dz, and cuBLAS accumulates
//   dxs += dz_chunk . ws_chunk          (float32 accumulator, scaled by g per row at the end)
//   dws_chunk = dz_chunk^T . (g * xs)
//   dbias_chunk = dz_chunk^T . g
// Extra memory: the chunk ([N x chunk] in the inputs' dtype, at most kChunkBytes), the float32
// dxs accumulator and g * xs: never O(N x V).
#include "chunked_grads.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "cublas_gemm.h"
#include "vocab_walk.h"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int64_t kChunkBytes = int64_t(192) << 20;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

}  // namespace

int64_t grad_chunk_cap(int64_t n, int64_t elem, int64_t vocab_size, int64_t max_chunk_cols) {
  int64_t chunk = std::max<int64_t>(kGradChunkAlign,
                                    kChunkBytes / std::max<int64_t>(n * elem, 1) / kGradChunkAlign * kGradChunkAlign);
  if (max_chunk_cols > 0) chunk = std::min(chunk, round_up(max_chunk_cols, kGradChunkAlign));
  return std::min(chunk, round_up(std::max<int64_t>(vocab_size, 1), kGradChunkAlign));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> chunked_matrix_grads(const at::Tensor& grad_loss, const at::Tensor& xs,
                                                                    const at::Tensor& ws, int64_t vocab_size,
                                                                    int64_t chunk_cols, bool compute_dxs,
                                                                    bool compute_dws, bool compute_dbias,
                                                                    const FillGradChunk& fill) {
  const int64_t n = xs.size(0), hidden = xs.size(1), elem = xs.element_size();
  const auto dtype = xs.scalar_type();
  const at::Tensor g = grad_loss.to(at::kFloat).unsqueeze(1);  // [N, 1]
  at::Tensor dxs_acc, xs_scaled, dws;
  if (compute_dxs) dxs_acc = at::zeros({n, hidden}, xs.options().dtype(at::kFloat));
  if (compute_dws) {
    // g * xs, [N, D]: computed in float32 per element and written in the inputs' dtype, with no
    // float32 temporary of the whole matrix.
    xs_scaled = at::empty({n, hidden}, xs.options());
    at::mul_out(xs_scaled, xs, g);
    // Rows below vocab_size are written by the chunks' products; only padded rows past it (and
    // every row when there is no token) need zeros: no memset of the whole [V x D] matrix.
    dws = at::empty(ws.sizes(), ws.options());
    if (n == 0) {
      dws.zero_();
    } else if (ws.size(0) > vocab_size) {
      dws.narrow(0, vocab_size, ws.size(0) - vocab_size).zero_();
    }
  }
  at::Tensor g_low, dbias_acc;  // g in xs's dtype [N], the float32 bias gradient [V_rows]
  if (compute_dbias) {
    g_low = grad_loss.to(dtype).contiguous();
    dbias_acc = at::zeros({ws.size(0)}, xs.options().dtype(at::kFloat));
  }
  TORCH_CHECK(chunk_cols > 0 && chunk_cols % kGradChunkAlign == 0, "nitrobrew: bad backward chunk width ", chunk_cols);
  const int64_t chunk = std::min(chunk_cols, round_up(vocab_size, kGradChunkAlign));
  at::Tensor dz = at::empty({n, chunk}, xs.options());
  for (int64_t c0 = 0; n > 0 && (compute_dxs || compute_dws || compute_dbias) && c0 < vocab_size; c0 += chunk) {
    const int64_t cols = std::min(chunk, vocab_size - c0);
    fill(c0, cols, dz);
    if (compute_dxs) {  // dxs_acc^T [D x N] += ws_chunk^T [D x cols] . dz^T [cols x N]
      const void* ws_chunk = static_cast<const char*>(ws.data_ptr()) + c0 * ws.stride(0) * elem;
      gemm(false, false, hidden, n, cols, ws_chunk, ws.stride(0), dz.data_ptr(), chunk, dtype, 1.f, dxs_acc.data_ptr(),
           at::kFloat, hidden);
    }
    if (compute_dws) {  // dws_chunk^T [D x cols] = xs_scaled^T [D x N] . dz [N x cols]
      gemm(false, true, hidden, cols, n, xs_scaled.data_ptr(), hidden, dz.data_ptr(), chunk, dtype, 0.f,
           static_cast<char*>(dws.data_ptr()) + c0 * dws.stride(0) * elem, dtype, dws.stride(0));
    }
    if (compute_dbias) {  // dbias_chunk [cols x 1] = dz^T [cols x N] . g [N x 1]
      gemm(false, false, cols, 1, n, dz.data_ptr(), chunk, g_low.data_ptr(), n, dtype, 0.f,
           dbias_acc.data_ptr<float>() + c0, at::kFloat, cols);
    }
  }
  at::Tensor dxs = at::empty({0}, xs.options());
  if (compute_dxs) {
    dxs = at::empty({n, hidden}, xs.options());
    at::mul_out(dxs, dxs_acc, g);  // float32 in, the inputs' dtype out
  }
  if (!compute_dws) dws = at::empty({0}, ws.options());
  const at::Tensor dbias = compute_dbias ? dbias_acc.to(ws.scalar_type()) : at::empty({0}, ws.options());
  return {dxs, dws, dbias};
}

}  // namespace cuda
}  // namespace nitrobrew
