// ExactFloat32Matmuls (attention_kl_exact_matmul.h), for each generation of PyTorch's precision
// settings: per backend and op from 2.10 (enums) and 2.9 (strings), one global setting before.
#include "attention_kl_exact_matmul.h"

#include <torch/version.h>

#include <string>

#define NB_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace nitrobrew {

ExactFloat32Matmuls::ExactFloat32Matmuls() {
  at::Context& ctx = at::globalContext();
#if NB_TORCH_AT_LEAST(2, 10)
  for (const at::Float32Backend backend : {at::Float32Backend::CUDA, at::Float32Backend::MKLDNN}) {
    const at::Float32Precision was = ctx.float32Precision(backend, at::Float32Op::MATMUL);
    if (was == at::Float32Precision::TF32 || was == at::Float32Precision::BF16) {
      ctx.setFloat32Precision(backend, at::Float32Op::MATMUL, at::Float32Precision::IEEE);
      restore_.push_back([backend, was] {
        at::globalContext().setFloat32Precision(backend, at::Float32Op::MATMUL, was);
      });
    }
  }
#elif NB_TORCH_AT_LEAST(2, 9)
  for (const std::string backend : {"cuda", "mkldnn"}) {
    const std::string was = ctx.float32Precision(backend, "matmul");
    if (was == "tf32" || was == "bf16") {
      ctx.setFloat32Precision(backend, "matmul", "ieee");
      restore_.push_back([backend, was] { at::globalContext().setFloat32Precision(backend, "matmul", was); });
    }
  }
#else
  const at::Float32MatmulPrecision was = ctx.float32MatmulPrecision();
  if (was != at::Float32MatmulPrecision::HIGHEST) {
    ctx.setFloat32MatmulPrecision("highest");
    const std::string name = was == at::Float32MatmulPrecision::HIGH ? "high" : "medium";
    restore_.push_back([name] { at::globalContext().setFloat32MatmulPrecision(name); });
  }
#endif
}

ExactFloat32Matmuls::~ExactFloat32Matmuls() {
  for (auto it = restore_.rbegin(); it != restore_.rend(); ++it) (*it)();
}

}  // namespace nitrobrew
