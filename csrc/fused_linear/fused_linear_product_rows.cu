// The training path's row kernel of the fused-linear losses: a chunk of rows' stored products of both
// models (product_rows.cuh) in, each row's loss and dLoss/dz out, in one pass over device memory.
//
// Per row, a cluster of blocks (one per column slice):
//   pass 1   each block folds its slice into an unfinished row state (KL, cross-entropy, label logit),
//            the blocks exchange their states through distributed shared memory and each merges all
//            of them in rank order, so every block finishes the same row statistics;
//   (JSD)    the mixture pass over the slice, its sums exchanged the same way;
//   pass 2   dLoss/dz of the slice from the statistics, written in the inputs' dtype, scaled by the
//            reduction's weight (the training path's backward only scales it by the upstream gradient).
// The second and third reads of a slice come soon after the first, from L2. The math is the recompute
// path's (online_state.h, row_partial.h, row_folds.cuh); only where the logits come from differs.
#include "fused_linear_product_rows.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "../divergence/row_folds.cuh"
#include "../divergence/row_stats.h"
#include "../engine/cuda/arch.h"
#include "../engine/cuda/cuda_types.h"
#include "../engine/cuda/product_rows.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

template <typename T>
struct ProductRowArgs {
  StoredProducts<T> s, t;
  int64_t ld, rows, vocab;
  const int64_t* labels;
  int64_t ignore_index;
  float inv_t, ce_weight;
  DivergenceParams<float> div;
  DivergenceParams<MixtureType<T, float>> div_mix;
  RowFinish finish;
  const float* row_scale;
  float* loss;
  T* grad;
  int64_t ld_grad;
};

// Pass 1 of one thread: the KL state of the scaled logits, and the cross-entropy add-on's state.
template <typename T, bool kWeightByStudent>
struct PartialFold {
  KLAccumulator<T, float, kWeightByStudent> kl{};
  CEAccumulator<T, float> ce;
  float inv_t;
  bool with_ce;

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
  }

  __device__ RowPartial<float> state() const { return {kl.st, ce.st, ce.label_logit}; }
};

// JSD's mixture pass of one thread, in the mixture's arithmetic type (float64 for float32 inputs).
template <typename T>
struct MixtureFold {
  using mix_t = MixtureType<T, float>;
  MixtureSums<T, mix_t> sums;
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
template <typename T>
struct GradFold {
  DivergenceParams<float> div;
  LogNormalizer<float> norm_s, norm_t, norm_ce;
  float center, inv_t, ce_weight, softcap_s, scale;
  int64_t label;
  T* row;

