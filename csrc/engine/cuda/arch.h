// Which kernel family a build and a GPU can run, known on both sides:
//   device code: NITROBREW_SM90A_DEVICE is 1 in the sm_90a compilation pass alone (the wgmma/TMA
//   kernel bodies exist only there; elsewhere they compile to nothing and are never launched);
//   host code: use_sm90a_kernels() says whether the current GPU runs them (arch.cpp).
#pragma once

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define NITROBREW_SM90A_DEVICE 1
#else
#define NITROBREW_SM90A_DEVICE 0
#endif

#include <cstdint>

namespace nitrobrew {
namespace cuda {

// The two kernel families: mma.sync (sm_80 and later; the only one for float32 inputs or rows
// that TMA cannot address) and TMA-fed wgmma (sm_90a). NITROBREW_FORCE_SM80=1 in the environment
// selects mma.sync everywhere, so the sm_80 kernels can be tested on Hopper.
enum class KernelPath { kMmaSync, kWgmma };

// Whether the sm_90a kernels should run on the current device: Hopper with the sm_90a build
// loaded, and NITROBREW_FORCE_SM80 not set to 1.
bool use_sm90a_kernels();

// Streaming multiprocessors of the current device.
int multiprocessor_count();

}  // namespace cuda
}  // namespace nitrobrew
