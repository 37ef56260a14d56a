// topk_logprobs' pass over the vocabulary walk (engine/cuda/vocab_walk.cuh; the design in
// docs/notes/topk_logprobs.md): the model's logit tiles alone (kStudentOnly: its x and w are passed as the
// student's), folded into each row's online log-sum-exp and entropy sums, with every entry at or above the row's
// threshold tau appended to the row's candidate list in global memory, as an order key (topk_rows::order_key).
// The caller picks tau from a sample of the vocabulary, so that each row's k best are among its candidates, and
// checks that they are (the list neither short of k nor past its capacity) before selecting them
// (topk_candidates_kernel.cuh).
//
// The sums are those of topk_rows_kernel.cuh: the thread's running maximum m of s = logit / temperature, the
// sums of 2^d and 2^d d with d = (s - m) log2 e, a tile's in float, the running ones in double. d is not
// clamped, so that a NaN or +inf logit, or a -inf one, makes the sums NaN: the caller's check then sends the row
// to the row kernel's path, which keeps the non-finite rule (docs/design.md section 7).
#pragma once

#include <cstdint>

#include "../engine/cuda/fast_math.cuh"
#include "../engine/cuda/tile_fold.cuh"
#include "../engine/cuda/vocab_walk.cuh"
#include "../fused_linear/fused_linear_args.cuh"
#include "topk_order.cuh"
#include "topk_walk_launch.h"

namespace nitrobrew {
namespace cuda {

template <typename T>
struct TopKWalkPass {
  using Args = FusedLinearArgs<T>;
  static constexpr bool kStudentOnly = true;
  struct Params {
    double* partial;   // [splits, N, kNumTopKWalkSums]: (max, sum of exp(s - max), sum of exp(s - max) (s - max))
    const float* tau;  // [N]: the threshold of each row's candidates
    int32_t* count;    // [N], zeroed: the row's candidates (those past cap are counted, not stored)
    uint64_t* keys;    // [N, cap]
    int64_t cap;
  };
  Params p;
  float m[2], tau[2];
  double sum[2], centered2[2];
  // The tile being folded (tile_piece): its maxima, float sums and the entries that pass tau (bit 2 j + e).
  float tile_max[2], tile_sum[2], tile_centered2[2];
  uint64_t passed[2];

  __device__ __forceinline__ TopKWalkPass(const Args&, const FragmentRows& rows, const Params& params) : p(params) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m[i] = kNegInf<float>;
      sum[i] = centered2[i] = 0.0;
      tau[i] = rows.valid[i] ? params.tau[rows.row[i]] : INFINITY;
    }
  }

  // The running maximum to the tile's (raw) maximum, the sums rescaled to it; the tile's sums cleared.
  __device__ __forceinline__ void begin_tile(int i, float raw_max, float inv_t) {
    const float tm = scale_logit(raw_max, inv_t);
    if (tm > m[i]) {  // rare after the first tiles
      if (m[i] != kNegInf<float>) {
        const float d = (m[i] - tm) * kLog2e, f = exp2_approx(d);
        centered2[i] = f * (centered2[i] + d * sum[i]);
        sum[i] *= f;
      }
      m[i] = tm;
    }
    tile_sum[i] = tile_centered2[i] = 0.f;
    passed[i] = 0;
  }

  // One entry (raw logit z, fragment bit 2 j + e) of row i.
  __device__ __forceinline__ void entry(int i, float z, int bit, float inv_t) {
    const float s = scale_logit(z, inv_t);
    // s - m first: exact for nearby values (topk_rows_kernel.cuh)
    const float d = (s - m[i]) * kLog2e, e = exp2_approx(d);
    tile_sum[i] += e;
    tile_centered2[i] = fmaf(e, d, tile_centered2[i]);
    passed[i] |= uint64_t(s >= tau[i]) << bit;
  }

  __device__ __forceinline__ void end_tile(int i) {
    sum[i] += tile_sum[i];
    centered2[i] += tile_centered2[i];
  }