  template <int kN>
  __device__ __forceinline__ void chunk(const float (&ys)[kN], const float (&yt)[kN], int64_t v0) {
    const RowExp<T, float> ex;
    alignas(16) T g[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      const float s = scale_logit(ys[k], inv_t), t = scale_logit(yt[k], inv_t);
      // A student entry of -inf has probability 0: its gradient is -q (forward KL) or 0, never the
      // 0 * inf of the reverse-KL and JSD formulas.
      const bool zero = div.kind != Divergence::kForwardKL && s == kNegInf<float>;
      float d = zero ? 0.f
                     : divergence_grad(div, s, t, log_prob(s, norm_s), log_prob(t, norm_t), center, ex) * inv_t;
      if (ce_weight != 0.f) d += ce_weight * (ex(log_prob(ys[k], norm_ce)) - (v0 + k == label ? 1.f : 0.f));
      g[k] = from_acc<T>(d * softcap_grad_from_capped(ys[k], softcap_s) * scale);
    }
    store_chunk<kN>(row, v0, g);
  }
};

// The finished row as every block of its cluster holds it: its statistics and loss.
struct FinishedRow {
  float stats[kNumRowStats];
  float loss;
};


// kStaged: the block's slice of each row is copied into shared memory (two buffers, the next row's
// copy in flight while this one is worked on); otherwise each pass reads it from device memory.
template <typename T, bool kWeightByStudent, bool kStaged>
__device__ __forceinline__ void product_rows(const ProductRowArgs<T>& a) {
  using mix_t = MixtureType<T, float>;
  const RowCluster cluster = RowCluster::current();
  const RowSlice slice = RowSlice::of(a.vocab, cluster);
  // Written by warp 0 for the peers to read after the cluster's barrier; double-buffered by row, so
  // that a block that runs ahead onto the next row never overwrites what a peer still reads.
  __shared__ RowPartial<float> s_part[2];
  __shared__ mix_t s_mix[2][2];
  __shared__ FinishedRow s_row;
  __shared__ alignas(8) uint64_t s_full[2];  // kStaged: a buffer's copies have landed
  extern __shared__ float4 s_stage[];         // kStaged: [2 buffers][2 models][width] floats
  const int64_t width = row_slice_width(a.vocab, cluster.size);
  // Whole 16-byte units: a slice's last columns may reach into the row's padding, which no pass reads.
  const uint32_t copy_bytes = static_cast<uint32_t>((slice.size() + 3) / 4 * 16);
  const bool staging = kStaged && slice.size() > 0;
  const float scale = *a.row_scale * a.s.f.scale;
  const bool jsd = a.div.kind == Divergence::kJSD;
  const int64_t first = blockIdx.x / cluster.size, step = gridDim.x / cluster.size;
  const auto masked = [&](int64_t n) { return a.labels != nullptr && a.labels[n] == a.ignore_index; };
  const auto next_unmasked = [&](int64_t n) {
    while (n < a.rows && masked(n)) n += step;
    return n;
  };
  float* stage = reinterpret_cast<float*>(s_stage);
  const auto issue_copies = [&](int64_t n, int buffer) {  // one thread: row n's slice into `buffer`
    float* dst = stage + buffer * 2 * width;
    const int64_t offset = n * a.ld + slice.begin;
    hopper_expect_bytes(&s_full[buffer], 2 * copy_bytes);
    bulk_load(dst, a.s.z + offset, copy_bytes, &s_full[buffer]);
    bulk_load(dst + width, a.t.z + offset, copy_bytes, &s_full[buffer]);
  };
  if (staging) {
    if (threadIdx.x == 0) {
      hopper_init_barriers(s_full, 2);
      const int64_t n = next_unmasked(first);
      if (n < a.rows) issue_copies(n, 0);
    }
    __syncthreads();
  }
  int parity = 0;   // which s_part / s_mix the row uses
  int64_t done = 0;  // unmasked rows this block has worked on: the staging buffer and its phase
  for (int64_t n = first; n < a.rows; n += step) {
    T* row = a.grad + n * a.ld_grad;
    const int64_t label = a.labels != nullptr ? a.labels[n] : -1;
    if (masked(n)) {  // loss 0, gradient 0 (the whole cluster skips it, and no copy was made for it)
      fill_slice(row, slice, from_acc<T>(0.f));
      if (cluster.rank == 0 && threadIdx.x == 0) a.loss[n] = 0.f;
      continue;
    }
    SliceSource<T> src{a.s.z + n * a.ld + slice.begin, a.t.z + n * a.ld + slice.begin, a.s.f, a.t.f};
    if (staging) {
      const int buffer = done & 1;
      if (threadIdx.x == 0) {  // the next row's copy, into the buffer the previous row released
        const int64_t next = next_unmasked(n + step);
        if (next < a.rows) issue_copies(next, buffer ^ 1);
      }
      hopper_wait(&s_full[buffer], (done >> 1) & 1);
      src.zs = stage + buffer * 2 * width;
      src.zt = src.zs + width;
    }

    PartialFold<T, kWeightByStudent> fold{{}, {{}, 0.f, label}, a.inv_t, a.ce_weight != 0.f};
    for_each_product_chunk<true>(src, slice, fold);
    const RowPartial<float> part = block_merge(fold.state());
    if (threadIdx.x == 0) s_part[parity] = part;
    cluster.sync();
    float label_logit = 0.f;
    if (threadIdx.x < 32) {  // warp 0 merges the blocks' states in rank order (a tree)
      RowPartial<float> mine;
      if (threadIdx.x < cluster.size) mine = *cluster.peer(&s_part[parity], threadIdx.x);
      const RowPartial<float> merged = warp_merge(mine);
      if (threadIdx.x == 0) {
        s_row.loss = finish_row(merged, a.finish, label, s_row.stats);
        label_logit = merged.label_logit;
      }
    }
    __syncthreads();

    if (jsd) {
      MixtureFold<T> mix{{a.div_mix, {mix_t(s_row.stats[kMaxS]), mix_t(s_row.stats[kLogSumS])},
                          {mix_t(s_row.stats[kMaxT]), mix_t(s_row.stats[kLogSumT])}},
                         a.inv_t};
      for_each_product_chunk<true>(src, slice, mix);
      block_sum2(mix.sums.kl_q_m, mix.sums.kl_p_m);
      if (threadIdx.x == 0) {
        s_mix[parity][0] = mix.sums.kl_q_m;
        s_mix[parity][1] = mix.sums.kl_p_m;
      }
      cluster.sync();
      if (threadIdx.x == 0) {
        mix_t kl_q_m = 0, kl_p_m = 0;
        for (unsigned r = 0; r < cluster.size; ++r) {
          const mix_t* peer = *cluster.peer(&s_mix[parity], r);
          kl_q_m += peer[0];
          kl_p_m += peer[1];
        }
        if (s_row.stats[kMaxS] == s_row.stats[kMaxS]) {  // a defined row
          s_row.loss = finish_jsd_row(kl_q_m, kl_p_m, a.div_mix, a.finish, label_logit, s_row.stats);
        }
      }
      __syncthreads();
    }
    if (cluster.rank == 0 && threadIdx.x == 0) a.loss[n] = s_row.loss;

    const float* stats = s_row.stats;
    if (stats[kMaxS] != stats[kMaxS] || stats[kMaxT] != stats[kMaxT]) {  // an undefined row: NaN throughout
      fill_slice(row, slice, from_acc<T>(kNaN<float>));
    } else {
      GradFold<T> grad{a.div,
                       {stats[kMaxS], stats[kLogSumS]},
                       {stats[kMaxT], stats[kLogSumT]},
                       {stats[kMaxCE], stats[kLogSumCE]},
                       stats[kGradCenter],
                       a.inv_t,
                       a.ce_weight,
                       a.s.f.softcap,
                       scale,
                       label,
                       row};
      for_each_product_chunk<true>(src, slice, grad);
    }
    parity ^= 1;
    ++done;
    if (staging) __syncthreads();  // every thread is done with the buffer the next row's copy reuses
  }
  // No block may leave while a peer can still read its shared memory.
  cluster.sync();
}

template <typename T, bool kWeightByStudent, bool kStaged>
__global__ void __launch_bounds__(kProductRowThreads, 1) product_rows_kernel(ProductRowArgs<T> a) {
#if !NITROBREW_CLUSTERS
  if constexpr (kStaged) {  // Hopper's alone (plan_rows): nothing to compile below sm_90
    __trap();
  } else
#endif
  {
    product_rows<T, kWeightByStudent, kStaged>(a);
  }
}

// How a launch lays the rows out: blocks per row (the cluster), and whether they stage their slices.
struct RowsPlan {
  int cluster;
  bool staged;
  int64_t smem;  // dynamic shared memory, bytes
};

// A block per row, reading its products from device memory in each pass. The staged layout (Hopper: a
// cluster of blocks per row, each staging its slice in shared memory, so that the products are read
// once) measured slower so far (docs/notes/fused_linear_training_path.md); development builds run it
// with NITROBREW_ROWS_STAGED=1 (docs/development.md): the smallest cluster whose slices fit the buffers.
RowsPlan plan_rows(int64_t vocab) {
#ifdef NITROBREW_DEV_KNOBS
  constexpr int64_t kStageBytes = int64_t(200) << 10;  // two buffers of a block's slice of both models
  constexpr int kMaxStagedCluster = 16;                 // Hopper's largest cluster (a non-portable size)
  const char* staged = std::getenv("NITROBREW_ROWS_STAGED");
  if (staged != nullptr && staged[0] == '1' && use_sm90a_kernels()) {
    for (int size = 1; size <= kMaxStagedCluster; size *= 2) {
      const int64_t smem = 2 * 2 * row_slice_width(vocab, size) * int64_t(sizeof(float));
      if (smem <= kStageBytes) return {size, true, smem};
    }
  }
#endif
  (void)vocab;
  return {1, false, 0};
}

template <typename T, bool kWeightByStudent, bool kStaged>
void launch(const ProductRowArgs<T>& a, const RowsPlan& plan) {
  const auto kernel = product_rows_kernel<T, kWeightByStudent, kStaged>;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(kProductRowThreads);
  config.dynamicSmemBytes = static_cast<size_t>(plan.smem);
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = plan.cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = kStaged || plan.cluster > 1 ? 1 : 0;  // (the occupancy query below needs the attribute)
  int64_t clusters = 2 * int64_t(multiprocessor_count());  // rows in flight (a block per row)
  if (kStaged) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem)));
    if (plan.cluster > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    // As many clusters as fit at once: each walks its rows, staging the next while working on one.
    config.gridDim = dim3(static_cast<unsigned>(plan.cluster));
    int active = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&active, kernel, &config));
    TORCH_CHECK(active > 0, "nitrobrew: no cluster of ", plan.cluster, " blocks fits this GPU");
    clusters = active;
  }
  clusters = std::min(clusters, a.rows);
  config.gridDim = dim3(static_cast<unsigned>(clusters * plan.cluster));
