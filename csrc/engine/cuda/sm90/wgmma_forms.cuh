// wgmma forms the attention-KL backward uses beyond wgmma.cuh's m64n256k16 (sm_90a only;
// elsewhere they compile to nothing and are never called):
//   wgmma_ss<T, kN>: d (+)= A . B^T, 64 x 8kN (64 or 128), both operands K-major in shared memory
//                    (descriptors);
//   wgmma_rs<T, kN>: d (+)= A . B,   64 x 8kN, A in registers (a 64 x 16 slice in the m16n8k16 A
//                    layout per warp), B in shared memory as [K rows][N contiguous] (MN-major:
//                    the instruction's transpose-B operand is 1);
//   wgmma_ss_mn<T, kN>: d (+)= A . B, 64 x 8kN (32 or 64), both operands MN-major in shared
//                    memory (A as [K rows][M contiguous], B as [K rows][N contiguous]).
// The accumulator registers are TileAcc's v[j][e] in order (the m64nN fragment layout). Each form
// is one macro over the PTX type of A and B (bf16 or f16), as in wgmma.cuh.
#pragma once

#include <type_traits>

#include "wgmma.cuh"

namespace nitrobrew {
namespace cuda {
namespace hopper {

// d (+)= A . B^T, 64 x 64 x 16; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_SS_N64(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 "}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : NITROBREW_ACC_0_7(d) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

// d (+)= A . B^T, 64 x 96 x 16; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_SS_N96(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %50, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n96k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47}, " \
      "%48, %49, p, 1, 1, 0, 0;\n}\n" \
      : NITROBREW_ACC_0_7(d), NITROBREW_ACC_TILE(d, 8), NITROBREW_ACC_TILE(d, 9), NITROBREW_ACC_TILE(d, 10), \
        NITROBREW_ACC_TILE(d, 11) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

// d (+)= A . B^T, 64 x 128 x 16; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_SS_N128(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 ", " NITROBREW_REGS_32_63 "}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
      : NITROBREW_ACC_0_7(d), NITROBREW_ACC_8_15(d) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

// d (+)= A . B, 64 x 64 x 16, A in registers, B MN-major; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_RS_N64(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
      : NITROBREW_ACC_0_7(d) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));

// d (+)= A . B, 64 x 128 x 16, A in registers, B MN-major; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_RS_N128(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 ", " NITROBREW_REGS_32_63 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : NITROBREW_ACC_0_7(d), NITROBREW_ACC_8_15(d) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(scale_d));

// d (+)= A . B, 64 x 32 x 16, both operands MN-major; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_SS_MN_N32(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " " \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 1;\n}\n" \
      : NITROBREW_ACC_TILE(d, 0), NITROBREW_ACC_TILE(d, 1), NITROBREW_ACC_TILE(d, 2), NITROBREW_ACC_TILE(d, 3) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

// d (+)= A . B, 64 x 64 x 16, both operands MN-major; scale_d = 0 overwrites d.
#define NITROBREW_WGMMA_SS_MN_N64(TYPE) \
  asm volatile( \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n" \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " " \
      "{" NITROBREW_REGS_0_31 "}, %32, %33, p, 1, 1, 1, 1;\n}\n" \
      : NITROBREW_ACC_0_7(d) \
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));

template <typename T, int kN>
__device__ __forceinline__ void wgmma_ss(TileAcc<kN>& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(kN == 8 || kN == 12 || kN == 16, "B widths of 64, 96 and 128");
#if NITROBREW_SM90A_DEVICE
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kN == 8 && kBf16) NITROBREW_WGMMA_SS_N64("bf16");
  if constexpr (kN == 8 && !kBf16) NITROBREW_WGMMA_SS_N64("f16");
  if constexpr (kN == 12 && kBf16) NITROBREW_WGMMA_SS_N96("bf16");
  if constexpr (kN == 12 && !kBf16) NITROBREW_WGMMA_SS_N96("f16");
  if constexpr (kN == 16 && kBf16) NITROBREW_WGMMA_SS_N128("bf16");
  if constexpr (kN == 16 && !kBf16) NITROBREW_WGMMA_SS_N128("f16");
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

template <typename T, int kN>
__device__ __forceinline__ void wgmma_ss_mn(TileAcc<kN>& d, uint64_t desc_a, uint64_t desc_b, int scale_d) {
  static_assert(kN == 4 || kN == 8, "B widths of 32 and 64");
#if NITROBREW_SM90A_DEVICE
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if constexpr (kN == 4 && kBf16) NITROBREW_WGMMA_SS_MN_N32("bf16");
  if constexpr (kN == 4 && !kBf16) NITROBREW_WGMMA_SS_MN_N32("f16");
  if constexpr (kN == 8 && kBf16) NITROBREW_WGMMA_SS_MN_N64("bf16");
  if constexpr (kN == 8 && !kBf16) NITROBREW_WGMMA_SS_MN_N64("f16");
#endif
}

// Descriptor of an MN-major operand with 64-byte swizzle: [K rows][MN contiguous in 32-wide
// slabs `slab_bytes` apart], 8-row groups of a slab 512 bytes apart; a 16-row K step adds 1024
// bytes. (The rows of a TMA box of head_tensor_map read with K along the box's rows.)
__device__ __forceinline__ uint64_t mn_major_desc(const void* p, int slab_bytes) {
  const uint64_t addr = smem_addr(p);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t(slab_bytes >> 4) << 16) | (uint64_t(512 >> 4) << 32) |
         (uint64_t(2) << 62);
}

