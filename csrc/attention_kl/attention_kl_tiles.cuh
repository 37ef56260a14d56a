// Device pieces shared by the attention-KL kernels (fwd_sm80.cu, bwd_sm80.cu; the
// sm_90a ones, fwd_sm90.cu and bwd_dq_sm90.cu, use the per-row math).
//
// A block of 4 warps owns kBlockRows rows (queries in the forward and the dq kernel, keys in
// the dk kernel) and walks tiles of kBlockCols columns (keys, resp. queries). Each warp owns
// 16 rows; its scores for a tile are a [16 x 64] float32 accumulator in the layout of
// mma.m16n8k16 (engine/cuda/tile_gemm_sm80.cuh): lane l holds, for n-tiles j = 0..7,
//   acc[j][0..1] at row l/4,     columns 8j + 2(l%4) + {0, 1}
//   acc[j][2..3] at row l/4 + 8, columns 8j + 2(l%4) + {0, 1}.
// Operands live in shared memory as [64 rows][d_pad + 8] (16 bytes of padding per row keep
// ldmatrix's eight row reads on distinct banks), filled with cp.async and zero past the head
// dim, so the products over d_pad equal those over the true head dim.
#pragma once

#include "../divergence/row_stats.h"
#include "../engine/cuda/fast_math.cuh"
#include "../engine/cuda/tile_gemm_sm80.cuh"
#include "attention_kl_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <limits>

