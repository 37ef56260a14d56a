// TMA descriptors (tma.h).
#include "tma.h"

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cudaTypedefs.h>

#include "ring.cuh"

namespace nitrobrew {
namespace cuda {
namespace {

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

}  // namespace

bool tma_addressable(const at::Tensor& t) {
  const int64_t bytes = t.element_size();
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(1) == 1 && (t.stride(0) * bytes) % 16 == 0 &&
         t.size(0) < (int64_t(1) << 31) && t.size(1) < (int64_t(1) << 31);
}

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

CUtensorMap head_tensor_map(const at::Tensor& t, int box_rows) {
  TORCH_CHECK(t.dim() == 4 && t.element_size() == 2 && t.size(3) % 8 == 0 && t.stride(3) == 1,
              "nitrobrew: head_tensor_map needs a 16-bit [B, N, H, D] view with a contiguous D, D % 8 == 0");
  const int64_t bytes = t.element_size();
  // A dim of size 1 is only indexed at 0: its stride (arbitrary in PyTorch) is replaced by D's extent,
  // a multiple of 16 bytes as TMA requires of every stride.
  auto stride = [&](int dim) { return (t.size(dim) == 1 ? t.size(3) : t.stride(dim)) * bytes; };
  for (const int dim : {0, 1, 2}) {
    TORCH_CHECK(stride(dim) > 0 && stride(dim) % 16 == 0 && stride(dim) < (int64_t(1) << 40),
                "nitrobrew: head_tensor_map needs B, N, H strides that are multiples of 16 bytes, got ",
                t.strides());
  }
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.size(0) < (int64_t(1) << 31) &&
                  t.size(1) < (int64_t(1) << 31),
              "nitrobrew: head_tensor_map needs a 16-byte aligned base and B, N below 2^31");
  CUtensorMap map;
  // (D, H, N, B): a box never crosses into the next batch's rows (they read as 0). The strides need
  // not increase: a [B, H, N, D] tensor viewed as [B, N, H, D] has the rows' stride smallest.
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(t.size(3)), static_cast<cuuint64_t>(t.size(2)),
                              static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(stride(2)), static_cast<cuuint64_t>(stride(1)),
                                 static_cast<cuuint64_t>(stride(0))};
  const cuuint32_t box[4] = {hopper::kK, 1, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUresult result = tensor_map_encoder()(
      &map, t.scalar_type() == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 4,
      t.data_ptr(), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_64B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(result == CUDA_SUCCESS, "nitrobrew: cuTensorMapEncodeTiled failed (", int(result), ") for sizes ",
              t.sizes(), ", strides ", t.strides());
  return map;
}

}  // namespace cuda
}  // namespace nitrobrew
