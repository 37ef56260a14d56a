// Host side of the logit-tile kernels: picks the kernel family for the inputs and device,
// plans the vocabulary splits, and launches the three passes (fused_linear_passes.cuh).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cudaTypedefs.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "hopper_gemm.cuh"
#include "student_passes.cuh"
#include "tma.h"

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
// 98.8 ms at N = 16384 against 68.7 ms so (benchmarks/NOTES.md). The forward's KL pass
// gained nothing from it, so it keeps its plan.
constexpr int64_t kGradMinSplits = 12;

bool forced_sm80() {
  const char* value = std::getenv("NITROBREW_FORCE_SM80");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// TMA addresses rows with 32-bit coordinates from a 16-byte-aligned base at a stride that is a
// multiple of 16 bytes.
bool tma_addressable(const at::Tensor& t) {
  const int64_t bytes = t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(1) == 1 && (t.stride(0) * bytes) % 16 == 0 &&
         t.size(0) < (int64_t(1) << 31) && t.size(1) < (int64_t(1) << 31);
}

// Whether the sm_90a build of the kernels is the one loaded on the current device: true on
// Hopper when the package was built for 9.0a. (_build.py refuses a plain 9.0 build, whose
// cubin would report the same binary version with the kernel bodies compiled out.)
bool sm90a_kernels_loaded() {
  static std::mutex mutex;
  static std::unordered_map<int, bool> loaded;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = loaded.find(device);
  if (it == loaded.end()) {
    int major = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cudaFuncAttributes attr{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(
        &attr, hopper::hopper_logit_kernel<__nv_bfloat16, KLPass<__nv_bfloat16>, 1>));
    it = loaded.emplace(device, major == 9 && attr.binaryVersion == 90).first;
  }
  return it->second;
}

KernelPath choose_path(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt) {
  const bool half = xs.scalar_type() == at::kBFloat16 || xs.scalar_type() == at::kHalf;
  if (!half || forced_sm80()) return KernelPath::kMmaSync;
  if (!(tma_addressable(xs) && tma_addressable(xt) && tma_addressable(ws) && tma_addressable(wt))) {
    return KernelPath::kMmaSync;
  }
  return sm90a_kernels_loaded() ? KernelPath::kWgmma : KernelPath::kMmaSync;
}

// mma.sync path: blocks are small (several per SM), so enough splits for ~8 waves of them.
int64_t mma_tiles_per_split(int64_t row_tiles, int64_t vocab_tiles) {
  const int64_t target_blocks = int64_t(multiprocessor_count()) * 8;
  const int64_t splits = std::max<int64_t>(1, std::min(vocab_tiles, (target_blocks + row_tiles - 1) / row_tiles));
  return (vocab_tiles + splits - 1) / splits;
}

// wgmma path: one block per SM, so the split count (at least min_splits) is picked to balance
// the waves: it minimizes (waves of blocks) x (tiles per block + a block's small fixed cost).
int64_t wgmma_tiles_per_split(int64_t row_blocks, int64_t vocab_tiles, int64_t min_splits) {
  const int64_t sms = multiprocessor_count();
  min_splits = std::min(min_splits, vocab_tiles);
  int64_t best = 1;
  double best_cost = 1e300;
  for (int64_t per = 1; per <= vocab_tiles; ++per) {
    const int64_t splits = (vocab_tiles + per - 1) / per;
    if (splits < min_splits) break;  // fewer splits for every larger per
    if (per > 1 && (vocab_tiles + per - 2) / (per - 1) == splits) continue;  // same split count, more tiles
    const int64_t waves = (row_blocks * splits + sms - 1) / sms;
    const double cost = double(waves) * (double(per) + 0.05);
    if (cost < best_cost) {
      best_cost = cost;
      best = per;
    }
  }
  return best;
}

decltype(PFN_cuTensorMapEncodeTiled_v12000{}) tensor_map_encoder() {
  static const auto encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found));
#endif
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                "nitrobrew: the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// TMA descriptor of the first `rows` rows of a row-major [rows x D] 16-bit matrix, in boxes of
// box_rows x kK with the 64-byte swizzle that wgmma reads; out-of-range reads are 0.
CUtensorMap tensor_map(const at::Tensor& t, int64_t rows, int box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.stride(0) * t.element_size())};
  const cuuint32_t box[2] = {hopper::kK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, t.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      t.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "nitrobrew: cuTensorMapEncodeTiled failed (", int(result), ")");
  return map;
}