namespace nitrobrew {
namespace cuda {
namespace attention {

constexpr int kThreads = 128;    // 4 warps of 16 rows
constexpr int kBlockRows = 64;
constexpr int kBlockCols = 64;
constexpr int kColTiles = kBlockCols / 8;
constexpr int kRowPad = 8;       // elements of padding per shared-memory row

using ScoreAcc = float[kColTiles][4];

// Bytes of one [64 x d_pad] shared-memory tile.
template <typename T>
inline size_t tile_bytes(int d_pad) {
  return static_cast<size_t>(kBlockRows) * (d_pad + kRowPad) * sizeof(T);
}

// Starts copying rows [0, rows_valid) of a [64 x d] tile (rows `row_stride` elements apart) into
// shared memory; rows and columns past the valid ones are zero-filled up to d_pad.
template <typename T>
__device__ __forceinline__ void load_tile_async(T* smem, int d_pad, const T* src, int64_t row_stride,
                                                int rows_valid, int d) {
  const int chunks_per_row = d_pad / 8;
  const int stride = d_pad + kRowPad;
  for (int c = threadIdx.x; c < kBlockRows * chunks_per_row; c += kThreads) {
    const int r = c / chunks_per_row, col = (c % chunks_per_row) * 8;
    const bool valid = r < rows_valid && col < d;
    cp_async_16(smem + r * stride + col, valid ? src + r * row_stride + col : src, valid);
  }
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// acc = a[16 rows] . b[64 rows]^T over d_pad: the warp's scores against a tile. `a` points at
// the warp's first row; both operands have rows of d_pad + kRowPad elements. kDPad > 0 fixes
// d_pad at compile time (the tuned head dims), so the k-loop unrolls and loads run ahead.
template <int kDPad, typename T>
__device__ __forceinline__ void warp_scores(ScoreAcc& acc, const T* a, const T* b, int d_pad) {
  const int lane = threadIdx.x % 32, stride = d_pad + kRowPad;
#pragma unroll
  for (int j = 0; j < kColTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  auto k_step = [&](int kk) {
    uint32_t af[4];
    ldmatrix_x4(af, a + (lane % 16) * stride + kk + (lane / 16) * 8);
#pragma unroll
    for (int j = 0; j < kColTiles; j += 2) {
      uint32_t bf[4];  // n-tiles j and j + 1, k halves 0 and 1
      ldmatrix_x4(bf, b + (j * 8 + (lane & 7) + ((lane >> 4) << 3)) * stride + kk + ((lane >> 3) & 1) * 8);
      mma_16816<T>(acc[j], af, bf[0], bf[1]);
      mma_16816<T>(acc[j + 1], af, bf[2], bf[3]);
    }
  };
  if constexpr (kDPad > 0) {
#pragma unroll
    for (int kk = 0; kk < kDPad; kk += 16) k_step(kk);
  } else {
    for (int kk = 0; kk < d_pad; kk += 16) k_step(kk);
  }
}

// A head dim fixed at compile time (kD > 0) or read from the arguments (kD = 0).
template <int kD>
__device__ __forceinline__ int head_dim_pad(int runtime_pad) {
  return kD > 0 ? kD : runtime_pad;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A [16 x 64] accumulator as the A operand of four k-steps of 16: the m16n8 C layout of
// n-tiles 2k and 2k + 1 is the m16n8k16 A layout of k-step k.
template <typename T>
__device__ __forceinline__ void acc_to_a_operand(uint32_t (&a)[4][4], const ScoreAcc& acc) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    a[k][0] = pack2<T>(acc[2 * k][0], acc[2 * k][1]);
    a[k][1] = pack2<T>(acc[2 * k][2], acc[2 * k][3]);
    a[k][2] = pack2<T>(acc[2 * k + 1][0], acc[2 * k + 1][1]);
    a[k][3] = pack2<T>(acc[2 * k + 1][2], acc[2 * k + 1][3]);
  }
}

// out[16 x 8 kNTiles] += a[16 x 64] . b[64 x (n0 .. n0 + 8 kNTiles)], with b a shared-memory tile
// stored row-major as [64][stride] (k-major: keys or queries by head dim), read transposed.
template <typename T, int kNTiles>
__device__ __forceinline__ void warp_times_tile(float (&out)[kNTiles][4], const uint32_t (&a)[4][4], const T* b,
                                                int stride, int n0) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int j = 0; j < kNTiles; j += 2) {
      uint32_t bf[4];  // k halves 0 and 1 of n-tile j, then of n-tile j + 1
      ldmatrix_x4_trans(bf, b + (k * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * stride + n0 + j * 8 + (lane >> 4) * 8);
      mma_16816<T>(out[j], a[k], bf[0], bf[1]);
      mma_16816<T>(out[j + 1], a[k], bf[2], bf[3]);
    }
  }
}

// Max over the 4 lanes that share a row.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}


// The one-pass KL states of the two rows a thread holds (rows l/4 and l/4 + 8 of its warp), over
// the thread's own columns (write_rows merges the row's 4 lanes), from unscaled scores.
//
// Sums are kept in base 2 relative to a reference point per row and model (ref_w, ref_o: scaled
// scores times log2 e), not the running max: an entry adds e = 2^x with x = z c log2e - ref, one
// FMA from the raw score z, so the exponentials never wait for a max over the tile (the max, its
// shuffles and the rescale were half of the fold's instructions, and serialized the rest). The
// reference moves only when a tile's exponentials would grow too large: each row checks that the
// tile added at most kTileSumLimit to either sum (and nothing infinite or NaN); if not (the first
// tile, where ref = -inf, always), the row's tile is folded again after moving the reference to
// the tile's max. So every score of a passed tile lies at most log2(kTileSumLimit) above the
// reference, and the saved (max, log_sum) = (reference, log of the sum) stay as exact as with the
// max itself. a is kept as A = sum e_w (x_w - x_o), in which the references' large values cancel.
struct TwoRowKL {
  static constexpr float kTileSumLimit = 4096.f;
  float cl_w, cl_o;  // c log2 e of the weighting and the other model
  float ref_w[2] = {kNegInf<float>, kNegInf<float>}, ref_o[2] = {kNegInf<float>, kNegInf<float>};
  float sum_w[2] = {0.f, 0.f}, sum_o[2] = {0.f, 0.f}, a[2] = {0.f, 0.f};

 private:
  // s if kFirst, else t: the weighting distribution's tile is pick<kReverse>, the other's
  // pick<!kReverse>.
  template <bool kFirst, typename S, typename U>
  __device__ __forceinline__ static const auto& pick(const S& s, const U& t) {
    if constexpr (kFirst) {
      return s;
    } else {
      return t;
    }
  }

