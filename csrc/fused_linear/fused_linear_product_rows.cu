// The training path's row kernels of the fused-linear losses: a chunk of rows' stored products of both
// models (product_rows.cuh) in, each row's loss and dLoss/dz out. Every (row, slice of columns) is a
// block of its own, in three launches over the chunk:
//   partials   each block folds its slice into an unfinished row state (KL, cross-entropy, label logit);
//              merge_rows_kernel merges a row's slices in order and finishes its statistics and loss;
//   (2nd pass) JSD's, the skew KLs' and TVD's sums of each slice from those statistics, merged into the
//              loss the same way;
//   grads      dLoss/dz of each slice from the row's statistics, written in the inputs' dtype, scaled by
//              the reduction's weight (the training path's backward only scales it by the upstream
//              gradient).
// The products are read twice (three times with a second pass), at the rate of a copy: a block per row, or a
// cluster of blocks that merged on chip, kept too few bytes in flight or waited on each other
// (docs/notes/fused_linear_training_path.md). The math is the recompute path's (online_state.h,
// row_partial.h, row_folds.cuh, merge_rows.cuh); only where the logits come from differs.
#include "fused_linear_product_rows.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "../divergence/merge_rows.cuh"
#include "../divergence/row_folds.cuh"
#include "../divergence/row_stats.h"
#include "../engine/cuda/cuda_types.h"
#include "../engine/cuda/product_rows.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

template <typename T>
struct ProductRowArgs {
  using mix_t = MixtureType<T, float>;
  const float* zs;  // [rows, ld] float32 products of each model
  const float* zt;
  ModelLogits<T> fs, ft;
  int64_t ld, rows, vocab;
  int64_t width, slices;  // each row's slices: `slices` of `width` columns (the last may be shorter)
  const int64_t* labels;
  int64_t ignore_index;
  float inv_t, ce_weight;
  DivergenceParams<float> div;
  DivergenceParams<mix_t> div_mix;
  const float* row_scale;
  float* partial;          // [slices, rows, kNumPartialFields]
  mix_t* mixture;          // [slices, rows, 2] (the second pass's sums)
  const float* row_stats;  // [rows, kNumRowStats], finished by merge_rows_kernel
  T* grad;
  int64_t ld_grad;

  __device__ __forceinline__ bool masked(int64_t n) const { return labels != nullptr && labels[n] == ignore_index; }
  __device__ __forceinline__ SliceSource<T> source(const RowSlice& r) const {
    const int64_t at = r.row * ld + r.begin;
    return {zs + at, zt + at, fs, ft};
  }
  __device__ __forceinline__ RowSlice slice() const { return RowSlice::of_block(vocab, width, slices); }
};

// Pass 1 of one thread: the KL state of the scaled logits, and the cross-entropy add-on's state; with
// kEntropy the student's entropy state too (a template argument: as a run-time test it made ptxas spill in
// the variants with model options, which run whether it is asked for or not).
template <typename T, bool kWeightByStudent, bool kEntropy>
struct PartialFold {
  KLAccumulator<T, float, kWeightByStudent> kl{};
  CEAccumulator<T, float> ce;
  float inv_t;
  bool with_ce;  // a run-time test: as a template argument it made ptxas spill the CE variant's held chunks
  EntropyAccumulator<T, float> ent{};

  template <int kN>
  __device__ __forceinline__ void chunk(const float (&ys)[kN], const float (&yt)[kN], int64_t v0) {
    float s[kN], t[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      s[k] = scale_logit(ys[k], inv_t);
      t[k] = scale_logit(yt[k], inv_t);
    }
    kl.template chunk<kN>(s, t, v0);
    if (with_ce) ce.template chunk<kN>(ys, v0);
    if constexpr (kEntropy) ent.template chunk<kN>(s);
  }

  __device__ RowPartial<float> state() const { return {kl.st, ce.st, ce.label_logit, ent.st}; }
};

// The second pass of one thread (JSD, the skew KLs, TVD), in its arithmetic type (float64 for float32 inputs).
template <typename T, Divergence kKind>
struct MixtureFold {
  using mix_t = MixtureType<T, float>;
  MixtureSums<T, mix_t, kKind> sums;
  float inv_t;

  template <int kN>
  __device__ __forceinline__ void chunk(const float (&ys)[kN], const float (&yt)[kN], int64_t v0) {
    mix_t s[kN], t[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) {  // scaled (rounded) in float32 as in pass 1, then widened
      s[k] = static_cast<mix_t>(scale_logit(ys[k], inv_t));
      t[k] = static_cast<mix_t>(scale_logit(yt[k], inv_t));
    }
    sums.template chunk<kN>(s, t, v0);
  }
};

