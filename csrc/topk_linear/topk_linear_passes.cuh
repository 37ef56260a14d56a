// Passes over the student's logit tiles alone (kStudentOnly: the kernels skip the teacher's
// product), for the top-K teacher loss from hidden states (topk_linear_cuda.cu), whose teacher is
// K log-probabilities rather than a matrix:
//   StudentNormPass  forward: the online softmax state of s = z / tau per row and split, merged
//                    by the caller into the student's log-normalizer over the vocabulary, and
//                    the logits at the teacher's K ids picked from the tiles (IdPicker);
//   StudentGradPass  backward: the dense part of dLoss/dz, coef[n] * p_v / tau, into a
//                    [N x chunk] buffer (the caller then writes the K ids' entries).
#pragma once

#include <cstdint>

#include "../divergence/online_state.h"
#include "../engine/cuda/tile_fold.cuh"
#include "../engine/cuda/vocab_walk.cuh"
#include "../fused_linear/fused_linear_args.cuh"

namespace nitrobrew {
namespace cuda {

// Picks the student's logits at the teacher's K ids out of the tiles a pass sees (the top-K
// forward, normalize="full"), instead of gathering K rows of ws per token: at K = 512 and
// N = 8192 that gather read 30 GB. The picked logits are also the very values the tiles' log-normalizer
// and the backward's recompute see. Each row's ids, sorted, are read in step with its block's walk
// over consecutive tiles; the thread whose fragment holds an id's entry writes it to
// picked[n, k] at the id's position k (a repeated id is picked at each of its positions).
struct IdPicker {
  const int64_t* sorted;  // [N, K]: each row's ids, ascending
  const int64_t* order;   // [N, K]: the position k in the row of each sorted id
  float* picked;          // [N, K]; nullptr: pick nothing
  int64_t k;
  int64_t pos[2] = {-1, -1};           // the rows' next sorted id (-1: not looked up yet)
  int64_t next[2] = {INT64_MAX, INT64_MAX};  // that id, or INT64_MAX past the row's last

  template <int kI, typename Tile>
  __device__ __forceinline__ void pick_row(const FragmentRows& rows, int64_t v0, const Tile& z) {
    constexpr int kCols = 8 * Tile::kNTiles;
    if (!rows.valid[kI]) return;  // rows past N and ignored rows keep the caller's zeros
    const int64_t* ids = sorted + rows.row[kI] * k;
    if (pos[kI] < 0) {  // the block's first tile: the row's first id >= v0
      int64_t lo = 0, hi = k;
      while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (ids[mid] < v0) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      pos[kI] = lo;
      next[kI] = lo < k ? ids[lo] : INT64_MAX;
    }
    while (next[kI] < v0 + kCols) {
      const int64_t c = next[kI] - v0;  // >= 0: the block's tiles are consecutive
      if (c >= 0 && static_cast<int>((c >> 1) & 3) == static_cast<int>(threadIdx.x % 4)) {
        const int64_t at = rows.row[kI] * k;
        picked[at + order[at + pos[kI]]] = fragment_entry<kI>(z, static_cast<int>(c >> 3), static_cast<int>(c & 1));
      }
      ++pos[kI];
      next[kI] = pos[kI] < k ? ids[pos[kI]] : INT64_MAX;
    }
  }

  template <typename Tile>
  __device__ __forceinline__ void pick(const FragmentRows& rows, int64_t v0, const Tile& z) {
    if (picked == nullptr) return;
    pick_row<0>(rows, v0, z);
    pick_row<1>(rows, v0, z);
  }
};

// The sums are float64: the loss takes this log-normalizer times the teacher's kept mass, and with
// float32 sums (and a float32 log) the loss at logit scales ~1e-3 was off by 14x float32 PyTorch's
// error; float64 sums brought it to 4x, and float64 exponentials for float32 inputs (whose products
// run on CUDA cores, D FMAs per entry) the rest of the way. 16-bit inputs keep the fast float32
// exponential.
template <typename T>
struct StudentNormPass {
  using Args = FusedLinearArgs<T>;
  static constexpr bool kStudentOnly = true;
  struct Params {
    double* partial;  // [splits, N, 2]: (max, sum relative to it)
    // The teacher's ids, each row sorted, with their positions, and the [N, K] logits picked at
    // them (IdPicker; picked may be nullptr).
    const int64_t* sorted_ids;
    const int64_t* id_order;
    float* picked;
    int64_t k;
  };
  Params p;
  SoftmaxState<double> st[2];
  IdPicker picker;