struct LaunchPlan {
  VocabSchedule sched;
  int64_t splits;
  int64_t group_row_blocks;  // the wgmma path's BlockOrder group
};

// The sm_90a kernel in clusters of kCluster blocks. With an even number of row blocks they run in
// pairs that share each W slab (each block loads half of it, multicast to both): the KL and
// gradient passes ran ~3% faster so (N = 8192; benchmarks/NOTES.md, v12). An odd count runs
// unpaired rather than pair its last block with an empty one.
template <typename T, typename Pass, int kCluster>
void launch_hopper(const FusedLinearArgs<T>& a, const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                   const at::Tensor& wt, const LaunchPlan& plan, const typename Pass::Params& params,
                   cudaStream_t stream) {
  constexpr int kWBoxRows = hopper::Loader<kCluster>::kWBoxRows;
  const hopper::TensorMaps maps{tensor_map(xs, a.n_rows, hopper::kRows), tensor_map(xt, a.n_rows, hopper::kRows),
                                tensor_map(ws, a.vocab_size, kWBoxRows), tensor_map(wt, a.vocab_size, kWBoxRows)};
  const int64_t row_blocks = (a.n_rows + hopper::kRows - 1) / hopper::kRows;
  const int64_t row_units = (row_blocks + kCluster - 1) / kCluster;
  const int64_t blocks = kCluster * row_units * plan.splits;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "nitrobrew: too many blocks for one launch");
  const hopper::BlockOrder order{row_units, plan.splits, std::max<int64_t>(1, plan.group_row_blocks / kCluster),
                                 kCluster};
  auto kernel = hopper::hopper_logit_kernel<T, Pass, kCluster>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, hopper::kSmemBytes));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(hopper::kThreads);
  config.dynamicSmemBytes = hopper::kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, maps, a, order, plan.sched, params));
}

template <typename T, typename Pass>
void launch_pass(KernelPath path, bool vectorized, const FusedLinearArgs<T>& a, const at::Tensor& xs,
                 const at::Tensor& xt, const at::Tensor& ws, const at::Tensor& wt, const LaunchPlan& plan,
                 const typename Pass::Params& params) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (path == KernelPath::kWgmma) {
    if constexpr (sizeof(T) == 2) {
      const int64_t row_blocks = (a.n_rows + hopper::kRows - 1) / hopper::kRows;
      if (row_blocks % 2 == 0) return launch_hopper<T, Pass, 2>(a, xs, xt, ws, wt, plan, params, stream);
      return launch_hopper<T, Pass, 1>(a, xs, xt, ws, wt, plan, params, stream);
    }
  }
  const int64_t row_tiles = (a.n_rows + kTileRows - 1) / kTileRows;
  TORCH_CHECK(row_tiles < (int64_t(1) << 31) && plan.splits < 65536, "nitrobrew: too many blocks for one launch");
  const dim3 grid(static_cast<unsigned>(row_tiles), static_cast<unsigned>(plan.splits));
  if (vectorized) {
    mma_logit_kernel<T, true, Pass><<<grid, kThreads, 0, stream>>>(a, plan.sched, params);
  } else {
    mma_logit_kernel<T, false, Pass><<<grid, kThreads, 0, stream>>>(a, plan.sched, params);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Splits tiles [first, end) for `rows` rows the way the path's blocks want them; the gradient
// pass's plan (for_grad) groups its blocks as kGradMinSplits says.
LaunchPlan plan_for(KernelPath path, int64_t rows, int64_t first, int64_t end, bool for_grad) {
  const int64_t tiles = std::max<int64_t>(end - first, 1);
  rows = std::max<int64_t>(rows, 1);  // an empty batch launches nothing, but is planned
  const int64_t min_splits = for_grad ? kGradMinSplits : 1;
  const int64_t group = for_grad ? std::max<int64_t>(1, multiprocessor_count() / kGradMinSplits) : kGroupRowBlocks;
  const int64_t per = path == KernelPath::kWgmma
                          ? wgmma_tiles_per_split((rows + hopper::kRows - 1) / hopper::kRows, tiles, min_splits)
                          : mma_tiles_per_split((rows + kTileRows - 1) / kTileRows, tiles);
  return {VocabSchedule{first, end, per}, (tiles + per - 1) / per, group};
}

// The launch plan of a backward pass over a chunk, after checking the chunk buffer.
LaunchPlan grad_plan(KernelPath path, int64_t tile_cols, int64_t rows, int64_t chunk_begin, int64_t chunk_cols,
                     const at::Tensor& grad_chunk) {
  TORCH_CHECK(grad_chunk.stride(1) == 1 && grad_chunk.size(1) >= chunk_cols && grad_chunk.size(0) == rows);
  TORCH_CHECK(chunk_begin % kGradChunkAlign == 0 && grad_chunk.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(grad_chunk.data_ptr()) % 8 == 0,
              "nitrobrew: misaligned backward chunk");  // the gradient passes store entry pairs
  return plan_for(path, rows, chunk_begin / tile_cols, (chunk_begin + chunk_cols + tile_cols - 1) / tile_cols,
                  /*for_grad=*/true);
}

template <typename T>
GradChunk<T> grad_chunk_of(int64_t chunk_begin, int64_t chunk_cols, const at::Tensor& grad_chunk) {
  return {chunk_begin, chunk_cols, reinterpret_cast<T*>(grad_chunk.data_ptr()), grad_chunk.stride(0)};
}

}  // namespace

