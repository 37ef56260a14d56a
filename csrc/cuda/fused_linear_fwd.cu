// CUDA forward of the fused-linear distillation losses.
//
// Grid: (row tiles of 64, vocabulary splits). Each block walks the vocabulary tiles of its
// split, computes the student and teacher logit tiles with tile_gemm (registers only) and
// folds them into per-thread online states; the four lanes that share a row merge theirs,
// and a small kernel merges the splits per row. JSD runs a second pass with the merged
// log-normalizers. Blocks of one split run together (row tile is the fastest grid index),
// so they stream the same unembedding tiles through L2.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "fused_linear_common.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

constexpr int kPartialFields = 8;  // w.m, w.l, o.m, o.l, a, ce.m, ce.l, unused

__device__ __forceinline__ float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }

__device__ __forceinline__ void merge_across_quad(KLState<float>& st, SoftmaxState<float>& ce) {
#pragma unroll
  for (int mask = 1; mask <= 2; mask <<= 1) {
    KLState<float> other;
    other.w.m = shfl_xor(st.w.m, mask);
    other.w.l = shfl_xor(st.w.l, mask);
    other.o.m = shfl_xor(st.o.m, mask);
    other.o.l = shfl_xor(st.o.l, mask);
    other.a = shfl_xor(st.a, mask);
    SoftmaxState<float> other_ce;
    other_ce.m = shfl_xor(ce.m, mask);
    other_ce.l = shfl_xor(ce.l, mask);
    merge(st, other);
    merge(ce, other_ce);
  }
}

// Computes the logit tiles of every vocabulary tile of this block's split (blockIdx.y) and
// hands each to fold(v0, zs, zt): the loop both forward passes share.
template <typename T, bool kVec, typename Fold>
__device__ __forceinline__ void for_each_vocab_tile(const FusedLinearArgs<T>& a, int64_t row0,
                                                    int64_t tiles_per_split, Fold&& fold) {
  __shared__ SmemTile<T> smem;
  const int64_t tiles = (a.vocab_size + kTileCols - 1) / kTileCols;
  const int64_t end = min((int64_t(blockIdx.y) + 1) * tiles_per_split, tiles);
  Acc zs, zt;
  for (int64_t tile = int64_t(blockIdx.y) * tiles_per_split; tile < end; ++tile) {
    const int64_t v0 = tile * kTileCols;
    logit_tiles<T, kVec>(zs, zt, smem, a, row0, v0);
    fold(v0, zs, zt);
  }
}

// Pass 1: one-pass KL state (and the cross-entropy add-on's) per row and split.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) online_kl_kernel(FusedLinearArgs<T> a, int64_t tiles_per_split,
                                                             float* __restrict__ partial, float* __restrict__ label_logit) {
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows;
  const FragmentRows rows(a, row0);
  const bool weight_by_student = a.div.kind == LossKind::kReverseKL;
  const float inv_t = a.inv_temperature;
  KLState<float> st[2];
  SoftmaxState<float> ce[2];
  for_each_vocab_tile<T, kVec>(a, row0, tiles_per_split, [&](int64_t v0, const Acc& zs, const Acc& zt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
      KLState<float> part;
      SoftmaxState<float> ce_part;
      float max_zs = -INFINITY, max_zt = -INFINITY;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) < a.vocab_size) {
            max_zs = fmaxf(max_zs, zs.v[j][2 * i + e]);
            max_zt = fmaxf(max_zt, zt.v[j][2 * i + e]);
          }
        }
      }
      if (max_zs == -INFINITY) continue;  // no vocabulary entry of this tile in this thread's columns
      part.w.m = scale_logit(weight_by_student ? max_zs : max_zt, inv_t);
      part.o.m = scale_logit(weight_by_student ? max_zt : max_zs, inv_t);
      ce_part.m = max_zs;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = v0 + fragment_col(j, e);
          if (col >= a.vocab_size) continue;
          const float z_s = zs.v[j][2 * i + e], z_t = zt.v[j][2 * i + e];
          const float w = scale_logit(weight_by_student ? z_s : z_t, inv_t);
          const float o = scale_logit(weight_by_student ? z_t : z_s, inv_t);
          const float ew = exp_(w - part.w.m);
          part.w.l += ew;
          part.a += ew * (w - o);
          part.o.l += exp_(o - part.o.m);
          if (a.ce_weight != 0.f) {
            ce_part.l += exp_(z_s - ce_part.m);
            if (col == rows.label[i]) label_logit[rows.row[i]] = z_s;
          }
        }
      }
      merge(st[i], part);
      merge(ce[i], ce_part);
    }
  });
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    merge_across_quad(st[i], ce[i]);  // all lanes take part: the shuffles need the full warp
    if (rows.valid[i] && threadIdx.x % 4 == 0) {
      float* out = partial + (int64_t(blockIdx.y) * a.n_rows + rows.row[i]) * kPartialFields;
      out[0] = st[i].w.m;
      out[1] = st[i].w.l;
      out[2] = st[i].o.m;
      out[3] = st[i].o.l;
      out[4] = st[i].a;
      out[5] = ce[i].m;
      out[6] = ce[i].l;
    }
  }
}

