// The CPU's tile walk over the [N x V] student and teacher logits.
//
// The vocabulary is cut into tiles of `vocab_tile` entries and the rows into chunks of
// `row_tile`; for each (vocab tile, row chunk) the two logit tiles (in float32, or float64 for
// float64 inputs) are written into a buffer that is reused, by the BLAS from the hidden states
// (fused-linear ops) or copied from the caller's logits (logit-level ops), so memory beyond the
// inputs is O(row_tile * vocab_tile), never O(N * V). What each tile becomes is the visitor's (a loss
// family's pass): the walk knows no loss.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>

#include "../numerics.h"

namespace nitrobrew {
namespace cpu {

struct TilePlan {
  int64_t vocab_tile;
  int64_t row_tile;
};

// Default vocabulary tile: wide enough for an efficient GEMM, small enough that a row of
// both logit tiles stays in L1/L2 while it is reduced.
constexpr int64_t kDefaultVocabTile = 1024;
// Upper bound on the elements of one logit tile (per model): 16 MiB of float32.
constexpr int64_t kMaxTileElements = int64_t(1) << 22;

// chunk_v: the vocabulary tile width the caller asked for (0 = automatic).
inline TilePlan plan_tiles(int64_t num_rows, int64_t vocab_size, int64_t chunk_v) {
  TilePlan plan;
  plan.vocab_tile = std::min(chunk_v > 0 ? chunk_v : kDefaultVocabTile, vocab_size);
  plan.row_tile = std::max<int64_t>(1, std::min(num_rows, kMaxTileElements / plan.vocab_tile));
  return plan;
}

// The logits a walk covers: num_rows rows x the first vocab_size entries, each model's logits
// multiplied by its scale and soft-capped (cap <= 0: none): model_logit in numerics.h.
struct WalkShape {
  int64_t num_rows, vocab_size;
  double softcap_s, softcap_t;
  double scale_s = 1.0, scale_t = 1.0;
};

// Sums K series term(v) -> std::array<T, K> over v in [0, count) in kLanes interleaved
// partial sums that are then added pairwise, as the per-thread partials of a GPU block
// reduction are: the rounding error grows with count / kLanes rather than count.
template <typename T, size_t K, typename Term>
std::array<T, K> lane_sums(int64_t count, Term term) {
  constexpr int kLanes = 16;
  std::array<T, K> lanes[kLanes] = {};
  for (int64_t v = 0; v < count; ++v) {
    const std::array<T, K> x = term(v);
    std::array<T, K>& lane = lanes[v % kLanes];
    for (size_t k = 0; k < K; ++k) lane[k] += x[k];
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) {
      for (size_t k = 0; k < K; ++k) lanes[i][k] += lanes[i + width][k];
    }
  }
  return lanes[0];
}

// One (vocab tile, row chunk) block of logits as the visitor sees it.
struct LogitTile {
  int64_t v0, cols;    // vocabulary entries [v0, v0 + cols)
  int64_t r0, rows;    // rows [r0, r0 + rows)
  at::Tensor zs, zt;   // [rows, cols] the models' logits (before the temperature), contiguous
  at::Tensor ws_tile;  // [cols, D_s] student unembedding rows, in the accumulation dtype (products only)
  at::Tensor xs_rows;  // [rows, D_s] student hidden states, in the accumulation dtype (products only)
};

// Where a walk's logit tiles come from. Products: the fused-linear ops' x . w^T (+ bias). xs_acc,
// xt_acc are [N, D] in the accumulation dtype; ws, wt in the input dtype; bias_s, bias_t [V_rows] in
// the accumulation dtype, or undefined for none.
struct ProductTiles {
  const at::Tensor& xs_acc;
  const at::Tensor& xt_acc;
  const at::Tensor& ws;
  const at::Tensor& wt;
  at::Tensor bias_s = {}, bias_t = {};
  at::Tensor ws_tile = {}, wt_tile = {};  // the current vocabulary tile's rows, in the accumulation dtype
  at::Tensor bs_tile = {}, bt_tile = {};

