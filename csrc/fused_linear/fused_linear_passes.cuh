// What the CUDA kernels do with each pair of student/teacher logit tiles: the three passes
// of the fused-linear losses, shared by the sm_80 (mma.sync) and sm_90a (wgmma) kernels.
//
// A pass is built per thread with the rows its accumulator fragment covers, sees every logit
// tile of its block's vocabulary split (`tile`, reading entry (j, k) of the thread's fragment
// of each tile with .at(j, k): registers or shared memory), and writes its result at the end
// (`finish`):
//   KLPass      forward pass 1: one-pass KL state and the CE add-on's softmax state, per row
//               and split, merged by the forward's merge kernel;
//   MixturePass forward pass 2 of the divergences that have one (JSD, the skew KLs, TVD): the sums of
//               second_pass_terms (online_state.h);
//   GradPass    backward: dLoss/dz of the tile, written to a [N x chunk] buffer.
// A pass whose kStudentOnly is true sees the student's tile alone (as both arguments of tile):
// the kernels then skip the teacher's product (topk_linear/passes.cuh).
#pragma once

#include "../divergence/online_state.h"
#include "../divergence/row_partial.h"
#include "../divergence/row_stats.h"
#include "../engine/cuda/tile_fold.cuh"
#include "../engine/cuda/vocab_walk.cuh"
#include "fused_linear_args.cuh"
#include "fused_linear_launch.h"

namespace nitrobrew {
namespace cuda {


// The four lanes of a quad hold the same two rows; merges their entropy states (all lanes take part).
__device__ __forceinline__ void merge_across_quad(EntropyState<float>& st) {
#pragma unroll
  for (int mask = 1; mask <= 2; mask <<= 1) {
    EntropyState<float> other;
    other.m = shfl_xor(st.m, mask);
    other.l = shfl_xor(st.l, mask);
    other.c = shfl_xor(st.c, mask);
    merge(st, other);
  }
}

// The four lanes of a quad hold the same two rows; merges their states (all lanes take part).
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

// kEntropy: the student's entropy state too, on the general fold of every tile (return_entropy). A template
// argument: as a run-time test its state stayed live in the sm_90a kernel's registers and added spills there.
template <typename T, bool kEntropy = false>
struct KLPass {
  using Args = FusedLinearArgs<T>;
  static constexpr bool kStudentOnly = false;
  struct Params {
    float* partial;      // [splits, N, kNumPartialFields] (PartialField, row_partial.h)
    float* label_logit;  // [N]: the student's raw logit of the label (CE add-on)
  };
  Params p;
  KLState<float> st[2];
  SoftmaxState<float> ce[2];
  EntropyState<float> ent[2];  // kEntropy: the student's

