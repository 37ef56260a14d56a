// Float32 matmuls in full float32 for a scope, whatever the user's global setting.
#pragma once

#include <ATen/Context.h>

#include <functional>
#include <vector>

namespace nitrobrew {

// While it lives, float32 matmuls run in full float32 even where the user allowed reduced precision
// (torch.backends.cuda.matmul.allow_tf32, set_float32_matmul_precision("high" / "medium"): TF32 on
// CUDA, TF32 or bfloat16 in oneDNN on the CPU). A KL is a small difference of large terms, and a
// 10-bit mantissa would cost ~1e-3 of the scores. NoTF32Guard (thread-local) sets the math mode of
// the cuBLAS handles; cuBLASLt and oneDNN read only the global setting, so that is switched to full
// precision too and put back on destruction (meanwhile other threads' float32 matmuls also run in
// full precision).
class ExactFloat32Matmuls {
 public:
  ExactFloat32Matmuls();
  ~ExactFloat32Matmuls();
  ExactFloat32Matmuls(const ExactFloat32Matmuls&) = delete;
  ExactFloat32Matmuls& operator=(const ExactFloat32Matmuls&) = delete;

 private:
  at::NoTF32Guard no_tf32_;
  std::vector<std::function<void()>> restore_;  // puts back each setting that was changed
};

}  // namespace nitrobrew