// Pass 2 of one thread: dLoss/dz = scale * softcap'(y) * (dLoss/ds / tau + ce_weight * (p1 - [label])),
// with p1 the temperature-1 softmax of the cross-entropy add-on (docs/design.md, section 5).
template <typename T, bool kPlain, Divergence kKind>
struct GradFold {
  DivergenceParams<float> div;
  LogNormalizer<float> norm_s, norm_t, norm_ce;
  float center, inv_t, ce_weight, softcap_s, scale;
  int64_t label;
  T* row;

  template <int kN>
  __device__ __forceinline__ void chunk(const float (&ys)[kN], const float (&yt)[kN], int64_t v0) {
    const RowExp<T, float> ex;
    float g[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float s = scale_logit(ys[k], inv_t), t = scale_logit(yt[k], inv_t);
      // A student entry of -inf has probability 0: its gradient is -q (forward KL) or 0, never the
      // 0 * inf of the other divergences' formulas.
      const bool zero = kKind != Divergence::kForwardKL && s == kNegInf<float>;
      float d = zero ? 0.f
                     : divergence_grad(div, s, t, norm_s, norm_t, center, ex) * inv_t;
      if (ce_weight != 0.f) d += ce_weight * (ex(log_prob(ys[k], norm_ce)) - (v0 + k == label ? 1.f : 0.f));
      g[k] = kPlain ? d * scale : d * softcap_grad_from_capped(ys[k], softcap_s) * scale;
    }
    store_chunk<kN>(row, v0, g);
  }
};

// Partials: a slice's unfinished row state (masked rows: none; merge_rows_kernel skips them).
// kPlain: plain_logits (no bias, scale or soft-cap), which keeps per-entry work out of the loop that every entry
// runs: these kernels are bound by the instructions they issue (docs/notes/fused_linear_training_path.md).
template <typename T, bool kWeightByStudent, bool kPlain, bool kEntropy>
__global__ void __launch_bounds__(kProductRowThreads, kProductRowBlocksPerSM) row_partials_kernel(const ProductRowArgs<T> a) {
  const RowSlice r = a.slice();
  if (a.masked(r.row)) return;
  const int64_t label = a.labels != nullptr ? a.labels[r.row] : -1;
  PartialFold<T, kWeightByStudent, kEntropy> fold{{}, {{}, 0.f, label}, a.inv_t, a.ce_weight != 0.f};
  for_each_product_chunk<true, kPlain>(a.source(r), r.begin, r.size(), fold);
  const RowPartial<float> part = block_merge(fold.state());
  if (threadIdx.x == 0) store_partial(part, a.partial + (r.slice * a.rows + r.row) * kNumPartialFields);
}

// A divergence with a second pass: a slice's sums from the row's log-normalizers.
template <typename T, bool kPlain, Divergence kKind>
__global__ void __launch_bounds__(kProductRowThreads) row_mixture_kernel(const ProductRowArgs<T> a) {
  using mix_t = MixtureType<T, float>;
  const RowSlice r = a.slice();
  if (a.masked(r.row)) return;
  const float* stats = a.row_stats + r.row * kNumRowStats;
  MixtureFold<T, kKind> mix{{a.div_mix, {mix_t(stats[kMaxS]), mix_t(stats[kLogSumS])},
                      {mix_t(stats[kMaxT]), mix_t(stats[kLogSumT])}},
                     a.inv_t};
  for_each_product_chunk<true, kPlain>(a.source(r), r.begin, r.size(), mix);
  block_sum2(mix.sums.sum_a, mix.sums.sum_b);
  if (threadIdx.x == 0) {
    mix_t* out = a.mixture + 2 * (r.slice * a.rows + r.row);
    out[0] = mix.sums.sum_a;
    out[1] = mix.sums.sum_b;
  }
}

// dLoss/dz of a slice: 0 for masked rows, NaN throughout for undefined ones (docs/design.md, section 7).
template <typename T, bool kPlain, Divergence kKind>
__global__ void __launch_bounds__(kProductRowThreads, kProductRowBlocksPerSM) row_grads_kernel(const ProductRowArgs<T> a) {
  const RowSlice r = a.slice();
  T* row = a.grad + r.row * a.ld_grad;
  if (a.masked(r.row)) return fill_slice(row, r, from_acc<T>(0.f));
  const float* stats = a.row_stats + r.row * kNumRowStats;
  if (stats[kMaxS] != stats[kMaxS] || stats[kMaxT] != stats[kMaxT]) return fill_slice(row, r, from_acc<T>(kNaN<float>));
  DivergenceParams<float> div = a.div;
  div.kind = kKind;  // a constant: divergence_grad's switch folds away
  GradFold<T, kPlain, kKind> grad{div,
                   {stats[kMaxS], stats[kLogSumS]},
                   {stats[kMaxT], stats[kLogSumT]},
                   {stats[kMaxCE], stats[kLogSumCE]},
                   stats[kGradCenter],
                   a.inv_t,
                   a.ce_weight,
                   a.fs.softcap,
                   *a.row_scale * a.fs.scale,
                   a.labels != nullptr ? a.labels[r.row] : -1,
                   row};
  for_each_product_chunk<true, kPlain>(a.source(r), r.begin, r.size(), grad);
}