  template <int kNTiles, bool kMasked, typename Visible, typename F>
  __device__ __forceinline__ static void for_entries(Visible visible, F f) {
#pragma unroll
    for (int j = 0; j < kNTiles; ++j) {  // unrolled: the tiles are registers
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (kMasked) {
          if (!visible(j, e)) continue;
        }
        f(j, e);
      }
    }
  }

  // The fast path: every (visible) entry's two exponentials and its share of a, relative to the
  // current references. Each row's three sums are one dependency chain apiece.
  template <bool kReverse, bool kMasked, typename S, typename U, typename Visible>
  __device__ __forceinline__ void add(const S& s, const U& t, Visible visible) {
    const auto& zw = pick<kReverse>(s, t);
    const auto& zo = pick<!kReverse>(s, t);
    const float neg_w[2] = {-ref_w[0], -ref_w[1]};
    const float neg_o[2] = {-ref_o[0], -ref_o[1]};
    for_entries<S::kNTiles, kMasked>(visible, [&](int j, int e) {
      const int r = e / 2;
      const float xw = fmaf(zw.at(j, e), cl_w, neg_w[r]);
      const float xo = fmaf(zo.at(j, e), cl_o, neg_o[r]);
      const float ew = exp2_approx(xw);
      sum_w[r] += ew;
      sum_o[r] += exp2_approx(xo);
      a[r] = fmaf(ew, xw - xo, a[r]);
    });
  }

  // Re-expresses row r's sums relative to new references (>= the current ones).
  __device__ __forceinline__ void move_reference(int r, float new_w, float new_o) {
    if (ref_w[r] == kNegInf<float>) {  // nothing added yet (or only to other lanes' columns)
      sum_w[r] = sum_o[r] = a[r] = 0.f;
    } else {
      const float shift_w = new_w - ref_w[r], shift_o = new_o - ref_o[r];
      const float keep_w = exp2_approx(-shift_w);
      a[r] = keep_w * fmaf(-(shift_w - shift_o), sum_w[r], a[r]);
      sum_w[r] *= keep_w;
      sum_o[r] *= exp2_approx(-shift_o);
    }
    ref_w[r] = new_w;
    ref_o[r] = new_o;
  }

 public:
  // c_s, c_t: score = c * z. The distribution w weighting the KL is the teacher's for forward KL
  // and the student's for reverse KL (kReverse); o is the other one.
  template <bool kReverse>
  __device__ __forceinline__ static TwoRowKL make(float c_s, float c_t) {
    TwoRowKL st;
    st.cl_w = (kReverse ? c_s : c_t) * kLog2e;
    st.cl_o = (kReverse ? c_t : c_s) * kLog2e;
    return st;
  }