  // Row kI's passing entries of the tile at v0 to the row's list: one atomic on its counter per quad (the four
  // lanes holding the row), each lane's entries after those of the lanes before it.
  template <int kI, typename Tile>
  __device__ __forceinline__ void append_row(const FragmentRows& rows, int64_t v0, const Tile& z, float inv_t) {
    const int quad_lane = threadIdx.x % 4;
    uint64_t bits = rows.valid[kI] ? passed[kI] : 0;
    const int n = __popcll(bits);
    int inclusive = n;
#pragma unroll
    for (int step = 1; step < 4; step <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, inclusive, step, 4);
      if (quad_lane >= step) inclusive += other;
    }
    const int total = __shfl_sync(0xffffffffu, inclusive, 3, 4);
    int slot = 0;
    if (quad_lane == 0 && total > 0) slot = atomicAdd(p.count + rows.row[kI], total);
    slot = __shfl_sync(0xffffffffu, slot, 0, 4) + inclusive - n;
    uint64_t* keys = p.keys + rows.row[kI] * p.cap;
    while (bits != 0) {
      const int bit = __ffsll(static_cast<long long>(bits)) - 1;
      bits &= bits - 1;
      if (slot < p.cap) {
        const int j = bit >> 1, e = bit & 1;
        const float s = scale_logit(fragment_entry<kI>(z, j, e), inv_t);
        // + 0: -0.0 becomes +0.0, which it ties with (the keys are bits)
        keys[slot] = topk_rows::order_key(s + 0.f, static_cast<int32_t>(v0 + fragment_col(j, e)));
      }
      ++slot;
    }
  }

  template <typename Tile>
  __device__ __forceinline__ void append(const FragmentRows& rows, int64_t v0, const Tile& z, float inv_t) {
    append_row<0>(rows, v0, z, inv_t);
    append_row<1>(rows, v0, z, inv_t);
  }

  // A tile at once (the sm_80 kernels; the sm_90a kernel's tile past the vocabulary's end).
  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const Args& a, const FragmentRows& rows, int64_t v0, const ZS& z, const ZT&) {
    constexpr int kN = ZS::kNTiles;
    static_assert(2 * kN <= 64, "a fragment row's entries fit one 64-bit mask");
    const float inv_t = a.inv_temperature;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
      float raw_max = kNegInf<float>;
      bool any = false;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) < a.vocab_size) {
            raw_max = fmaxf(raw_max, z.at(j, 2 * i + e));
            any = true;
          }
        }
      }
      begin_tile(i, raw_max, inv_t);
      if (!any) continue;  // this thread's columns of the tile lie past the vocabulary
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) < a.vocab_size) entry(i, z.at(j, 2 * i + e), 2 * j + e, inv_t);
        }
      }
      end_tile(i);
    }
    append(rows, v0, z, inv_t);
  }

  // A tile inside the vocabulary is folded while the next tile's product runs (the sm_90a kernel parks it;
  // StudentNormPass's scheme, topk_linear_passes.cuh): maxima, one piece to rescale, then sums two n-tiles a piece,
  // the last piece appending the candidates. The same operations in the same order as tile().
  static constexpr int kTilePieces = 2 * kMaxPieces + 1;

  __device__ __forceinline__ bool folds_later(const Args& a, int64_t v0, int cols) const {
    return v0 + cols <= a.vocab_size;
  }

  template <typename ZS>
  __device__ __forceinline__ void tile_piece(const Args& a, const FragmentRows& rows, int64_t v0, int piece,
                                             const ZS& z) {
    const float inv_t = a.inv_temperature;
    if (piece < kMaxPieces) {
      row_max_piece(z, piece, tile_max);
    } else if (piece == kMaxPieces) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (rows.valid[i]) begin_tile(i, tile_max[i], inv_t);
      }
    } else {
      const int j0 = 2 * (piece - kMaxPieces - 1);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if (!rows.valid[i]) continue;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) entry(i, z.at(j0 + jj, 2 * i + e), 2 * (j0 + jj) + e, inv_t);
        }
      }
      if (piece == kTilePieces - 1) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (rows.valid[i]) end_tile(i);
        }
        append(rows, v0, z, inv_t);
      }
    }
  }

  // The quad's sums merged (its four lanes hold the same rows) and written as this split's.
  __device__ __forceinline__ void finish(const Args& a, const FragmentRows& rows, int64_t split) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // A NaN sum (a non-finite logit) is kept by the merges through a NaN maximum: merge() drops a state whose
      // maximum is -inf, as a thread whose entries were all NaN or -inf has.
      const bool undefined = isnan(sum[i]) || isnan(centered2[i]);
      topk_rows::RowSums s{undefined ? NAN : m[i], sum[i], centered2[i] * kLn2};
#pragma unroll
      for (int mask = 1; mask <= 2; mask <<= 1) {
        const topk_rows::RowSums other{__shfl_xor_sync(0xffffffffu, s.max, mask),
                                       __shfl_xor_sync(0xffffffffu, s.sum, mask),
                                       __shfl_xor_sync(0xffffffffu, s.centered, mask)};
        s = topk_rows::merge(s, other);
      }
      if (rows.valid[i] && threadIdx.x % 4 == 0) {
        double* out = p.partial + (split * a.n_rows + rows.row[i]) * kNumTopKWalkSums;
        out[kWalkMax] = s.max;
        out[kWalkSum] = s.sum;
        out[kWalkCentered] = s.centered;
      }
    }
  }
};

}  // namespace cuda
}  // namespace nitrobrew