  void begin_vocab_tile(int64_t v0, int64_t cols) {
    ws_tile = ws.narrow(0, v0, cols).to(xs_acc.scalar_type()).contiguous();  // [cols, D_s]
    wt_tile = wt.narrow(0, v0, cols).to(xs_acc.scalar_type()).contiguous();  // [cols, D_t]
    if (bias_s.defined()) bs_tile = bias_s.narrow(0, v0, cols);
    if (bias_t.defined()) bt_tile = bias_t.narrow(0, v0, cols);
  }
  void fill(LogitTile& tile) const {
    tile.ws_tile = ws_tile;
    tile.xs_rows = xs_acc.narrow(0, tile.r0, tile.rows);
    at::mm_out(tile.zs, tile.xs_rows, ws_tile.t());
    at::mm_out(tile.zt, xt_acc.narrow(0, tile.r0, tile.rows), wt_tile.t());
    if (bs_tile.defined()) tile.zs.add_(bs_tile);
    if (bt_tile.defined()) tile.zt.add_(bt_tile);
  }
};

// Logits the caller holds: the logit-level ops' [N, V] zs and zt (any dtype and strides); or the
// training path's stored products x . w^T, with the lm_head biases ([V_rows] in the accumulation dtype,
// undefined for none) added as ProductTiles adds them.
struct GivenTiles {
  const at::Tensor& zs;
  const at::Tensor& zt;
  at::Tensor bias_s = {}, bias_t = {};

  void begin_vocab_tile(int64_t, int64_t) {}
  void fill(LogitTile& tile) const {
    tile.zs.copy_(zs.narrow(0, tile.r0, tile.rows).narrow(1, tile.v0, tile.cols));
    tile.zt.copy_(zt.narrow(0, tile.r0, tile.rows).narrow(1, tile.v0, tile.cols));
    if (bias_s.defined()) tile.zs.add_(bias_s.narrow(0, tile.v0, tile.cols));
    if (bias_t.defined()) tile.zt.add_(bias_t.narrow(0, tile.v0, tile.cols));
  }
};

// Calls, in this order:
//   visitor.begin_vocab_tile(v0, cols)
//   visitor.visit_row(n, v, zs_row, zt_row)   for every row n of a chunk, in parallel
//   visitor.end_row_chunk(tile)                once the chunk's rows are visited
//   visitor.end_vocab_tile(v0, cols)
// with the tiles that `source` (ProductTiles or GivenTiles) fills, in the accumulation dtype acc_t.
template <typename acc_t, typename Source, typename Visitor>
void walk_logit_tiles(Source& source, const WalkShape& p, const TilePlan& plan,
                      const at::TensorOptions& acc_options, Visitor& visitor) {
  const int64_t n_rows = p.num_rows;
  if (n_rows == 0) return;
  at::Tensor zs_buffer = at::empty({plan.row_tile * plan.vocab_tile}, acc_options);
  at::Tensor zt_buffer = at::empty({plan.row_tile * plan.vocab_tile}, acc_options);
  const acc_t cap_s = static_cast<acc_t>(p.softcap_s), scale_s = static_cast<acc_t>(p.scale_s);
  const acc_t cap_t = static_cast<acc_t>(p.softcap_t), scale_t = static_cast<acc_t>(p.scale_t);

  for (int64_t v0 = 0; v0 < p.vocab_size; v0 += plan.vocab_tile) {
    const int64_t cols = std::min(plan.vocab_tile, p.vocab_size - v0);
    source.begin_vocab_tile(v0, cols);
    visitor.begin_vocab_tile(v0, cols);
    for (int64_t r0 = 0; r0 < n_rows; r0 += plan.row_tile) {
      const int64_t rows = std::min(plan.row_tile, n_rows - r0);
      LogitTile tile{v0, cols, r0, rows,
                     zs_buffer.narrow(0, 0, rows * cols).view({rows, cols}),
                     zt_buffer.narrow(0, 0, rows * cols).view({rows, cols})};
      source.fill(tile);
      acc_t* zs = tile.zs.data_ptr<acc_t>();
      acc_t* zt = tile.zt.data_ptr<acc_t>();
      at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          acc_t* zs_row = zs + r * cols;
          acc_t* zt_row = zt + r * cols;
          if (cap_s > acc_t(0) || scale_s != acc_t(1)) {
            for (int64_t v = 0; v < cols; ++v) zs_row[v] = model_logit(zs_row[v], scale_s, cap_s);
          }
          if (cap_t > acc_t(0) || scale_t != acc_t(1)) {
            for (int64_t v = 0; v < cols; ++v) zt_row[v] = model_logit(zt_row[v], scale_t, cap_t);
          }
          visitor.visit_row(r0 + r, v0, cols, zs_row, zt_row);
        }
      });
      visitor.end_row_chunk(tile);
    }
    visitor.end_vocab_tile(v0, cols);
  }
}

}  // namespace cpu
}  // namespace nitrobrew
