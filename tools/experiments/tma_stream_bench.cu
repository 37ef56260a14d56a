// How fast the copy engine (TMA) streams the fused-linear kernel's operand slabs into the SMs
// with no math at all: the bound on the sm_90a logit kernel if it were limited by loads alone.
// Blocks walk the same (row block, vocabulary split) order and slab sequence as the KL pass at
// N = 8192 on the reference shape (X [8192 x 8704], W [152064 x 8704] bf16: the student's and
// the teacher's K back to back), for two row widths of the slabs:
//   32 columns (64-byte rows, 64-byte swizzle): what the kernel loads;
//   64 columns (128-byte rows, 128-byte swizzle): what cuBLAS loads.
// One thread produces into a ring of shared-memory stages and one thread consumes. With no
// hold, the consumer releases each slab as soon as it lands, so the ring is never held by math.
// With a hold of C clocks it behaves as the logit kernel's consumers do when the tensor cores
// take C clocks per slab: it keeps two stages (the slab being multiplied and the one queued
// behind it), and releases a slab only after "multiplying" it (spinning C clocks). 490 clocks is
// a 128 x 256 x 32 slab at the H100's dense bf16 peak. Standalone (no torch):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a tools/experiments/tma_stream_bench.cu -o tma_stream_bench
//   ./tma_stream_bench [repeats]
// Prints CSV: row width, slab columns, stages, ring size, median ms, GB/s of slabs delivered.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../../csrc/engine/cuda/sm90/ptx.cuh"

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

constexpr int kRows = 128, kCols = 256;
constexpr int kN = 8192, kV = 152064, kD = 3584 + 5120;

using namespace nitrobrew::cuda::hopper;  // smem_addr, mbar_*, tma_load*, cluster_sync

// Grid: row_blocks x splits blocks in the KL pass's order (groups of 8 row blocks), each
// streaming tiles_per_split tiles of k_slabs slabs of kK columns.
template <int kK, int kSmemRing, int kCluster, int kHold>
__global__ void __launch_bounds__(64, 1)
    stream_kernel(const __grid_constant__ CUtensorMap x, const __grid_constant__ CUtensorMap w, int row_blocks,
                  int splits, int tiles_per_split, int vocab_tiles, int k_slabs) {
  constexpr int kStageBytes = (kRows + kCols) * kK * 2;
  constexpr int kStages = kSmemRing / kStageBytes;
  extern __shared__ uint8_t raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kCluster);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();
  // With kCluster > 1, blocks kCluster * c + r form a cluster: kCluster row blocks of one split,
  // each loading its own X slab and its share of the W slab for all of them.
  const int unit = blockIdx.x / kCluster, rank = blockIdx.x % kCluster;
  const int units = row_blocks / kCluster, group = 8 / kCluster, per_group = group * splits;
  const int g = unit / per_group, r = unit % per_group;
  const int rows_here = min(group, units - g * group);
  const int row_block = (g * group + r % rows_here) * kCluster + rank, split = r / rows_here;
  const int first = split * tiles_per_split, last = min(vocab_tiles, first + tiles_per_split);
  const int total = (last - first) * k_slabs;
  if (threadIdx.x == 0) {  // producer
    for (int i = 0, stage = 0, phase = 0; i < total; ++i) {
      mbar_wait(&empty[stage], phase ^ 1);
      mbar_arrive_expect_tx(&full[stage], kStageBytes);
      const int tile = first + i / k_slabs, ks = i % k_slabs;
      uint8_t* dst = smem + stage * kStageBytes;
      tma_load(dst, &x, ks * kK, row_block * kRows, &full[stage]);
      if (kCluster > 1) {
        tma_load_multicast(dst + kRows * kK * 2 + rank * (kCols / kCluster) * kK * 2, &w, ks * kK,
                           tile * kCols + rank * (kCols / kCluster), &full[stage], (1 << kCluster) - 1);
      } else {
        tma_load(dst + kRows * kK * 2, &w, ks * kK, tile * kCols, &full[stage]);
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
  } else if (threadIdx.x == 32) {  // consumer
    auto release = [&](int stage) {
      mbar_arrive(&empty[stage]);
      for (int peer = 0; peer < kCluster; ++peer) {  // the peers' producers write this stage too
        if (peer != rank) mbar_arrive_remote(&empty[stage], peer);
      }
    };
    int previous = -1;
    for (int i = 0, stage = 0, phase = 0; i < total; ++i) {
      mbar_wait(&full[stage], phase);
      if (kHold == 0) {
        release(stage);
      } else {
        const long long t0 = clock64();
        while (clock64() - t0 < kHold) {
        }
        if (previous >= 0) release(previous);
        previous = stage;
      }
      if (++stage == kStages) stage = 0, phase ^= 1;
    }
    if (previous >= 0) release(previous);
  }
  cluster_sync();  // the peer may still write into this block's shared memory
}

PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

CUtensorMap make_map(void* base, uint64_t rows, uint32_t box_rows, uint32_t box_k, CUtensorMapSwizzle swizzle) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {kD, rows};
  const cuuint64_t strides[1] = {kD * 2};
  const cuuint32_t box[2] = {box_k, box_rows};
  const cuuint32_t estrides[2] = {1, 1};
  CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, dims, strides, box, estrides,
                         CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                         CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return map;
}