// The most columns of a slice: kRowSliceCols, or in development builds NITROBREW_ROW_SLICE_COLS (rounded
// down to a multiple of kProductAlign, at least one), for A/B runs (docs/development.md).
int64_t slice_cols() {
#ifdef NITROBREW_DEV_KNOBS
  if (const char* env = std::getenv("NITROBREW_ROW_SLICE_COLS"); env != nullptr && env[0] != '\0') {
    return std::max<int64_t>(kProductAlign, std::atoll(env) / kProductAlign * kProductAlign);
  }
#endif
  return kRowSliceCols;
}

template <typename T>
dim3 row_grid(const ProductRowArgs<T>& a) {
  const int64_t blocks = a.rows * a.slices;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "nitrobrew: too many rows for one launch of the row kernels");
  return dim3(static_cast<unsigned>(blocks));
}

MergeRowsArgs merge_args(int64_t rows, int64_t slices, const int64_t* labels, const DistillParams& p) {
  return {rows, static_cast<int>(slices), labels, p.ignore_index,
          RowFinish{p.kind == Divergence::kReverseKL, p.ce_weight, p.vocab_size}};
}

int merge_blocks(int64_t rows) { return static_cast<int>((rows + 255) / 256); }

// Each slice's unfinished row state into a.partial.
// Calls launch(std::integral_constant<bool, kPlain>) with kPlain = plain_logits(a.fs, a.ft).
template <typename T, typename F>
void with_plain(const ProductRowArgs<T>& a, F&& launch) {
  if (plain_logits(a.fs, a.ft)) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

template <typename F>
void with_flag(bool flag, F&& launch) {
  if (flag) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

template <typename T>
void launch_partials(const ProductRowArgs<T>& a, const DistillParams& p, cudaStream_t stream) {
  with_plain(a, [&](auto plain) {
    with_flag(p.kind == Divergence::kReverseKL, [&](auto by_student) {
      with_flag(p.entropy, [&](auto entropy) {
        row_partials_kernel<T, decltype(by_student)::value, decltype(plain)::value, decltype(entropy)::value>
            <<<row_grid(a), kProductRowThreads, 0, stream>>>(a);
      });
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_mixture(const ProductRowArgs<T>& a, cudaStream_t stream) {
  with_plain(a, [&](auto plain) {
    with_second_pass_kind(a.div.kind, [&](auto kind) {
      row_mixture_kernel<T, decltype(plain)::value, decltype(kind)::value>
          <<<row_grid(a), kProductRowThreads, 0, stream>>>(a);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_grads(const ProductRowArgs<T>& a, cudaStream_t stream) {
  with_plain(a, [&](auto plain) {
    with_divergence_kind(a.div.kind, [&](auto kind) {
      row_grads_kernel<T, decltype(plain)::value, decltype(kind)::value>
          <<<row_grid(a), kProductRowThreads, 0, stream>>>(a);
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
at::Tensor mixture_buffer(ProductRowArgs<T>& a, const at::TensorOptions& options) {
  using mix_t = MixtureType<T, float>;
  at::Tensor mixture =
      at::empty({a.slices, a.rows, 2}, options.dtype(std::is_same_v<mix_t, double> ? at::kDouble : at::kFloat));
  a.mixture = static_cast<mix_t*>(mixture.data_ptr());
  return mixture;
}

// The single-device step: partials, their merge into the finished rows, (2nd pass) its sums and their merge,
// then the gradients.
template <typename T>
void launch_rows(ProductRowArgs<T>& a, const DistillParams& p, float* loss, float* entropy) {
  using mix_t = MixtureType<T, float>;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = at::TensorOptions().device(at::kCUDA, c10::cuda::current_device());
  const at::Tensor partial = at::empty({a.slices, a.rows, kNumPartialFields}, options.dtype(at::kFloat));
  // Masked rows' statistics stay as allocated: zeros where their entropy is read.
  const at::Tensor row_stats = entropy != nullptr ? at::zeros({a.rows, kNumRowStats}, options.dtype(at::kFloat))
                                                  : at::empty({a.rows, kNumRowStats}, options.dtype(at::kFloat));
  const bool second_pass = has_second_pass(p.kind);
  const at::Tensor mixture = second_pass ? mixture_buffer(a, options) : at::Tensor();
  a.partial = partial.data_ptr<float>();
  a.row_stats = row_stats.data_ptr<float>();
  const MergeRowsArgs merge = merge_args(a.rows, a.slices, a.labels, p);
  float* stats = row_stats.data_ptr<float>();
  launch_partials(a, p, stream);
  merge_rows_kernel<float, mix_t><<<merge_blocks(a.rows), 256, 0, stream>>>(merge, a.div_mix, a.partial, nullptr,
                                                                            nullptr, nullptr, loss, stats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (second_pass) {
    launch_mixture(a, stream);
    merge_rows_kernel<float, mix_t><<<merge_blocks(a.rows), 256, 0, stream>>>(merge, a.div_mix, a.partial, nullptr,
                                                                              a.mixture, nullptr, loss, stats);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  if (entropy != nullptr) at::from_blob(entropy, {a.rows}, options.dtype(at::kFloat)).copy_(row_stats.select(1, kEntropyS));
  launch_grads(a, stream);
}

template <typename T>
ProductRowArgs<T> row_args(const ProductRowsLaunch& l, const DistillParams& p) {
  ProductRowArgs<T> a;
  a.partial = nullptr;  // the stages that write them set them
  a.mixture = nullptr;
  a.zs = l.zs;
  a.zt = l.zt;
  a.fs = {static_cast<const T*>(l.bias_s), static_cast<float>(p.logit_scale_s), static_cast<float>(p.softcap_s)};
  a.ft = {static_cast<const T*>(l.bias_t), static_cast<float>(p.logit_scale_t), static_cast<float>(p.softcap_t)};
  a.ld = l.ld;
  a.rows = l.rows;
  a.vocab = p.vocab_size;
  // As few slices as slice_cols() allows, of equal widths (multiples of kProductAlign).
  a.slices = std::max<int64_t>(1, (p.vocab_size + slice_cols() - 1) / slice_cols());
  a.width = product_row_stride((p.vocab_size + a.slices - 1) / a.slices);
  a.labels = l.labels;
  a.ignore_index = p.ignore_index;
  a.inv_t = static_cast<float>(p.inv_temperature);
  a.ce_weight = static_cast<float>(p.ce_weight);
  a.div = divergence_params<float>(p);
  a.div_mix = divergence_params<MixtureType<T, float>>(p);
  a.row_scale = l.row_scale;
  a.row_stats = l.row_stats;
  a.grad = static_cast<T*>(l.grad);
  a.ld_grad = l.ld_grad;
  return a;
}

}  // namespace

int64_t product_row_stride(int64_t vocab) { return (vocab + kProductAlign - 1) / kProductAlign * kProductAlign; }

void launch_product_rows(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype) {
  if (l.rows == 0) return;
  NITROBREW_DISPATCH_CUDA_FLOATS(dtype, "nitrobrew_product_rows", {
    ProductRowArgs<T> a = row_args<T>(l, p);
    launch_rows(a, p, l.loss, l.entropy);
  });
}

void launch_product_partials(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype,
                             float* merged) {
  if (l.rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto options = at::TensorOptions().device(at::kCUDA, c10::cuda::current_device());
  NITROBREW_DISPATCH_CUDA_FLOATS(dtype, "nitrobrew_product_partials", {
    using mix_t = MixtureType<T, float>;
    ProductRowArgs<T> a = row_args<T>(l, p);
    const at::Tensor partial = at::empty({a.slices, a.rows, kNumPartialFields}, options.dtype(at::kFloat));
    a.partial = partial.data_ptr<float>();
    launch_partials(a, p, stream);
    // The slices merged in order into one unfinished state a row (no loss: merged, not finished).
    merge_rows_kernel<float, mix_t><<<merge_blocks(a.rows), 256, 0, stream>>>(
        merge_args(a.rows, a.slices, a.labels, p), a.div_mix, a.partial, nullptr, nullptr, merged, nullptr, nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor launch_product_mixture(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype) {
  const auto options = at::TensorOptions().device(at::kCUDA, c10::cuda::current_device());
  at::Tensor sums = at::zeros({l.rows, 2}, options.dtype(at::kDouble));
  if (l.rows == 0) return sums;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  NITROBREW_DISPATCH_CUDA_FLOATS(dtype, "nitrobrew_product_mixture", {
    ProductRowArgs<T> a = row_args<T>(l, p);
    const at::Tensor mixture = mixture_buffer(a, options);
    mixture.zero_();  // masked rows' blocks write nothing: their sums are 0
    launch_mixture(a, stream);
    sums = mixture.sum(0).to(at::kDouble);  // the slices' sums (merge_shards adds the shards' in float64)
  });
  return sums;
}

void launch_product_grads(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype) {
  if (l.rows == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  NITROBREW_DISPATCH_CUDA_FLOATS(dtype, "nitrobrew_product_grads", {
    launch_grads(row_args<T>(l, p), stream);
  });
}

}  // namespace cuda
}  // namespace nitrobrew