bool use_sm90a_kernels() { return !forced_sm80() && sm90a_kernels_loaded(); }

CUtensorMap head_tensor_map(const at::Tensor& t, int box_rows) {
  TORCH_CHECK(t.dim() == 4 && t.is_contiguous() && t.size(3) % 8 == 0 && t.size(0) < (int64_t(1) << 31) &&
                  t.size(1) < (int64_t(1) << 31),
              "nitrobrew: head_tensor_map needs a contiguous [B, N, H, D] tensor with D % 8 == 0");
  CUtensorMap map;
  const int64_t bytes = t.element_size();
  // (D, H, N, B): a box never crosses into the next batch's rows (they read as 0).
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(t.size(3)), static_cast<cuuint64_t>(t.size(2)),
                              static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(t.stride(2) * bytes),
                                 static_cast<cuuint64_t>(t.stride(1) * bytes),
                                 static_cast<cuuint64_t>(t.stride(0) * bytes)};
  const cuuint32_t box[4] = {hopper::kK, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, t.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      t.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "nitrobrew: cuTensorMapEncodeTiled failed (", int(result), ")");
  return map;
}


LogitTilePasses::LogitTilePasses(const at::Tensor& xs, const at::Tensor& xt, const at::Tensor& ws,
                                 const at::Tensor& wt, const c10::optional<at::Tensor>& labels,
                                 const FusedLinearParams& p)
    : xs_(xs), xt_(xt), ws_(ws), wt_(wt), labels_(labels), p_(p) {
  path_ = choose_path(xs, xt, ws, wt);
  vectorized_ = vectorizable(xs) && vectorizable(xt) && vectorizable(ws) && vectorizable(wt);
  tile_cols_ = path_ == KernelPath::kWgmma ? hopper::kCols : kTileCols;
  const int64_t vocab_tiles = (p.vocab_size + tile_cols_ - 1) / tile_cols_;
  const LaunchPlan plan = plan_for(path_, p.num_rows, 0, vocab_tiles, /*for_grad=*/false);
  forward_tiles_per_split_ = plan.sched.tiles_per_split;
  forward_splits_ = plan.splits;
}

#define NITROBREW_DISPATCH_16_32(NAME, ...)                                                       \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xs_.scalar_type(), NAME, [&] {        \
    using T = cuda_type_t<scalar_t>;                                                              \
    if constexpr (!std::is_same_v<T, double>) {                                                   \
      const FusedLinearArgs<T> a = make_args<T>(xs_, xt_, ws_, wt_, labels_, p_);                 \
      __VA_ARGS__                                                                                 \
    }                                                                                             \
  })

void LogitTilePasses::kl_pass(at::Tensor& partial, at::Tensor& label_logit) const {
  const int64_t tiles = (p_.vocab_size + tile_cols_ - 1) / tile_cols_;
  const LaunchPlan plan{VocabSchedule{0, tiles, forward_tiles_per_split_}, forward_splits_, kGroupRowBlocks};
  NITROBREW_DISPATCH_16_32("nitrobrew_kl_pass", {
    const typename KLPass<T>::Params params{partial.data_ptr<float>(), label_logit.data_ptr<float>()};
    launch_pass<T, KLPass<T>>(path_, vectorized_, a, xs_, xt_, ws_, wt_, plan, params);
  });
}