// Merges the splits of each row (in split order: deterministic) into loss and row_stats.
template <typename T>
__global__ void merge_kl_kernel(FusedLinearArgs<T> a, int splits, const float* __restrict__ partial,
                                const float* __restrict__ label_logit, float* __restrict__ loss,
                                float* __restrict__ row_stats) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= a.n_rows) return;
  if (a.labels != nullptr && a.labels[n] == a.ignore_index) return;  // outputs stay 0
  KLState<float> st;
  SoftmaxState<float> ce;
  for (int s = 0; s < splits; ++s) {
    const float* in = partial + (int64_t(s) * a.n_rows + n) * kPartialFields;
    KLState<float> part;
    part.w = {in[0], in[1]};
    part.o = {in[2], in[3]};
    part.a = in[4];
    merge(st, part);
    merge(ce, SoftmaxState<float>{in[5], in[6]});
  }
  float* row = row_stats + n * kNumRowStats;
  float value = store_kl_row(finish_kl_row(st, a.div.kind == LossKind::kReverseKL), row);
  if (a.ce_weight != 0.f) {
    const int64_t y = a.labels[n];
    CUDA_KERNEL_ASSERT(y >= 0 && y < a.vocab_size && "labels must be in [0, vocab_size) when ce_weight > 0");
    const LogNormalizer<float> norm_ce = log_normalizer(ce);
    row[kMaxCE] = norm_ce.max;
    row[kLogSumCE] = norm_ce.log_sum;
    value -= a.ce_weight * log_prob(label_logit[n], norm_ce);
  }
  loss[n] = value;
}

// Pass 2 of JSD: per row and split, sums of q (log q - log M) and p (log p - log M).
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads) mixture_kernel(FusedLinearArgs<T> a, int64_t tiles_per_split,
                                                           const float* __restrict__ row_stats,
                                                           float* __restrict__ partial) {
  const int64_t row0 = int64_t(blockIdx.x) * kTileRows;
  const FragmentRows rows(a, row0);
  LogNormalizer<float> norm_s[2], norm_t[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float* row = row_stats + (rows.valid[i] ? rows.row[i] : 0) * kNumRowStats;
    norm_s[i] = {row[kMaxS], row[kLogSumS]};
    norm_t[i] = {row[kMaxT], row[kLogSumT]};
  }
  float kl_q_m[2] = {0.f, 0.f}, kl_p_m[2] = {0.f, 0.f};
  for_each_vocab_tile<T, kVec>(a, row0, tiles_per_split, [&](int64_t v0, const Acc& zs, const Acc& zt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
#pragma unroll
      for (int j = 0; j < kNTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) >= a.vocab_size) continue;
          const float log_p = log_prob(scale_logit(zs.v[j][2 * i + e], a.inv_temperature), norm_s[i]);
          const float log_q = log_prob(scale_logit(zt.v[j][2 * i + e], a.inv_temperature), norm_t[i]);
          const float log_m = log_mixture(a.div, log_p, log_q);
          kl_q_m[i] += exp_(log_q) * (log_q - log_m);
          kl_p_m[i] += exp_(log_p) * (log_p - log_m);
        }
      }
    }
  });
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    for (int mask = 1; mask <= 2; mask <<= 1) {
      kl_q_m[i] += shfl_xor(kl_q_m[i], mask);
      kl_p_m[i] += shfl_xor(kl_p_m[i], mask);
    }
    if (rows.valid[i] && threadIdx.x % 4 == 0) {
      float* out = partial + (int64_t(blockIdx.y) * a.n_rows + rows.row[i]) * 2;
      out[0] = kl_q_m[i];
      out[1] = kl_p_m[i];
    }
  }
}

template <typename T>
__global__ void finish_jsd_kernel(FusedLinearArgs<T> a, int splits, const float* __restrict__ partial,
                                  const float* __restrict__ label_logit, float* __restrict__ loss,
                                  float* __restrict__ row_stats) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= a.n_rows) return;
  if (a.labels != nullptr && a.labels[n] == a.ignore_index) return;
  float kl_q_m = 0.f, kl_p_m = 0.f;
  for (int s = 0; s < splits; ++s) {
    kl_q_m += partial[(int64_t(s) * a.n_rows + n) * 2];
    kl_p_m += partial[(int64_t(s) * a.n_rows + n) * 2 + 1];
  }
  float* row = row_stats + n * kNumRowStats;
  row[kGradCenter] = kl_p_m;
  float value = a.div.beta * kl_q_m + a.div.one_minus_beta * kl_p_m;
  if (a.ce_weight != 0.f) {
    value -= a.ce_weight * log_prob(label_logit[n], LogNormalizer<float>{row[kMaxCE], row[kLogSumCE]});
  }
  loss[n] = value;
}