// d (+)= A . B^T over kSlabs 32-wide K slabs of both operands (K-major, 64-byte swizzled rows,
// consecutive slabs kASlabBytes / kBSlabBytes apart; desc_a, desc_b: smem_desc of the first).
// The first product overwrites d. Unrolled, with nothing but descriptor additions between the
// products: issue loops that computed each descriptor from a pointer spent more time issuing
// than the tensor cores spent multiplying (docs/notes/attention_kl.md, v11).
template <typename T, int kASlabBytes, int kBSlabBytes, int kSlabs, int kN>
__device__ __forceinline__ void wgmma_ss_slabs(TileAcc<kN>& d, uint64_t desc_a, uint64_t desc_b) {
#pragma unroll
  for (int ks = 0; ks < kSlabs; ++ks) {
    const uint64_t da = desc_a + ks * desc_step(kASlabBytes), db = desc_b + ks * desc_step(kBSlabBytes);
    wgmma_ss<T>(d, da, db, ks > 0);
    wgmma_ss<T>(d, da + desc_step(32), db + desc_step(32), 1);  // the slab's second 16 values
  }
}

// The same for a slab count known at run time (1 to 4: head dims up to 128), each count one
// unrolled sequence. The caller fences (wgmma_fence) before and commits after.
template <typename T, int kASlabBytes, int kBSlabBytes, int kN>
__device__ __forceinline__ void wgmma_ss_slabs(TileAcc<kN>& d, uint64_t desc_a, uint64_t desc_b, int slabs) {
  fence_acc(d);
  switch (slabs) {
    case 4: wgmma_ss_slabs<T, kASlabBytes, kBSlabBytes, 4>(d, desc_a, desc_b); break;
    case 3: wgmma_ss_slabs<T, kASlabBytes, kBSlabBytes, 3>(d, desc_a, desc_b); break;
    case 2: wgmma_ss_slabs<T, kASlabBytes, kBSlabBytes, 2>(d, desc_a, desc_b); break;
    default: wgmma_ss_slabs<T, kASlabBytes, kBSlabBytes, 1>(d, desc_a, desc_b); break;
  }
}

// The attention kernels' score tiles of both models from one ring stage, issued and committed
// (not waited for): s from the student's slabs at the stage's start, t from the teacher's, which
// begin kMaxSlabs slabs later; a_desc_s, a_desc_t: this warpgroup's rows (queries or keys) of each.
template <typename T, int kASlabBytes, int kBSlabBytes, int kMaxSlabs, int kN>
__device__ __forceinline__ void wgmma_scores_of_stage(TileAcc<kN>& s, TileAcc<kN>& t, uint64_t a_desc_s,
                                                      uint64_t a_desc_t, uint64_t stage_desc, int slabs_s,
                                                      int slabs_t) {
  wgmma_fence();  // once: a sequence of products into one accumulator needs no fence between
  wgmma_ss_slabs<T, kASlabBytes, kBSlabBytes>(s, a_desc_s, stage_desc, slabs_s);
  wgmma_ss_slabs<T, kASlabBytes, kBSlabBytes>(t, a_desc_t, stage_desc + desc_step(kMaxSlabs * kBSlabBytes), slabs_t);
  wgmma_commit();
}

}  // namespace hopper
}  // namespace cuda
}  // namespace nitrobrew