  __device__ __forceinline__ KLPass(const FusedLinearArgs<T>&, const FragmentRows&, const Params& params)
      : p(params) {}

  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT& zt) {
    constexpr int kN = ZT::kNTiles;
    if (a.ce_weight == 0.f && !kEntropy && v0 + 8 * kN <= a.vocab_size) {
      plain_tile(a, zs, zt);
      return;
    }
    const bool weight_by_student = a.div.kind == Divergence::kReverseKL;
    const float inv_t = a.inv_temperature;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
      KLState<float> part;
      SoftmaxState<float> ce_part;
      float max_zs = -INFINITY, max_zt = -INFINITY;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) < a.vocab_size) {
            max_zs = fmaxf(max_zs, zs.at(j, 2 * i + e));
            max_zt = fmaxf(max_zt, zt.at(j, 2 * i + e));
          }
        }
      }
      if (max_zs == -INFINITY) continue;  // no vocabulary entry of this tile in this thread's columns
      part.w.m = scale_logit(weight_by_student ? max_zs : max_zt, inv_t);
      part.o.m = scale_logit(weight_by_student ? max_zt : max_zs, inv_t);
      ce_part.m = max_zs;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = v0 + fragment_col(j, e);
          if (col >= a.vocab_size) continue;
          const float z_s = zs.at(j, 2 * i + e), z_t = zt.at(j, 2 * i + e);
          const float w = scale_logit(weight_by_student ? z_s : z_t, inv_t);
          const float o = scale_logit(weight_by_student ? z_t : z_s, inv_t);
          const float ew = PassExp<T>{}(w - part.w.m);
          part.w.l += ew;
          part.a += ew * (w - o);
          part.o.l += PassExp<T>{}(o - part.o.m);
          if (a.ce_weight != 0.f) {
            ce_part.l += PassExp<T>{}(z_s - ce_part.m);
            if (col == rows.label[i]) p.label_logit[rows.row[i]] = z_s;
          }
        }
      }
      merge(st[i], part);
      merge(ce[i], ce_part);
      if constexpr (kEntropy) {  // the student's entropy, relative to its scaled maximum (an exponential per entry)
        EntropyState<float> ent_part;
        ent_part.m = scale_logit(max_zs, inv_t);
#pragma unroll
        for (int j = 0; j < kN; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if (v0 + fragment_col(j, e) >= a.vocab_size) continue;
            const float d = scale_logit(zs.at(j, 2 * i + e), inv_t) - ent_part.m;
            const float ex = PassExp<T>{}(d);
            ent_part.l += ex;
            ent_part.c += ex == 0.f ? 0.f : ex * d;
          }
        }
        merge(ent[i], ent_part);
      }
    }
  }

  // A tile inside the vocabulary without the CE add-on (nearly every tile): the general fold's
  // arithmetic without its per-entry checks, both rows at once, the maxima in four independent
  // chains. Rows past N or ignored fold whatever their tile holds; finish() drops them. At the
  // reference shape (N = 8192, bf16, H100) the forward took 6% less time than with the general
  // fold for every tile, forward + backward 2.7% (docs/notes/fused_linear_forward.md); the losses agreed to
  // 4e-10 relative.
  template <typename ZS, typename ZT>
  __device__ __forceinline__ void plain_tile(const FusedLinearArgs<T>& a, const ZS& zs, const ZT& zt) {
    plain_fold<false>(a, zs, zt);
  }

  // plain_tile's fold, or with kStudentSideDone its rest after student_piece has folded the
  // student's side of the tile (pre_max, pre_o; forward KL and JSD only: the student is `o`).
  template <bool kStudentSideDone, typename ZS, typename ZT>
  __device__ __forceinline__ void plain_fold(const FusedLinearArgs<T>& a, const ZS& zs, const ZT& zt) {
    constexpr int kN = ZT::kNTiles;
    const bool weight_by_student = !kStudentSideDone && a.div.kind == Divergence::kReverseKL;
    const float inv_t = a.inv_temperature;
    float max_s[2][4], max_t[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) max_s[i][c] = max_t[i][c] = -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if constexpr (!kStudentSideDone) {
            max_s[i][(2 * j + e) % 4] = fmaxf(max_s[i][(2 * j + e) % 4], zs.at(j, 2 * i + e));
          }
          max_t[i][(2 * j + e) % 4] = fmaxf(max_t[i][(2 * j + e) % 4], zt.at(j, 2 * i + e));
        }
      }
    }
    KLState<float> part[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float ms = kStudentSideDone ? pre_max[i]
                                        : fmaxf(fmaxf(max_s[i][0], max_s[i][1]), fmaxf(max_s[i][2], max_s[i][3]));
      const float mt = fmaxf(fmaxf(max_t[i][0], max_t[i][1]), fmaxf(max_t[i][2], max_t[i][3]));
      part[i].w.m = scale_logit(weight_by_student ? ms : mt, inv_t);
      if constexpr (kStudentSideDone) {
        part[i].o = pre_o[i];
      } else {
        part[i].o.m = scale_logit(weight_by_student ? mt : ms, inv_t);
      }
      SoftmaxState<float> ce_part;  // as the general fold leaves it without the add-on
      ce_part.m = ms;
      merge(ce[i], ce_part);
    }