// Enough blocks for several waves; each split is a whole number of vocabulary tiles.
int64_t choose_tiles_per_split(int64_t row_tiles, int64_t vocab_tiles) {
  const int sms = multiprocessor_count();
  const int64_t target_blocks = int64_t(sms) * 8;
  const int64_t splits = std::max<int64_t>(1, std::min(vocab_tiles, (target_blocks + row_tiles - 1) / row_tiles));
  return (vocab_tiles + splits - 1) / splits;
}

template <typename T, bool kVec>
void launch_forward(const FusedLinearArgs<T>& a, at::Tensor& loss, at::Tensor& row_stats) {
  const int64_t row_tiles = (a.n_rows + kTileRows - 1) / kTileRows;
  const int64_t vocab_tiles = (a.vocab_size + kTileCols - 1) / kTileCols;
  const int64_t tiles_per_split = choose_tiles_per_split(row_tiles, vocab_tiles);
  const int splits = static_cast<int>((vocab_tiles + tiles_per_split - 1) / tiles_per_split);
  TORCH_CHECK(row_tiles < (int64_t(1) << 31), "too many rows for one launch: ", a.n_rows);
  const auto options = loss.options();
  at::Tensor partial = at::empty({splits, a.n_rows, kPartialFields}, options);
  at::Tensor label_logit = at::zeros({a.n_rows}, options);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(row_tiles), splits);
  const int row_blocks = static_cast<int>((a.n_rows + 255) / 256);

  online_kl_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(a, tiles_per_split, partial.data_ptr<float>(),
                                                           label_logit.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  merge_kl_kernel<T><<<row_blocks, 256, 0, stream>>>(a, splits, partial.data_ptr<float>(),
                                                     label_logit.data_ptr<float>(), loss.data_ptr<float>(),
                                                     row_stats.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (a.div.kind == LossKind::kJSD) {
    mixture_kernel<T, kVec><<<grid, kThreads, 0, stream>>>(a, tiles_per_split, row_stats.data_ptr<float>(),
                                                           partial.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    finish_jsd_kernel<T><<<row_blocks, 256, 0, stream>>>(a, splits, partial.data_ptr<float>(),
                                                         label_logit.data_ptr<float>(), loss.data_ptr<float>(),
                                                         row_stats.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

std::tuple<at::Tensor, at::Tensor> fused_linear_distill_fwd_cuda(
    const at::Tensor& xs_in, const at::Tensor& xt_in, const at::Tensor& ws_in, const at::Tensor& wt_in,
    const c10::optional<at::Tensor>& labels_in, int64_t ignore_index, double beta, double temperature,
    double ce_weight, c10::optional<double> softcap_s, c10::optional<double> softcap_t, int64_t vocab_size,
    int64_t chunk_v) {
  const FusedLinearParams p = make_fused_linear_params(xs_in, xt_in, ws_in, wt_in, labels_in, ignore_index, beta,
                                                       temperature, ce_weight, softcap_s, softcap_t, vocab_size,
                                                       chunk_v);
  TORCH_CHECK(xs_in.scalar_type() != at::kDouble, "float64 inputs are supported on the CPU only");
  const c10::cuda::CUDAGuard guard(xs_in.device());
  const at::Tensor xs = unit_stride_rows(xs_in), xt = unit_stride_rows(xt_in);
  const at::Tensor ws = unit_stride_rows(ws_in), wt = unit_stride_rows(wt_in);
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  const auto options = xs.options().dtype(at::kFloat);
  at::Tensor loss = at::zeros({p.num_rows}, options);
  at::Tensor row_stats = at::zeros({p.num_rows, kNumRowStats}, options);
  if (p.num_rows == 0) return {loss, row_stats};
  const bool vec = vectorizable(xs) && vectorizable(xt) && vectorizable(ws) && vectorizable(wt);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs.scalar_type(), "fused_linear_distill_fwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    if constexpr (!std::is_same_v<T, double>) {
      const FusedLinearArgs<T> a = make_args<T>(xs, xt, ws, wt, labels, p);
      if (vec) {
        launch_forward<T, true>(a, loss, row_stats);
      } else {
        launch_forward<T, false>(a, loss, row_stats);
      }
    }
  });
  return {loss, row_stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("fused_linear_distill_fwd", &fused_linear_distill_fwd_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