void LogitTilePasses::mixture_pass(const at::Tensor& row_stats, at::Tensor& partial) const {
  const int64_t tiles = (p_.vocab_size + tile_cols_ - 1) / tile_cols_;
  const LaunchPlan plan{VocabSchedule{0, tiles, forward_tiles_per_split_}, forward_splits_, kGroupRowBlocks};
  NITROBREW_DISPATCH_16_32("nitrobrew_mixture_pass", {
    const typename MixturePass<T>::Params params{row_stats.data_ptr<float>(), partial.data_ptr<float>()};
    launch_pass<T, MixturePass<T>>(path_, vectorized_, a, xs_, xt_, ws_, wt_, plan, params);
  });
}

void LogitTilePasses::grad_pass(const at::Tensor& row_stats, int64_t chunk_begin, int64_t chunk_cols,
                                at::Tensor& grad_chunk) const {
  const LaunchPlan plan = grad_plan(path_, tile_cols_, p_.num_rows, chunk_begin, chunk_cols, grad_chunk);
  if (p_.num_rows == 0 || chunk_cols == 0) return;
  NITROBREW_DISPATCH_16_32("nitrobrew_grad_pass", {
    const typename GradPass<T>::Params params{row_stats.data_ptr<float>(), grad_chunk_of<T>(chunk_begin, chunk_cols,
                                                                                           grad_chunk)};
    launch_pass<T, GradPass<T>>(path_, vectorized_, a, xs_, xt_, ws_, wt_, plan, params);
  });
}

void LogitTilePasses::student_norm_pass(at::Tensor& partial, const at::Tensor& sorted_ids, const at::Tensor& id_order,
                                        at::Tensor& picked) const {
  TORCH_CHECK(sorted_ids.is_contiguous() && id_order.is_contiguous() && picked.is_contiguous() &&
              sorted_ids.scalar_type() == at::kLong && id_order.scalar_type() == at::kLong &&
              picked.scalar_type() == at::kFloat && sorted_ids.sizes() == picked.sizes() &&
              id_order.sizes() == picked.sizes() && picked.dim() == 2 && picked.size(0) == p_.num_rows);
  const int64_t tiles = (p_.vocab_size + tile_cols_ - 1) / tile_cols_;
  const LaunchPlan plan{VocabSchedule{0, tiles, forward_tiles_per_split_}, forward_splits_, kGroupRowBlocks};
  NITROBREW_DISPATCH_16_32("nitrobrew_student_norm_pass", {
    const typename StudentNormPass<T>::Params params{partial.data_ptr<double>(), sorted_ids.data_ptr<int64_t>(),
                                                     id_order.data_ptr<int64_t>(), picked.data_ptr<float>(),
                                                     picked.size(1)};
    launch_pass<T, StudentNormPass<T>>(path_, vectorized_, a, xs_, xt_, ws_, wt_, plan, params);
  });
}

void LogitTilePasses::student_grad_pass(const at::Tensor& grad_rows, int64_t chunk_begin, int64_t chunk_cols,
                                        at::Tensor& grad_chunk) const {
  TORCH_CHECK(grad_rows.is_contiguous() && grad_rows.scalar_type() == at::kFloat &&
              grad_rows.size(0) == p_.num_rows && grad_rows.size(1) == kNumStudentGradRow);
  const LaunchPlan plan = grad_plan(path_, tile_cols_, p_.num_rows, chunk_begin, chunk_cols, grad_chunk);
  if (p_.num_rows == 0 || chunk_cols == 0) return;
  NITROBREW_DISPATCH_16_32("nitrobrew_student_grad_pass", {
    const typename StudentGradPass<T>::Params params{grad_rows.data_ptr<float>(),
                                                     grad_chunk_of<T>(chunk_begin, chunk_cols, grad_chunk)};
    launch_pass<T, StudentGradPass<T>>(path_, vectorized_, a, xs_, xt_, ws_, wt_, plan, params);
  });
}

}  // namespace cuda
}  // namespace nitrobrew