  __device__ __forceinline__ StudentNormPass(const FusedLinearArgs<T>&, const FragmentRows&, const Params& params)
      : p(params), picker{params.sorted_ids, params.id_order, params.picked, params.k} {}

  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT&) {
    constexpr int kN = ZS::kNTiles;
    const float inv_t = a.inv_temperature;
    picker.pick(rows, v0, zs);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
      float max_z = -INFINITY;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) < a.vocab_size) max_z = fmaxf(max_z, zs.at(j, 2 * i + e));
        }
      }
      if (max_z == -INFINITY) continue;  // no vocabulary entry of this tile in this thread's columns
      const float m = scale_logit(max_z, inv_t);
      double sum = 0.0;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (v0 + fragment_col(j, e) < a.vocab_size) {
            const float x = scale_logit(zs.at(j, 2 * i + e), inv_t) - m;
            if constexpr (std::is_same_v<T, float>) {
              sum += exp(static_cast<double>(x));  // beside an entry's D CUDA-core FMAs, a float64 exp is cheap
            } else {
              sum += static_cast<double>(PassExp<T>{}(x));
            }
          }
        }
      }
      merge(st[i], SoftmaxState<double>{m, sum});
    }
  }

  // A tile inside the vocabulary can be folded later, in kTilePieces pieces while the next tile's
  // product runs (the sm_90a kernel parks it; engine/cuda/vocab_walk.cuh): the same operations in the same
  // order as tile(), so the results are bitwise equal. The top-K forward took 9% less time so at
  // N = 8192 on the Qwen shape (H100; docs/notes/topk_linear.md): a student-only pass has no teacher
  // product to fold behind, and its fold left the tensor cores idle.
  static constexpr int kTilePieces = 2 * kMaxPieces + 1;  // maxima, 1 to finish them, sums
  float piece_max[2], piece_m[2];
  double piece_sum[2];

  __device__ __forceinline__ bool folds_later(const FusedLinearArgs<T>& a, int64_t v0, int cols) const {
    return v0 + cols <= a.vocab_size;
  }

  template <typename ZS>
  __device__ __forceinline__ void tile_piece(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                             int piece, const ZS& zs) {
    if (piece < kMaxPieces) {
      row_max_piece(zs, piece, piece_max);
    } else if (piece == kMaxPieces) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        piece_m[i] = scale_logit(piece_max[i], a.inv_temperature);
        piece_sum[i] = 0.0;
      }
    } else if (piece < kTilePieces) {
      const int j0 = 2 * (piece - kMaxPieces - 1);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float x = scale_logit(zs.at(j0 + jj, 2 * i + e), a.inv_temperature) - piece_m[i];
            if constexpr (std::is_same_v<T, float>) {
              piece_sum[i] += exp(static_cast<double>(x));
            } else {
              piece_sum[i] += static_cast<double>(PassExp<T>{}(x));
            }
          }
        }
      }
      if (piece == kTilePieces - 1) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (rows.valid[i] && piece_max[i] != -INFINITY) merge(st[i], SoftmaxState<double>{piece_m[i], piece_sum[i]});
        }
        picker.pick(rows, v0, zs);
      }
    }
  }

  __device__ __forceinline__ void finish(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t split) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