  // Folds a tile of raw student and teacher scores s, t (kNTiles n-tiles of 8 columns, read with
  // .at(j, e)). kMasked: entries where visible(j, e) is false are skipped.
  template <bool kReverse, bool kMasked, typename S, typename U, typename Visible>
  __device__ __forceinline__ void fold(const S& s, const U& t, Visible visible) {
    static_assert(S::kNTiles == U::kNTiles, "student and teacher tiles differ in width");
    const float before_w[2] = {sum_w[0], sum_w[1]};
    const float before_o[2] = {sum_o[0], sum_o[1]};
    const float before_a[2] = {a[0], a[1]};
    add<kReverse, kMasked>(s, t, visible);
    bool again[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      again[r] = !(sum_w[r] - before_w[r] <= kTileSumLimit && sum_o[r] - before_o[r] <= kTileSumLimit);
    }
    if (again[0] || again[1]) {  // rare after the first tile
      const auto& zw = pick<kReverse>(s, t);
      const auto& zo = pick<!kReverse>(s, t);
      float max_w[2] = {kNegInf<float>, kNegInf<float>};
      float max_o[2] = {kNegInf<float>, kNegInf<float>};
      for_entries<S::kNTiles, kMasked>(visible, [&](int j, int e) {
        max_w[e / 2] = fmaxf(max_w[e / 2], zw.at(j, e) * cl_w);
        max_o[e / 2] = fmaxf(max_o[e / 2], zo.at(j, e) * cl_o);
      });
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!again[r]) continue;
        sum_w[r] = before_w[r];
        sum_o[r] = before_o[r];
        a[r] = before_a[r];
        move_reference(r, fmaxf(ref_w[r], max_w[r]), fmaxf(ref_o[r], max_o[r]));
      }
      add<kReverse, true>(s, t, [&](int j, int e) {
        if constexpr (kMasked) {
          return again[e / 2] && visible(j, e);
        } else {
          return again[e / 2];
        }
      });
    }
  }

  // Writes the losses and statistics of the thread's rows row0 and row0 + 8 of head bh (every
  // lane takes part in the reductions; lane % 4 == 0 writes). Rows that see no key get zeros.
  template <bool kReverse, typename T>
  __device__ __forceinline__ void write_rows(const AttentionArgs<T>& args, int64_t bh, int row0, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      move_reference(r, quad_max(ref_w[r]), quad_max(ref_o[r]));  // the row's 4 lanes alike
      const float total_w = quad_sum(sum_w[r]), total_o = quad_sum(sum_o[r]), total_a = quad_sum(a[r]);
      const int i = row0 + 8 * r;
      if (lane % 4 != 0 || i >= args.n_q) continue;
      const int64_t row = bh * args.n_q + i;
      float* stats = args.row_stats + row * kNumAttentionRowStats;
      if (ref_w[r] == kNegInf<float>) {
        args.loss[row] = 0.f;
        for (int c = 0; c < kNumAttentionRowStats; ++c) stats[c] = 0.f;
        continue;
      }
      KLState<float> kl;
      kl.w = {ref_w[r] * kLn2, total_w};
      kl.o = {ref_o[r] * kLn2, total_o};
      kl.a = fmaf(total_a, kLn2, (kl.w.m - kl.o.m) * total_w);  // sum e_w (w - o), scaled scores
      args.loss[row] = store_kl_row(finish_kl_row(kl, kReverse), stats);
    }
  }
};

// A [16 x 64] score tile of the mma.sync kernels, read as TwoRowKL::fold reads tiles.
struct ScoreTile {
  static constexpr int kNTiles = kColTiles;
  const ScoreAcc& v;
  __device__ __forceinline__ float at(int j, int e) const { return v[j][e]; }
};

// What the backward needs of one query row: its log-normalizers, gradient centre and
// upstream gradient (times dscore/dq and the float16 range scale).
struct GradRow {
  float max_s, log_sum_s, max_t, log_sum_t, center, grad;
};

// dLoss/dscore_s of one visible entry, without the row's upstream gradient (docs/design.md section 5;
// divergence_grad in online_state.h, with fast exponentials: p and q are probabilities).
__device__ __forceinline__ float attention_grad(float s, float t, const GradRow& r, bool reverse) {
  const float p = __expf((s - r.max_s) - r.log_sum_s);
  if (reverse) return p * ((s - t) - r.center);
  return p - __expf((t - r.max_t) - r.log_sum_t);
}

// The backward's per-row data of query i (zeros past the last query, so its dS is 0).
template <typename T>
__device__ __forceinline__ GradRow load_grad_row(const AttentionArgs<T>& a, int64_t bh, int i, float grad_scale) {
  if (i >= a.n_q) return GradRow{0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int64_t row = bh * a.n_q + i;
  const float* st = a.grad_stats + row * kNumAttentionRowStats;
  return GradRow{st[kMaxS], st[kLogSumS], st[kMaxT], st[kLogSumT], st[kGradCenter],
                 a.grad_loss[row] * a.c_s * grad_scale};
}

// 2^e with e chosen so that max|grad_loss| * |c_s| * 2^e lies in (32, 64]: dS is rounded to
// float16 for the tensor cores, and the upstream gradient of a mean over ~1e6 rows times
// probabilities ~1e-5 would otherwise fall below float16's smallest normal. bfloat16 has
// float32's range and needs none (grad_max is null).
__device__ __forceinline__ float dscore_range_scale(const float* grad_max, float c_s) {
  if (grad_max == nullptr) return 1.f;
  const float m = *grad_max * fabsf(c_s);
  if (!(m > 0.f) || !isfinite(m)) return 1.f;
  return exp2f(fminf(fmaxf(6.f - ceilf(log2f(m)), -100.f), 100.f));
}

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
