#pragma once
// Stand-in for the header that CUDA builds of torch generate, so that tools/ci/compile_cuda.sh
// can compile CUDA sources against a CPU build of torch (compile only, nothing is linked).
#define C10_CUDA_BUILD_SHARED_LIBS