#pragma unroll
    for (int j = 0; j < kN; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float z_s = zs.at(j, 2 * i + e), z_t = zt.at(j, 2 * i + e);
          const float w = scale_logit(weight_by_student ? z_s : z_t, inv_t);
          const float o = scale_logit(weight_by_student ? z_t : z_s, inv_t);
          const float ew = PassExp<T>{}(w - part[i].w.m);
          part[i].w.l += ew;
          part[i].a += ew * (w - o);
          if constexpr (!kStudentSideDone) part[i].o.l += PassExp<T>{}(o - part[i].o.m);
        }
      }
    }
    merge(st[0], part[0]);
    merge(st[1], part[1]);
  }

  // The student's side of a plain tile, folded while the teacher's product runs (the sm_90a
  // kernel calls student_piece once per teacher slab, between issuing the slab's products and
  // waiting for them): where the student is the `o` distribution (forward KL, JSD's first pass),
  // its maximum and exponential sum need only the parked student tile, which leaves one of the
  // two exponentials per entry for the fold after the product. The same operations in the same
  // order as plain_tile, so the results are bitwise equal. At N = 8192 on the H100 the forward took
  // 4% less time on the Qwen shape and 8% on Llama-3's (docs/notes/fused_linear_forward.md). Reverse KL keeps
  // plain_tile: its student is `w`, whose exponential the cross term needs per entry, so the park
  // would have to hold it beside the logit. (The gradient pass's forward-KL fold done the same way,
  // p of the parked tile formed during the teacher's product, made no measurable difference.)
  static constexpr int kStudentPieces = 2 * kMaxPieces + 1;  // maxima, 1 to finish them, sums
  float pre_max[2];  // the student's raw maximum per row (the maxima are exact in any order)
  SoftmaxState<float> pre_o[2];

  __device__ __forceinline__ bool student_side_first(const FusedLinearArgs<T>& a, int64_t v0, int cols) const {
    return a.ce_weight == 0.f && !kEntropy && v0 + cols <= a.vocab_size && a.div.kind != Divergence::kReverseKL;
  }

  template <typename ZS>
  __device__ __forceinline__ void student_piece(const FusedLinearArgs<T>& a, int piece, const ZS& zs) {
    if (piece < kMaxPieces) {
      row_max_piece(zs, piece, pre_max);
    } else if (piece == kMaxPieces) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        pre_o[i].m = scale_logit(pre_max[i], a.inv_temperature);
        pre_o[i].l = 0.f;
      }
    } else if (piece < kStudentPieces) {
      const int j0 = 2 * (piece - kMaxPieces - 1);
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float o = scale_logit(zs.at(j0 + jj, 2 * i + e), a.inv_temperature);
            pre_o[i].l += PassExp<T>{}(o - pre_o[i].m);
          }
        }
      }
    }
  }

  // plain_tile's fold after student_piece has run kStudentPieces times on this tile.
  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile_after_student(const FusedLinearArgs<T>& a, const ZS& zs, const ZT& zt) {
    plain_fold<true>(a, zs, zt);
  }

  __device__ __forceinline__ void finish(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t split) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      merge_across_quad(st[i], ce[i]);
      if constexpr (kEntropy) merge_across_quad(ent[i]);
      if (rows.valid[i] && threadIdx.x % 4 == 0) {
        // The label's logit goes to label_logit (its one writer); the field stays 0.
        store_partial(RowPartial<float>{st[i], ce[i], 0.f, kEntropy ? ent[i] : EntropyState<float>{}},
                      p.partial + (split * a.n_rows + rows.row[i]) * kNumPartialFields);
      }
    }
  }
};

template <typename T>
struct MixturePass {
  using Args = FusedLinearArgs<T>;
  static constexpr bool kStudentOnly = false;
  struct Params {
    const float* row_stats;  // [N, kNumRowStats] from pass 1
    float* partial;          // [splits, N, 2]
  };
  Params p;
  LogNormalizer<float> norm_s[2], norm_t[2];
  float sum_a[2] = {0.f, 0.f}, sum_b[2] = {0.f, 0.f};

  __device__ __forceinline__ MixturePass(const FusedLinearArgs<T>&, const FragmentRows& rows, const Params& params)
      : p(params) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float* row = p.row_stats + (rows.valid[i] ? rows.row[i] : 0) * kNumRowStats;
      norm_s[i] = {row[kMaxS], row[kLogSumS]};
      norm_t[i] = {row[kMaxT], row[kLogSumT]};
    }
  }

  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT& zt) {
    constexpr int kN = ZT::kNTiles;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) >= a.vocab_size) continue;
          const float s = scale_logit(zs.at(j, 2 * i + e), a.inv_temperature);
          const float t = scale_logit(zt.at(j, 2 * i + e), a.inv_temperature);
          const SecondPassTerms<float> terms =
              second_pass_terms(a.div, s, t, norm_s[i], norm_t[i], PassExp<T>{});  // the exponential of the gradient pass
          sum_a[i] += terms.a;
          sum_b[i] += terms.b;
        }
      }
    }
  }

  __device__ __forceinline__ void finish(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t split) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      for (int mask = 1; mask <= 2; mask <<= 1) {
        sum_a[i] += shfl_xor(sum_a[i], mask);
        sum_b[i] += shfl_xor(sum_b[i], mask);
      }
      if (rows.valid[i] && threadIdx.x % 4 == 0) {
        float* out = p.partial + (split * a.n_rows + rows.row[i]) * 2;
        out[0] = sum_a[i];
        out[1] = sum_b[i];
      }
    }
  }
};

