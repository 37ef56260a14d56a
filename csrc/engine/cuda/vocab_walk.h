// Host interface of the vocabulary walk (vocab_walk.cuh, which defines LaunchPlan and launch):
// usable from host-only sources.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "arch.h"

namespace nitrobrew {
namespace cuda {

struct LaunchPlan;

// Vocabulary chunks of a backward start at multiples of this (a whole number of tiles of either
// kernel family).
constexpr int64_t kGradChunkAlign = 768;

// Rows must be unit-stride for the tile loads; anything else is copied once (O(rows x D)).
inline at::Tensor unit_stride_rows(const at::Tensor& t) {
  return t.stride(1) == 1 && t.stride(0) >= t.size(1) ? t : t.contiguous();
}

// The walk over the first vocab_size rows of ws and wt for xs, xt (unit-stride rows; a
// student-only pass passes xs, ws twice): picks the kernel family for these inputs on the current
// device and plans the vocabulary splits.
class VocabWalk {
 public:
  VocabWalk(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt, int64_t num_rows,
            int64_t vocab_size);

  KernelPath path() const { return path_; }
  // How many vocabulary splits the forward passes use: the rows of their partial results.
  int64_t forward_splits() const { return forward_splits_; }
  // The plan of a forward pass over the whole vocabulary.
  LaunchPlan forward_plan() const;
  // The plan of a backward pass over vocabulary entries [chunk_begin, chunk_begin + chunk_cols)
  // into grad_chunk ([N, >= chunk_cols], row-major; chunk_begin a multiple of kGradChunkAlign).
  LaunchPlan grad_plan(int64_t chunk_begin, int64_t chunk_cols, const at::Tensor& grad_chunk) const;
  // The width of the backward's vocabulary chunks, a multiple of kGradChunkAlign and at most
  // max_cols (grad_chunk_cap): the one whose gradient-pass launches leave the fewest SMs idle
  // over the whole vocabulary. (A development build's NITROBREW_GRAD_CHUNK_COLS overrides both.)
  int64_t grad_chunk_cols(int64_t max_cols) const;

  // Runs Pass over the plan's tiles on the current stream.
  template <typename T, typename Pass>
  void launch(const typename Pass::Args& a, const LaunchPlan& plan, const typename Pass::Params& params) const;

 private:
  at::Tensor xs_, xt_, ws_, wt_;
  int64_t num_rows_, vocab_size_;
  KernelPath path_;
  bool vectorized_;  // mma.sync path: 16-byte cp.async loads
  int64_t tile_cols_, forward_tiles_per_split_, forward_splits_;
};

}  // namespace cuda
}  // namespace nitrobrew
