// The wgmma pieces of the sm_90a kernels (sm_90a only; elsewhere the instructions compile to
// nothing and are never called): shared-memory descriptors, the fence / commit / wait group, the
// accumulator's asm operands and the m64n256k16 product of the vocabulary walk. Other shapes and
// operand layouts (the attention kernels') are in wgmma_forms.cuh.
#pragma once

#include <cstdint>

#include "../arch.h"
#include "../tile_gemm_sm80.cuh"
#include "ptx.cuh"

namespace nitrobrew {
namespace cuda {
namespace hopper {

constexpr int kCols = 256;  // the wgmma N of the vocabulary walk: entries per tile
using WideAcc = TileAcc<kCols / 8>;  // a consumer thread's share of a 64 x kCols tile

// wgmma shared-memory descriptor of a K-major operand in 64-byte-swizzled rows (as TMA wrote
// them): 8-row groups 512 bytes apart (SBO); the leading offset is unused for this layout.
// Advancing K by 16 values adds 32 bytes, i.e. 2 to the encoded start address.
__device__ __forceinline__ uint64_t smem_desc(const void* p) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(512 >> 4) << 32) | (uint64_t(2) << 62);
}

// A descriptor's start address is in 16-byte units: moving the operand by `bytes` adds bytes / 16.
constexpr uint64_t desc_step(int bytes) { return static_cast<uint64_t>(bytes) >> 4; }

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int kN>
__device__ __forceinline__ void fence_acc(TileAcc<kN>& d) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d.v[j][e])::"memory");
  }
}

// Pieces of the wgmma asm statements (here and in wgmma_forms.cuh): the accumulator's "+f"
// operands, 4 per n-tile of 8 columns (TileAcc's v[j][e] in order), and their register names.
#define NITROBREW_ACC_TILE(d, j) "+f"(d.v[j][0]), "+f"(d.v[j][1]), "+f"(d.v[j][2]), "+f"(d.v[j][3])
#define NITROBREW_ACC_0_7(d) \
  NITROBREW_ACC_TILE(d, 0), NITROBREW_ACC_TILE(d, 1), NITROBREW_ACC_TILE(d, 2), NITROBREW_ACC_TILE(d, 3), \
      NITROBREW_ACC_TILE(d, 4), NITROBREW_ACC_TILE(d, 5), NITROBREW_ACC_TILE(d, 6), NITROBREW_ACC_TILE(d, 7)
#define NITROBREW_ACC_8_15(d) \
  NITROBREW_ACC_TILE(d, 8), NITROBREW_ACC_TILE(d, 9), NITROBREW_ACC_TILE(d, 10), NITROBREW_ACC_TILE(d, 11), \
      NITROBREW_ACC_TILE(d, 12), NITROBREW_ACC_TILE(d, 13), NITROBREW_ACC_TILE(d, 14), NITROBREW_ACC_TILE(d, 15)
#define NITROBREW_ACC_16_31(d) \
  NITROBREW_ACC_TILE(d, 16), NITROBREW_ACC_TILE(d, 17), NITROBREW_ACC_TILE(d, 18), NITROBREW_ACC_TILE(d, 19), \
      NITROBREW_ACC_TILE(d, 20), NITROBREW_ACC_TILE(d, 21), NITROBREW_ACC_TILE(d, 22), NITROBREW_ACC_TILE(d, 23), \
      NITROBREW_ACC_TILE(d, 24), NITROBREW_ACC_TILE(d, 25), NITROBREW_ACC_TILE(d, 26), NITROBREW_ACC_TILE(d, 27), \
      NITROBREW_ACC_TILE(d, 28), NITROBREW_ACC_TILE(d, 29), NITROBREW_ACC_TILE(d, 30), NITROBREW_ACC_TILE(d, 31)
#define NITROBREW_REGS_0_31 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define NITROBREW_REGS_32_63 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define NITROBREW_REGS_64_127 \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"

// d (+)= A . B^T for a 64 x 16 slice of A and a kCols x 16 slice of B; scale_d = 0 overwrites
// d (the first product of a tile: zeroing d with ordinary instructions would serialize wgmma).
// TYPE is the PTX type of A and B.
#define NITROBREW_WGMMA_TILE(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 ", " NITROBREW_REGS_32_63 ", " NITROBREW_REGS_64_127 "}, " \
      "%128, %129, p, 1, 1, 0, 0;\n}\n" \
      : NITROBREW_ACC_0_7(d), NITROBREW_ACC_8_15(d), NITROBREW_ACC_16_31(d) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

template <typename T>
__device__ __forceinline__ void wgmma_tile(WideAcc& d, uint64_t desc_a, uint64_t desc_b, int scale_d);

template <>
__device__ __forceinline__ void wgmma_tile<__nv_bfloat16>(WideAcc& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  NITROBREW_WGMMA_TILE("bf16");
#endif
}

template <>
__device__ __forceinline__ void wgmma_tile<__half>(WideAcc& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
#if NITROBREW_SM90A_DEVICE
  NITROBREW_WGMMA_TILE("f16");
#endif
}

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
