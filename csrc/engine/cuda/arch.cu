// Which kernel family the current GPU runs (arch.h).
#include "arch.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace nitrobrew {
namespace cuda {
namespace {

// An empty kernel whose attributes tell which of the build's binaries the driver loaded.
__global__ void build_probe_kernel() {}

// Whether the sm_90a build of the kernels is the one loaded on the current device: true on
// Hopper when the package was built for 9.0a (every kernel of the extension comes from one build,
// so the probe's binary is theirs). (_build.py refuses a plain 9.0 build, whose
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
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, build_probe_kernel));
    it = loaded.emplace(device, major == 9 && attr.binaryVersion == 90).first;
  }
  return it->second;
}

// NITROBREW_FORCE_SM80=1 is set.
bool forced_sm80() {
  const char* value = std::getenv("NITROBREW_FORCE_SM80");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace

bool use_sm90a_kernels() { return !forced_sm80() && sm90a_kernels_loaded(); }

int multiprocessor_count() {
  int device = 0, count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

}  // namespace cuda
}  // namespace nitrobrew
