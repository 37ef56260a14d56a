// Passes over the student's logit tiles alone (kStudentOnly: the kernels skip the teacher's
// product), for the top-K teacher loss from hidden states (topk_linear_cuda.cu), whose teacher is
// K log-probabilities rather than a matrix:
//   StudentNormPass  forward: the online softmax state of s = z / tau per row and split, merged
//                    by the caller into the student's log-normalizer over the vocabulary;
//   StudentGradPass  backward: the dense part of dLoss/dz, coef[n] * p_v / tau, into a
//                    [N x chunk] buffer (the caller then writes the K ids' entries).
#pragma once

#include "fused_linear_passes.cuh"

namespace nitrobrew {
namespace cuda {

// The sums are float64: the loss takes this log-normalizer times the teacher's kept mass, and with
// float32 sums (and a float32 log) the loss at logit scales ~1e-3 was off by 14x float32 PyTorch's
// error; float64 sums brought it to 4x, and float64 exponentials for float32 inputs (whose products
// run on CUDA cores, D FMAs per entry) the rest of the way. 16-bit inputs keep the fast float32
// exponential: a tile's fold is a few hundred cycles against its tensor-core products' ~60k.
template <typename T>
struct StudentNormPass {
  static constexpr bool kStudentOnly = true;
  struct Params {
    double* partial;  // [splits, N, 2]: (max, sum relative to it)
  };
  Params p;
  SoftmaxState<double> st[2];

  __device__ __forceinline__ StudentNormPass(const FusedLinearArgs<T>&, const FragmentRows&, const Params& params)
      : p(params) {}

  template <typename ZS, typename ZT>
  __device__ __forceinline__ void tile(const FusedLinearArgs<T>& a, const FragmentRows& rows, int64_t v0,
                                       const ZS& zs, const ZT&) {
    constexpr int kN = ZS::kNTiles;
    const float inv_t = a.inv_temperature;
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

  __device__ __forceinline__ void finish(const FusedLinearArgs<T>&, const FragmentRows&, int64_t) {}
};

}  // namespace cuda
}  // namespace nitrobrew
