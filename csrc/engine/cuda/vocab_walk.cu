// Host side of the vocabulary walk (vocab_walk.cuh): the kernel family for the inputs and device,
// and the plan of vocabulary splits.
#include "vocab_walk.cuh"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>

namespace nitrobrew {
namespace cuda {
namespace {

// Row blocks that the sm_90a kernel's concurrently running blocks share (see BlockOrder):
// 8 x 128 rows of X (~18 MB at D = 8704) stay in L2 while W streams past them.
constexpr int64_t kGroupRowBlocks = 8;
// The gradient pass's blocks have no state to carry across tiles, so its launches are cut into
// at least this many vocabulary splits, and the blocks running together (one per SM) cover
// SMs / kGradMinSplits row blocks x kGradMinSplits splits: ~11 x 12 tiles, whose X rows and W
// tiles each come from DRAM once and are shared through L2. With every row block in flight at
// once (2 splits at N = 8192, 1 at 16384) X came from DRAM at every tile, and the pass took
// 98.8 ms at N = 16384 against 68.7 ms so (docs/notes/fused_linear_backward.md). The forward's KL pass
// gained nothing from it, so it keeps its plan.
constexpr int64_t kGradMinSplits = 12;

KernelPath choose_path(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt) {
  const bool half = xs.scalar_type() == at::kBFloat16 || xs.scalar_type() == at::kHalf;
  if (!half || !(tma_addressable(xs) && tma_addressable(xt) && tma_addressable(ws) && tma_addressable(wt))) {
    return KernelPath::kMmaSync;
  }
  return use_sm90a_kernels() ? KernelPath::kWgmma : KernelPath::kMmaSync;
}

// mma.sync path: blocks are small (several per SM), so enough splits for ~8 waves of them.
int64_t mma_tiles_per_split(int64_t row_tiles, int64_t vocab_tiles) {
  const int64_t target_blocks = int64_t(multiprocessor_count()) * 8;
  const int64_t splits = std::max<int64_t>(1, std::min(vocab_tiles, (target_blocks + row_tiles - 1) / row_tiles));
  return (vocab_tiles + splits - 1) / splits;
}

// wgmma path: one block per SM, so the split count (at least min_splits) is picked to balance
// the waves: it minimizes (waves of blocks) x (tiles per block + a block's small fixed cost).
struct WgmmaSplit {
  int64_t tiles_per_split, waves;
};
WgmmaSplit wgmma_split(int64_t row_blocks, int64_t vocab_tiles, int64_t min_splits, int64_t sms) {
  min_splits = std::min(min_splits, vocab_tiles);
  WgmmaSplit best{1, 0};
  double best_cost = 1e300;
  for (int64_t per = 1; per <= vocab_tiles; ++per) {
    const int64_t splits = (vocab_tiles + per - 1) / per;
    if (splits < min_splits) break;  // fewer splits for every larger per
    if (per > 1 && (vocab_tiles + per - 2) / (per - 1) == splits) continue;  // same split count, more tiles
    const int64_t waves = (row_blocks * splits + sms - 1) / sms;
    const double cost = double(waves) * (double(per) + 0.05);
    if (cost < best_cost) {
      best_cost = cost;
      best = {per, waves};
    }
  }
  return best;
}

// Splits tiles [first, end) for `rows` rows the way the path's blocks want them; the gradient
// pass's plan (for_grad) groups its blocks as kGradMinSplits says.
LaunchPlan plan_for(KernelPath path, int64_t rows, int64_t first, int64_t end, bool for_grad) {
  const int64_t tiles = std::max<int64_t>(end - first, 1);
  rows = std::max<int64_t>(rows, 1);  // an empty batch launches nothing, but is planned
  const int64_t min_splits = for_grad ? kGradMinSplits : 1, sms = multiprocessor_count();
  const int64_t group = for_grad ? std::max<int64_t>(1, sms / kGradMinSplits) : kGroupRowBlocks;
  const int64_t row_blocks = (rows + hopper::kRows - 1) / hopper::kRows;
  const int64_t per = path == KernelPath::kWgmma ? wgmma_split(row_blocks, tiles, min_splits, sms).tiles_per_split
                                                 : mma_tiles_per_split((rows + kTileRows - 1) / kTileRows, tiles);
  return {VocabSchedule{first, end, per}, (tiles + per - 1) / per, group};
}

// 16-byte cp.async needs every row start 16-byte aligned and K a multiple of 16 bytes.
bool vectorizable(const at::Tensor& t) {
  const int64_t bytes = t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && (t.stride(0) * bytes) % 16 == 0 &&
         (t.size(1) * bytes) % 16 == 0;
}

}  // namespace

VocabWalk::VocabWalk(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt,
                     int64_t num_rows, int64_t vocab_size)
    : xs_(xs), xt_(xt), ws_(ws), wt_(wt), num_rows_(num_rows), vocab_size_(vocab_size) {
  path_ = choose_path(xs, xt, ws, wt);
  vectorized_ = vectorizable(xs) && vectorizable(xt) && vectorizable(ws) && vectorizable(wt);
  tile_cols_ = path_ == KernelPath::kWgmma ? hopper::kCols : kTileCols;
  const int64_t vocab_tiles = (vocab_size + tile_cols_ - 1) / tile_cols_;
  const LaunchPlan plan = plan_for(path_, num_rows, 0, vocab_tiles, /*for_grad=*/false);
  forward_tiles_per_split_ = plan.sched.tiles_per_split;
  forward_splits_ = plan.splits;
}

LaunchPlan VocabWalk::forward_plan() const {
  const int64_t tiles = (vocab_size_ + tile_cols_ - 1) / tile_cols_;
  return LaunchPlan{VocabSchedule{0, tiles, forward_tiles_per_split_}, forward_splits_, kGroupRowBlocks};
}

int64_t VocabWalk::grad_chunk_cols(int64_t max_cols) const {
  max_cols = std::max(kGradChunkAlign, max_cols / kGradChunkAlign * kGradChunkAlign);
#ifdef NITROBREW_DEV_KNOBS
  // Development builds only (docs/development.md): a fixed width, for A/B runs of the choice below.
  if (const char* env = std::getenv("NITROBREW_GRAD_CHUNK_COLS")) {
    const int64_t cols = std::atoll(env);
    if (cols > 0) return std::max(kGradChunkAlign, cols / kGradChunkAlign * kGradChunkAlign);
  }
#endif
  if (path_ != KernelPath::kWgmma || num_rows_ == 0) return max_cols;
  // Every width from max_cols down to half of it, costed as the SM time its launches hold (their
  // waves x tiles per block, idle SMs included) plus a launch's fixed cost (its gaps, the cuBLAS
  // products' start). E.g. at N = 8192 on 132 SMs, 64 row blocks x 33 tiles (8448 columns) are 16
  // whole waves, and 33 tiles divide the Qwen vocabulary 18 times, where 48 tiles (the budget's
  // 12288 columns) ended each launch in a wave 82% full: forward + backward ran 1.3-4.6% faster so
  // (H100, Qwen and Llama-3 shapes; docs/notes/fused_linear_backward.md).
  constexpr double kLaunchCost = 0.1;  // in tile times (a tile: ~100 us on an H100 at D = 8704)
  const int64_t row_blocks = (num_rows_ + hopper::kRows - 1) / hopper::kRows, sms = multiprocessor_count();
  int64_t best = max_cols;
  double best_cost = 1e300;
  for (int64_t cols = max_cols; cols >= std::max(kGradChunkAlign, max_cols / 2); cols -= kGradChunkAlign) {
    double cost = 0;
    for (int64_t c0 = 0; c0 < vocab_size_; c0 += cols) {
      const int64_t tiles = (std::min(cols, vocab_size_ - c0) + tile_cols_ - 1) / tile_cols_;
      const WgmmaSplit split = wgmma_split(row_blocks, tiles, kGradMinSplits, sms);
      cost += double(split.waves * split.tiles_per_split) + kLaunchCost;
    }
    if (cost < best_cost - 1e-9) {  // ties keep the wider chunk: fewer launches
      best_cost = cost;
      best = cols;
    }
  }
  return best;
}

LaunchPlan VocabWalk::grad_plan(int64_t chunk_begin, int64_t chunk_cols, const at::Tensor& grad_chunk) const {
  const int64_t rows = num_rows_, tile_cols = tile_cols_;
  TORCH_CHECK(grad_chunk.stride(1) == 1 && grad_chunk.size(1) >= chunk_cols && grad_chunk.size(0) == rows);
  TORCH_CHECK(chunk_begin % kGradChunkAlign == 0 && grad_chunk.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(grad_chunk.data_ptr()) % 8 == 0,
              "nitrobrew: misaligned backward chunk");  // the gradient passes store entry pairs
  return plan_for(path_, rows, chunk_begin / tile_cols, (chunk_begin + chunk_cols + tile_cols - 1) / tile_cols,
                  /*for_grad=*/true);
}

}  // namespace cuda
}  // namespace nitrobrew