#pragma unroll
      for (int mask = 1; mask <= 2; mask <<= 1) {  // the quad's four lanes hold the same rows
        merge(st[i], SoftmaxState<double>{__shfl_xor_sync(0xffffffffu, st[i].m, mask),
                                          __shfl_xor_sync(0xffffffffu, st[i].l, mask)});
      }
      if (rows.valid[i] && threadIdx.x % 4 == 0) {
        double* out = p.partial + (split * a.n_rows + rows.row[i]) * 2;
        out[0] = st[i].m;
        out[1] = st[i].l;
      }
    }
  }
};

// Columns of StudentGradPass's per-row input.
enum StudentGradRow : int { kGradRowMax = 0, kGradRowLogSum, kGradRowCoef, kNumStudentGradRow };

template <typename T>
struct StudentGradPass {
  using Args = FusedLinearArgs<T>;
  static constexpr bool kStudentOnly = true;
  struct Params {
    const float* rows;  // [N, kNumStudentGradRow]: the student's log-normalizer and the dense coefficient
    GradChunk<T> chunk;
  };
  Params p;

  __device__ __forceinline__ StudentGradPass(const FusedLinearArgs<T>&, const FragmentRows&, const Params& params)
      : p(params) {}

  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT&) {
    constexpr int kN = ZS::kNTiles;
    const float inv_t = a.inv_temperature;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (rows.row[i] >= a.n_rows) continue;
      const float* row = p.rows + rows.row[i] * kNumStudentGradRow;
      const LogNormalizer<float> norm{row[kGradRowMax], row[kGradRowLogSum]};
      // A row without a dense part (masked, no teacher mass, or renormalized over the K ids) gets
      // zeros; its normalizer may be a placeholder, so no exponential is evaluated.
      const float coef = rows.valid[i] ? row[kGradRowCoef] * inv_t : 0.f;
#pragma unroll
      for (int j = 0; j < kN; ++j) {
        const int64_t col = v0 + fragment_col(j, 0);  // even, as are chunk_begin and ld
        float dz[2] = {0.f, 0.f};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (coef != 0.f && col + e < a.vocab_size) {
            dz[e] = coef * PassExp<T>{}(log_prob(scale_logit(zs.at(j, 2 * i + e), inv_t), norm));
          }
        }
        p.chunk.store(rows.row[i], col, dz);
      }
    }
  }

  // A tile inside the vocabulary and the chunk can be written later, in kTilePieces pieces while
  // the next tile's product runs (as StudentNormPass's); the same values as tile().
  static constexpr int kTilePieces = 16;  // two n-tiles each
  LogNormalizer<float> piece_norm[2];
  float piece_coef[2];

  __device__ __forceinline__ bool folds_later(const FusedLinearArgs<T>& a, int64_t v0, int cols) const {
    return v0 + cols <= a.vocab_size && v0 + cols <= p.chunk.end();
  }

  template <typename ZS>
  __device__ __forceinline__ void tile_piece(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                             int piece, const ZS& zs) {
    static_assert(ZS::kNTiles == 2 * kTilePieces, "two n-tiles per piece");
    const float inv_t = a.inv_temperature;
    if (piece == 0) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float* row = p.rows + (rows.row[i] < a.n_rows ? rows.row[i] : 0) * kNumStudentGradRow;
        piece_norm[i] = {row[kGradRowMax], row[kGradRowLogSum]};
        piece_coef[i] = rows.valid[i] ? row[kGradRowCoef] * inv_t : 0.f;
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (rows.row[i] >= a.n_rows) continue;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const int j = 2 * piece + jj;
        const int64_t col = v0 + fragment_col(j, 0);
        float dz[2] = {0.f, 0.f};
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (piece_coef[i] != 0.f) {
            dz[e] = piece_coef[i] * PassExp<T>{}(log_prob(scale_logit(zs.at(j, 2 * i + e), inv_t), piece_norm[i]));
          }
        }
        p.chunk.template store<true>(rows.row[i], col, dz);
      }
    }
  }

  __device__ __forceinline__ void finish(const FusedLinearArgs<T>&, const FragmentRows&, int64_t) {}
};

}  // namespace cuda
}  // namespace nitrobrew