template <int kK, int kSmemRing, int kCluster, int kHold = 0>
void run(void* x, void* w, int repeats, CUtensorMapSwizzle swizzle, const char* name) {
  const CUtensorMap xm = make_map(x, kN, kRows, kK, swizzle),
                    wm = make_map(w, kV, kCols / kCluster, kK, swizzle);
  const int row_blocks = kN / kRows, vocab_tiles = (kV + kCols - 1) / kCols, splits = 33;
  const int tiles_per_split = (vocab_tiles + splits - 1) / splits, k_slabs = kD / kK;
  const int smem = kSmemRing + 1024;
  CHECK(cudaFuncSetAttribute(stream_kernel<kK, kSmemRing, kCluster, kHold>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(row_blocks * splits);
  config.blockDim = dim3(64);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = kCluster;
  cluster.val.clusterDim.y = cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  std::vector<float> ms;
  for (int i = 0; i <= repeats; ++i) {
    CHECK(cudaEventRecord(a));
    CHECK(cudaLaunchKernelEx(&config, stream_kernel<kK, kSmemRing, kCluster, kHold>, xm, wm, row_blocks, splits,
                             tiles_per_split, vocab_tiles, k_slabs));
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t;
    CHECK(cudaEventElapsedTime(&t, a, b));
    if (i > 0) ms.push_back(t);  // the first run warms up
  }
  CHECK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double bytes = double(row_blocks) * vocab_tiles * (kRows + kCols) * double(kD) * 2;
  const double med = ms[ms.size() / 2];
  int active_clusters = 0;
  CHECK(cudaOccupancyMaxActiveClusters(&active_clusters, stream_kernel<kK, kSmemRing, kCluster, kHold>, &config));
  std::printf("%s,%d,%d,%d,%d,%d,%d,%.3f,%.0f\n", name, kCluster, active_clusters * kCluster, kHold, kK, kSmemRing / ((kRows + kCols) * kK * 2), kSmemRing / 1024, med,
              bytes / med / 1e6);
}

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  void *x, *w;
  CHECK(cudaMalloc(&x, size_t(kN) * kD * 2));
  CHECK(cudaMalloc(&w, size_t(kV) * kD * 2));
  CHECK(cudaMemset(x, 0, size_t(kN) * kD * 2));
  CHECK(cudaMemset(w, 0, size_t(kV) * kD * 2));
  std::printf("rows,cluster,co_resident_blocks,hold_clocks,slab_cols,stages,ring_kib,median_ms,GB_per_s\n");
  // The kernel's ring (4 x 24 KB, the rest of shared memory holds the parked student tile), and
  // the 192 KB ring of a kernel without a parked tile, for both row widths.
  run<32, 96 * 1024, 1>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<64, 96 * 1024, 1>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  run<32, 192 * 1024, 1>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<64, 192 * 1024, 1>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  // Clusters of row blocks sharing each W slab: each block loads its X slab and its share of W.
  run<32, 96 * 1024, 2>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<32, 96 * 1024, 4>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<64, 96 * 1024, 2>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  run<64, 96 * 1024, 4>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  run<64, 192 * 1024, 2>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  // Consumers that hold each slab for its multiplication time at the tensor cores' peak.
  run<32, 96 * 1024, 1, 490>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<32, 96 * 1024, 2, 490>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<32, 96 * 1024, 4, 490>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<32, 192 * 1024, 2, 490>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_64B, "64-byte rows");
  run<64, 96 * 1024, 2, 980>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  run<64, 192 * 1024, 2, 980>(x, w, repeats, CU_TENSOR_MAP_SWIZZLE_128B, "128-byte rows");
  return 0;
}