#ifdef NITROBREW_DEV_KNOBS
  // Development builds (docs/development.md): NITROBREW_ROWS_DEBUG=1 prints each launch's layout.
  if (const char* env = std::getenv("NITROBREW_ROWS_DEBUG"); env != nullptr && env[0] == '1') {
    std::fprintf(stderr, "nitrobrew product_rows: %lld rows, vocab %lld, cluster %d, staged %d, smem %lld, clusters %lld\n",
                 static_cast<long long>(a.rows), static_cast<long long>(a.vocab), plan.cluster, int(kStaged),
                 static_cast<long long>(plan.smem), static_cast<long long>(clusters));
  }
#endif
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, a));
}

template <typename T, bool kWeightByStudent>
void launch(const ProductRowArgs<T>& a, const RowsPlan& plan) {
#ifdef NITROBREW_DEV_KNOBS
  if (plan.staged) {
    launch<T, kWeightByStudent, true>(a, plan);
    return;
  }
#endif
  launch<T, kWeightByStudent, false>(a, plan);
}

}  // namespace

int64_t product_row_stride(int64_t vocab) { return (vocab + kProductAlign - 1) / kProductAlign * kProductAlign; }

void launch_product_rows(const ProductRowsLaunch& l, const DistillParams& p, at::ScalarType dtype) {
  if (l.rows == 0) return;
  NITROBREW_DISPATCH_CUDA_FLOATS(dtype, "nitrobrew_product_rows", {
    ProductRowArgs<T> a;
    a.s = {l.zs, {static_cast<const T*>(l.bias_s), static_cast<float>(p.logit_scale_s), static_cast<float>(p.softcap_s)}};
    a.t = {l.zt, {static_cast<const T*>(l.bias_t), static_cast<float>(p.logit_scale_t), static_cast<float>(p.softcap_t)}};
    a.ld = l.ld;
    a.rows = l.rows;
    a.vocab = p.vocab_size;
    a.labels = l.labels;
    a.ignore_index = p.ignore_index;
    a.inv_t = static_cast<float>(p.inv_temperature);
    a.ce_weight = static_cast<float>(p.ce_weight);
    a.div = divergence_params<float>(p);
    a.div_mix = divergence_params<MixtureType<T, float>>(p);
    a.finish = RowFinish{p.kind == Divergence::kReverseKL, p.ce_weight, p.vocab_size};
    a.row_scale = l.row_scale;
    a.loss = l.loss;
    a.grad = static_cast<T*>(l.grad);
    a.ld_grad = l.ld_grad;
    const RowsPlan plan = plan_rows(p.vocab_size);
    if (p.kind == Divergence::kReverseKL) {
      launch<T, true>(a, plan);
    } else {
      launch<T, false>(a, plan);
    }
  });
}

}  // namespace cuda
}  // namespace nitrobrew
