// wgmma forms the attention-KL backward uses beyond hopper_gemm.cuh's m64n256k16 (sm_90a only;
// elsewhere they compile to nothing and are never called):
//   wgmma_ss<T>:     d (+)= A . B^T, 64 x 64, both operands K-major in shared memory (descriptors);
//   wgmma_rs<T, kN>: d (+)= A . B,   64 x 8kN, A in registers (a 64 x 16 slice in the m16n8k16 A
//                    layout per warp), B in shared memory as [K rows][N contiguous] (MN-major:
//                    the instruction's transpose-B operand is 1).
// The accumulator registers are TileAcc's v[j][e] in order (the m64nN fragment layout). Each form
// is one macro over the PTX type of A and B (bf16 or f16), as in hopper_gemm.cuh.
#pragma once

#include <type_traits>

#include "hopper_gemm.cuh"

namespace nitrobrew {
namespace cuda {
namespace hopper {

// d (+)= A . B^T, 64 x 64 x 16; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_SS_N64(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d.v[0][0]), "+f"(d.v[0][1]), "+f"(d.v[0][2]), "+f"(d.v[0][3]), \
        "+f"(d.v[1][0]), "+f"(d.v[1][1]), "+f"(d.v[1][2]), "+f"(d.v[1][3]), \
        "+f"(d.v[2][0]), "+f"(d.v[2][1]), "+f"(d.v[2][2]), "+f"(d.v[2][3]), \
        "+f"(d.v[3][0]), "+f"(d.v[3][1]), "+f"(d.v[3][2]), "+f"(d.v[3][3]), \
        "+f"(d.v[4][0]), "+f"(d.v[4][1]), "+f"(d.v[4][2]), "+f"(d.v[4][3]), \
        "+f"(d.v[5][0]), "+f"(d.v[5][1]), "+f"(d.v[5][2]), "+f"(d.v[5][3]), \
        "+f"(d.v[6][0]), "+f"(d.v[6][1]), "+f"(d.v[6][2]), "+f"(d.v[6][3]), \
        "+f"(d.v[7][0]), "+f"(d.v[7][1]), "+f"(d.v[7][2]), "+f"(d.v[7][3]) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

// d (+)= A . B, 64 x 64 x 16, A in registers, B MN-major; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_RS_N64(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
      : "+f"(d.v[0][0]), "+f"(d.v[0][1]), "+f"(d.v[0][2]), "+f"(d.v[0][3]), \
        "+f"(d.v[1][0]), "+f"(d.v[1][1]), "+f"(d.v[1][2]), "+f"(d.v[1][3]), \
        "+f"(d.v[2][0]), "+f"(d.v[2][1]), "+f"(d.v[2][2]), "+f"(d.v[2][3]), \
        "+f"(d.v[3][0]), "+f"(d.v[3][1]), "+f"(d.v[3][2]), "+f"(d.v[3][3]), \
        "+f"(d.v[4][0]), "+f"(d.v[4][1]), "+f"(d.v[4][2]), "+f"(d.v[4][3]), \
        "+f"(d.v[5][0]), "+f"(d.v[5][1]), "+f"(d.v[5][2]), "+f"(d.v[5][3]), \
        "+f"(d.v[6][0]), "+f"(d.v[6][1]), "+f"(d.v[6][2]), "+f"(d.v[6][3]), \
        "+f"(d.v[7][0]), "+f"(d.v[7][1]), "+f"(d.v[7][2]), "+f"(d.v[7][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));

// d (+)= A . B, 64 x 128 x 16, A in registers, B MN-major; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_RS_N128(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : "+f"(d.v[0][0]), "+f"(d.v[0][1]), "+f"(d.v[0][2]), "+f"(d.v[0][3]), \
        "+f"(d.v[1][0]), "+f"(d.v[1][1]), "+f"(d.v[1][2]), "+f"(d.v[1][3]), \
        "+f"(d.v[2][0]), "+f"(d.v[2][1]), "+f"(d.v[2][2]), "+f"(d.v[2][3]), \
        "+f"(d.v[3][0]), "+f"(d.v[3][1]), "+f"(d.v[3][2]), "+f"(d.v[3][3]), \
        "+f"(d.v[4][0]), "+f"(d.v[4][1]), "+f"(d.v[4][2]), "+f"(d.v[4][3]), \
        "+f"(d.v[5][0]), "+f"(d.v[5][1]), "+f"(d.v[5][2]), "+f"(d.v[5][3]), \
        "+f"(d.v[6][0]), "+f"(d.v[6][1]), "+f"(d.v[6][2]), "+f"(d.v[6][3]), \
        "+f"(d.v[7][0]), "+f"(d.v[7][1]), "+f"(d.v[7][2]), "+f"(d.v[7][3]), \
        "+f"(d.v[8][0]), "+f"(d.v[8][1]), "+f"(d.v[8][2]), "+f"(d.v[8][3]), \
        "+f"(d.v[9][0]), "+f"(d.v[9][1]), "+f"(d.v[9][2]), "+f"(d.v[9][3]), \
        "+f"(d.v[10][0]), "+f"(d.v[10][1]), "+f"(d.v[10][2]), "+f"(d.v[10][3]), \
        "+f"(d.v[11][0]), "+f"(d.v[11][1]), "+f"(d.v[11][2]), "+f"(d.v[11][3]), \
        "+f"(d.v[12][0]), "+f"(d.v[12][1]), "+f"(d.v[12][2]), "+f"(d.v[12][3]), \
        "+f"(d.v[13][0]), "+f"(d.v[13][1]), "+f"(d.v[13][2]), "+f"(d.v[13][3]), \
        "+f"(d.v[14][0]), "+f"(d.v[14][1]), "+f"(d.v[14][2]), "+f"(d.v[14][3]), \
        "+f"(d.v[15][0]), "+f"(d.v[15][1]), "+f"(d.v[15][2]), "+f"(d.v[15][3]) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));

template <typename T>
__device__ __forceinline__ void wgmma_ss(TileAcc<8>& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    NITROBREW_WGMMA_SS_N64("bf16");
  } else {
    NITROBREW_WGMMA_SS_N64("f16");
  }
#endif
}

template <typename T, int kN>
__device__ __forceinline__ void wgmma_rs(TileAcc<kN>& d, const uint32_t (&a)[4], uint64_t desc_b, int scale_d) {
  static_assert(kN == 8 || kN == 16, "B widths of 64 and 128");
#if NITROBREW_SM90A_DEVICE
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kN == 8 && kBf16) NITROBREW_WGMMA_RS_N64("bf16");
  if constexpr (kN == 8 && !kBf16) NITROBREW_WGMMA_RS_N64("f16");
  if constexpr (kN == 16 && kBf16) NITROBREW_WGMMA_RS_N128("bf16");
  if constexpr (kN == 16 && !kBf16) NITROBREW_WGMMA_RS_N128("f16");
#endif
}

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