// The gradient pass. Its fold is compiled once per divergence and CE add-on (on or off) for the
// common tile (every column inside the vocabulary and the chunk, no student softcap), and once in
// general.
// With one fold for everything (the divergence switched per entry, CE and softcap branches
// inline) the kernel was 28k instructions, and fetching the tile's code stalled the consumers:
// ncu sampled 34% of warps waiting for instructions, and the pass ran 1.6x the KL pass's time
// for the same products (docs/notes/fused_linear_backward.md).
template <typename T>
struct GradPass {
  using Args = FusedLinearArgs<T>;
  static constexpr bool kStudentOnly = false;
  // 16-bit inputs on the sm_80 kernel: 4 blocks of 128 threads a SM (<= 128 registers), as the forward-KL,
  // reverse-KL and JSD folds compiled to alone. The skew KLs' folds (an exponential more per entry) took the
  // kernel to 151-158 registers, 3 blocks a SM, for every divergence.
  static constexpr int kMinBlocksPerSM = sizeof(T) == 2 ? 4 : 1;
  struct Params {
    const float* row_stats;  // [N, kNumRowStats] from the forward
    GradChunk<T> chunk;
  };
  Params p;

  __device__ __forceinline__ GradPass(const FusedLinearArgs<T>&, const FragmentRows&, const Params& params)
      : p(params) {}

  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT& zt) {
    constexpr int kCols = 8 * ZT::kNTiles;
    const bool plain = !(a.model_s.softcap > 0.f) && v0 + kCols <= a.vocab_size && v0 + kCols <= p.chunk.end();
    if (plain && a.ce_weight != 0.f) return plain_fold<true>(a, rows, v0, zs, zt);
    if (plain) return plain_fold<false>(a, rows, v0, zs, zt);
    fold<Divergence::kJSD, false, true>(a, rows, v0, zs, zt);
  }

  template <bool kCE, typename ZS, typename ZT>
  __device__ __forceinline__ void plain_fold(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                             const ZS& zs, const ZT& zt) {
    switch (a.div.kind) {
      case Divergence::kForwardKL: return fold<Divergence::kForwardKL, true, kCE>(a, rows, v0, zs, zt);
      case Divergence::kReverseKL: return fold<Divergence::kReverseKL, true, kCE>(a, rows, v0, zs, zt);
      case Divergence::kJSD: return fold<Divergence::kJSD, true, kCE>(a, rows, v0, zs, zt);
      case Divergence::kSkewForwardKL: return fold<Divergence::kSkewForwardKL, true, kCE>(a, rows, v0, zs, zt);
      case Divergence::kSkewReverseKL: return fold<Divergence::kSkewReverseKL, true, kCE>(a, rows, v0, zs, zt);
      default: return fold<Divergence::kTVD, true, kCE>(a, rows, v0, zs, zt);
    }
  }

  // kPlain: a plain tile (see tile()) of divergence kKind, with the CE add-on if kCE. Otherwise
  // every option is read at run time (kKind and kCE unused).
  template <Divergence kKind, bool kPlain, bool kCE, typename ZS, typename ZT>
  __device__ __forceinline__ void fold(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT& zt) {
    constexpr int kN = ZT::kNTiles;
    const float inv_t = a.inv_temperature;
    DivergenceParams<float> div = a.div;
    if constexpr (kPlain) div.kind = kKind;  // a constant: divergence_grad's switch folds away
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (rows.row[i] >= a.n_rows) continue;
      const float* row = p.row_stats + rows.row[i] * kNumRowStats;
      const LogNormalizer<float> norm_s{row[kMaxS], row[kLogSumS]}, norm_t{row[kMaxT], row[kLogSumT]};
      const LogNormalizer<float> norm_ce{row[kMaxCE], row[kLogSumCE]};
      const float center = row[kGradCenter];
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const int64_t col = v0 + fragment_col(j, 0);  // even, as are chunk_begin and ld
        float dz[2] = {0.f, 0.f};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (rows.valid[i] && (kPlain || col + e < a.vocab_size)) {
            const float z = zs.at(j, 2 * i + e);
            const float s = scale_logit(z, inv_t), t = scale_logit(zt.at(j, 2 * i + e), inv_t);
            dz[e] = divergence_grad(div, s, t, norm_s, norm_t, center, PassExp<T>{}) * inv_t;
            if (kCE && a.ce_weight != 0.f) {
              dz[e] += a.ce_weight * (PassExp<T>{}(log_prob(z, norm_ce)) - (col + e == rows.label[i] ? 1.f : 0.f));
            }
            if (!kPlain) dz[e] *= softcap_grad_from_capped(z, a.model_s.softcap);
          }
        }
        p.chunk.template store<kPlain>(rows.row[i], col, dz);
      }
    }
  }

  __device__ __forceinline__ void finish(const FusedLinearArgs<T>&, const FragmentRows&, int64_t) {}
};

}  // namespace cuda
}  // namespace nitrobrew
