// Attention-KL backward on Hopper (sm_90a): a single kernel recomputes each score tile once and
// uses it for both gradients, in FlashAttention-3's backward layout. dq is added with (bulk)
// atomics; for deterministic=True the kernel runs without its dq part (kWithDq = false: dk alone,
// one writer per entry) beside the dq kernel of bwd_dq_sm90.cu.
//
// A block owns 128 keys of one student key head (two consumer warpgroups of 64), keeps the keys
// of both models resident in shared memory, and walks the 64-query tiles of every query head of
// its GQA group, streamed by a producer thread through a ring of two stages. Per query tile each
// consumer warpgroup
//   1. multiplies its 64 keys by the tile's queries, student and teacher (wgmma, both operands in
//      shared memory): the transposed score tiles S^T, 64 keys x 64 queries, in registers;
//   2. forms dS^T = dLoss/dscore_s^T from the forward's per-query log-normalizers, masked and
//      rounded to the input dtype, and stores it to shared memory (stmatrix);
//   3. adds dS^T . Q_s into its dk accumulator (wgmma, dS^T as the register operand);
//   4. after a barrier (both halves of dS stored), multiplies dS [64 queries x 128 keys] by its
//      half of the head dim of K_s: a 64-query slice of dq, which it stages in shared memory and
//      adds into a float32 buffer with one bulk reduction (cp.reduce.async.bulk).
// The buffer holds dq in the accumulators' fragment order (contiguous per query tile and
// warpgroup, so each reduction is one 1-D bulk copy); a second kernel converts it into dq. It
// covers a chunk of (batch, key head) pairs at a time (dq_accum_chunks). The blocks of a pair run
// together, so that its query tiles stay in L2.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>


#include "../engine/cuda/sm90/ring.cuh"
#include "../engine/cuda/sm90/tma.h"
#include "../engine/cuda/sm90/wgmma_forms.cuh"
#include "attention_kl_tiles.cuh"

namespace nitrobrew {
namespace cuda {
namespace attention {

// (Outside the anonymous namespace, as in fwd_sm90.cu.)
struct FusedBackwardMaps {
  CUtensorMap k_s, k_t;  // boxes of 128 keys
  CUtensorMap q_s, q_t;  // boxes of 64 queries
};

namespace {

constexpr int kRows = 128;      // keys per block: 2 consumer warpgroups x 64
constexpr int kCols = 64;       // queries per tile
constexpr int kK = hopper::kK;  // 32 values: one 64-byte swizzled row, as head_tensor_map loads
constexpr int kMaxSlabs = 4;    // head dims up to 128
constexpr int kStages = 2;
constexpr int kRowSlabBytes = kRows * kK * 2;
constexpr int kColSlabBytes = kCols * kK * 2;
constexpr int kRowBytes = kMaxSlabs * kRowSlabBytes;  // one model's keys
constexpr int kStageBytes = 2 * kMaxSlabs * kColSlabBytes;
// dS of a tile as [128 keys][64 queries], the queries in two 32-wide slabs (64-byte swizzle):
// the MN-major A operand of dq = dS . K_s. Two buffers, so that a tile's stores never wait for
// the previous tile's products.
constexpr int kDsSlabBytes = kRows * kK * 2;
constexpr int kDsBytes = 2 * kDsSlabBytes;
constexpr int kDqStageBytes = kCols * kMaxSlabs * kK * 4;  // both warpgroups' dq slices, float32
constexpr int kQueryDataBytes = 2 * kCols * 16;            // two tiles' QueryGrad
// [[maybe_unused]]: read only in the kernel body, which the passes for other architectures compile out.
[[maybe_unused]] constexpr int kProducerThreads = 128;
constexpr int kConsumerThreads = 256, kThreadCount = 384;
[[maybe_unused]] constexpr int kConsumerWarps = kConsumerThreads / 32;
constexpr int kSmemBytes = 1024 + 2 * kRowBytes + kStages * kStageBytes + 2 * kDsBytes + kDqStageBytes +
                           kQueryDataBytes + (2 * kStages + 3) * 8;
static_assert(kSmemBytes <= 227 * 1024, "more shared memory than a block may have");

// Floats of one warpgroup's dq slice (64 queries x kDs / 2 columns) in the buffer.
template <int kDs>
constexpr int kDqSliceFloats = kCols * kDs / 2;

// What dS needs of one query, ready for exp2: p = 2^(s log2e - s_off2), q = 2^(t log2e - t_off2);
// center (reverse KL) and the upstream gradient times dscore/dq and the float16 range scale.
struct QueryGrad {
  float s_off2, t_off2, center, grad;
};

// The block: 128 keys of (b, student key head), and its items, the 64-query tiles of each query
// head of the group from the first one that sees a key of the block.
template <typename T>
struct FusedBlock {
  int64_t pair, b;
  int head, row0, group, first_tile, per_head, items, q_tiles, rotation;

  __device__ FusedBlock(const AttentionArgs<T>& a) {
    // Head by head: the blocks of a (batch, key head) pair run together and share its query
    // tiles in L2 (in the order of the forward, all heads at once, the larger N the more of them
    // came from memory: 23% slower at N = 16384; docs/notes/attention_kl.md). Within a head, the keys
    // most queries see first (causal).
    const int key_blocks = (a.n_k + kRows - 1) / kRows;
    pair = blockIdx.x / key_blocks;
    const int key_block = static_cast<int>(blockIdx.x % key_blocks);
    row0 = key_block * kRows;
    b = a.chunk_b0 + pair / a.chunk_key_heads;
    head = a.chunk_kh0 + static_cast<int>(pair % a.chunk_key_heads);
    group = a.heads / a.key_heads_s;
    q_tiles = (a.n_q + kCols - 1) / kCols;
    const int q_first = a.causal ? max(0, row0 - (a.n_k - a.n_q)) : 0;
    first_tile = q_first / kCols;
    per_head = max(0, q_tiles - first_tile);
    items = group * per_head;
    // The blocks of a head start at different query tiles, so that their dq reductions do not
    // all land on the same tile at once.
    rotation = per_head > 0 ? key_block % per_head : 0;
  }
  // An item: its query head's place g in the group, its query tile and the teacher's key head
  // (walked in order, so that the loops divide only when the query head changes).
  struct Item {
    int g, k, tile, head_t;  // k: the item's rank among its query head's tiles
  };
  __device__ __forceinline__ Item first_item(const AttentionArgs<T>& a) const {
    return Item{0, 0, first_tile + rotation, a.key_head_t(head * group)};
  }
  __device__ __forceinline__ void advance(Item& x, const AttentionArgs<T>& a) const {
    x.tile = x.tile + 1 == q_tiles ? first_tile : x.tile + 1;
    if (++x.k == per_head) {
      x.k = 0;
      ++x.g;
      x.head_t = a.key_head_t(head * group + x.g);
    }
  }
  __device__ __forceinline__ int query_head(const Item& x) const { return head * group + x.g; }
};

// 4 floats from shared memory (the pointer arithmetic above loses the address space, and a
// generic load costs more).
[[maybe_unused]] __device__ __forceinline__ float4 ld_shared_f4(const void* p) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(hopper::smem_addr(p)));
  return v;
}

template <typename T, int kDs, bool kReverse, bool kWithDq>
__global__ void __launch_bounds__(kThreadCount, 1)
    attention_kl_bwd_fused_kernel(const __grid_constant__ FusedBackwardMaps maps, const AttentionArgs<T> a) {
#if NITROBREW_SM90A_DEVICE
  using namespace hopper;
  constexpr int kDqN = kDs / 16;  // n-tiles of a warpgroup's dq slice
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint8_t* keys_s = smem;
  uint8_t* keys_t = smem + kRowBytes;
  uint8_t* ring = smem + 2 * kRowBytes;
  uint8_t* ds_tiles = ring + kStages * kStageBytes;  // [2][kDsBytes]
  float* dq_stage = reinterpret_cast<float*>(ds_tiles + 2 * kDsBytes);
  QueryGrad* query_data = reinterpret_cast<QueryGrad*>(dq_stage + kDqStageBytes / 4);  // [2][64]
  uint64_t* full = reinterpret_cast<uint64_t*>(query_data + 2 * kCols);
  uint64_t* empty = full + kStages;
  uint64_t* keys_s_full = empty + kStages;
  uint64_t* keys_t_full = keys_s_full + 1;
  uint64_t* keys_t_empty = keys_t_full + 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumerWarps);
    }
    mbar_init(keys_s_full, 1);
    mbar_init(keys_t_full, 1);
    mbar_init(keys_t_empty, kConsumerWarps);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  const FusedBlock<T> blk(a);
  const int slabs_s = (a.d_s + kK - 1) / kK, slabs_t = (a.d_t + kK - 1) / kK;

  if (threadIdx.x < kProducerThreads) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (threadIdx.x != 0 || blk.items == 0) return;
    const int32_t batch = static_cast<int32_t>(blk.b);
    mbar_arrive_expect_tx(keys_s_full, slabs_s * kRowSlabBytes);
    for (int ks = 0; ks < slabs_s; ++ks) {
      tma_load_4d(keys_s + ks * kRowSlabBytes, &maps.k_s, ks * kK, blk.head, blk.row0, batch, keys_s_full);
    }
    int loaded_t = -1, reloads = 0;
    RingPosition<kStages> slot;
    auto item = blk.first_item(a);
    for (int it = 0; it < blk.items; ++it, blk.advance(item, a)) {
      const int qh = blk.query_head(item), teacher_head = item.head_t;
      if (teacher_head != loaded_t) {  // GQA: the teacher's keys of this query head
        if (loaded_t >= 0) mbar_wait(keys_t_empty, (reloads++) & 1);
        mbar_arrive_expect_tx(keys_t_full, slabs_t * kRowSlabBytes);
        for (int ks = 0; ks < slabs_t; ++ks) {
          tma_load_4d(keys_t + ks * kRowSlabBytes, &maps.k_t, ks * kK, teacher_head, blk.row0, batch, keys_t_full);
        }
        loaded_t = teacher_head;
      }
      const int q0 = item.tile * kCols;
      mbar_wait(&empty[slot.stage], slot.phase ^ 1);
      uint8_t* stage = ring + slot.stage * kStageBytes;
      mbar_arrive_expect_tx(&full[slot.stage], (slabs_s + slabs_t) * kColSlabBytes);
      for (int ks = 0; ks < slabs_s; ++ks) {
        tma_load_4d(stage + ks * kColSlabBytes, &maps.q_s, ks * kK, qh, q0, batch, &full[slot.stage]);
      }
      for (int ks = 0; ks < slabs_t; ++ks) {
        tma_load_4d(stage + (kMaxSlabs + ks) * kColSlabBytes, &maps.q_t, ks * kK, qh, q0, batch, &full[slot.stage]);
      }
      slot.advance();
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int thread = threadIdx.x - kProducerThreads;
  // consumer read through a shuffle from lane 0: the compiler then knows it is the same in the
  // whole warp and keeps the descriptors derived from it in uniform registers.
  const int consumer = __shfl_sync(0xffffffffu, thread / 128, 0);
  const int wg_thread = thread % 128, warp = wg_thread / 32, lane = thread % 32;
  const int key_base = 64 * consumer + 16 * warp + lane / 4;  // the thread's keys: +0, +8 (block-relative)
  const int my_key0 = blk.row0 + key_base;
  bool key_ok[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int k = my_key0 + 8 * r;
    key_ok[r] = k < a.n_k && (a.key_mask == nullptr || a.key_mask[blk.b * a.n_k + k]);
  }
  const bool block_masked = a.key_mask != nullptr || blk.row0 + kRows > a.n_k;
  const float grad_scale = dscore_range_scale(a.grad_max, a.c_s);

  // The per-query data of item `it`: 64 GradRows (the upstream gradient not yet range-scaled),
  // loaded a tile ahead into registers by threads 0-63 and stored as QueryGrads into one of two
  // buffers. Item it + 1's are stored during item it, before item it's barrier B (below), which
  // every thread passes before item it + 1's dS reads them; a thread that stores them has passed
  // item it - 1's B, so every thread is done with that buffer's previous contents (item it - 1's).
  float prefetched[6];
  auto load_query_rows = [&](int it, const auto& item) {
    if (thread < kCols && it < blk.items) {
      const float* src = a.grad_rows + ((blk.b * a.heads + blk.query_head(item)) * a.grad_rows_per_head +
                                        item.tile * kCols + thread) * 6;
#pragma unroll
      for (int k = 0; k < 6; ++k) prefetched[k] = src[k];
    }
  };
  auto store_query_rows = [&](int it) {
    if (thread < kCols && it < blk.items) {
      query_data[(it & 1) * kCols + thread] =
          QueryGrad{(prefetched[0] + prefetched[1]) * kLog2e, (prefetched[2] + prefetched[3]) * kLog2e, prefetched[4],
                    prefetched[5] * grad_scale};
    }
  };

  // Items it (cur), it + 1 (next) and it + 2 (ahead, whose per-query rows are loaded).
  auto cur = blk.first_item(a), next = cur, ahead = cur;
  blk.advance(next, a);
  ahead = next;
  blk.advance(ahead, a);
  TileAcc<kDs / 8> dk;
  dk.zero();
  if (blk.items > 0) {
    load_query_rows(0, cur);
    store_query_rows(0);
    load_query_rows(1, next);
    asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
    mbar_wait(keys_s_full, 0);
  }
  // Descriptors computed once (the loop adds offsets): this warpgroup's keys of both models, the
  // ring's queries (K-major for the scores, MN-major for dk), the dS tiles and its half of K_s.
  const uint64_t keys_desc_s = smem_desc(keys_s + consumer * (kRowSlabBytes / 2));
  const uint64_t keys_desc_t = smem_desc(keys_t + consumer * (kRowSlabBytes / 2));
  const uint64_t ring_desc = smem_desc(ring), ring_mn_desc = mn_major_desc(ring, kColSlabBytes);
  const uint64_t ds_mn_desc = mn_major_desc(ds_tiles, kDsSlabBytes);
  const uint64_t k_half_mn_desc = mn_major_desc(keys_s + consumer * (kDs / 2 / kK) * kRowSlabBytes, kRowSlabBytes);
  const uint32_t full_addr = smem_addr(full), empty_addr = smem_addr(empty);
  int loaded_t = -1, reloads = 0;
  RingPosition<kStages> slot;

  for (int it = 0; it < blk.items; ++it) {
    // 1. S^T of both models, 64 keys x 64 queries, issued and committed, not waited for.
    if (cur.head_t != loaded_t) {  // GQA: the teacher's keys of this query head
      mbar_wait(keys_t_full, (reloads++) & 1);
      loaded_t = cur.head_t;
    }
    mbar_wait(full_addr + 8 * slot.stage, slot.phase);
    TileAcc<8> s, t;
    wgmma_scores_of_stage<T, kRowSlabBytes, kColSlabBytes, kMaxSlabs>(
        s, t, keys_desc_s, keys_desc_t, ring_desc + slot.stage * desc_step(kStageBytes), slabs_s, slabs_t);
    store_query_rows(it + 1);  // while the products run
    load_query_rows(it + 2, ahead);
    wgmma_wait<0>();
    fence_acc(s);
    fence_acc(t);
    if (it + 1 < blk.items && next.head_t != loaded_t && lane == 0) {
      mbar_arrive(keys_t_empty);  // this warp is done with the teacher's keys
    }

    // 2. dS^T, masked, in the input dtype: n-tiles 2k, 2k + 1 of the scores are k-step k of the
    // dk product's register operand.
    const int q0 = cur.tile * kCols;
    const QueryGrad* qd = query_data + (it & 1) * kCols;
    const bool masked = block_masked || q0 + kCols > a.n_q || (a.causal && blk.row0 + kRows - 1 > a.last_key(q0));
    uint32_t ds[4][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float v[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = 8 * j + 2 * (lane % 4) + (e & 1);
        const float4 g4 = ld_shared_f4(qd + q);
        const QueryGrad g{g4.x, g4.y, g4.z, g4.w};
        const float sv = __fmul_rn(s.v[j][e], a.c_s), tv = __fmul_rn(t.v[j][e], a.c_t);
        const float p = exp2_approx(fmaf(sv, kLog2e, -g.s_off2));
        float grad_s;
        if constexpr (kReverse) {
          grad_s = g.grad * (p * ((sv - tv) - g.center));
        } else {
          grad_s = g.grad * (p - exp2_approx(fmaf(tv, kLog2e, -g.t_off2)));
        }
        if (masked) {
          const int query = q0 + q, key = my_key0 + 8 * (e / 2);
          const bool visible = key_ok[e / 2] && query < a.n_q && (!a.causal || key <= a.last_key(query));
          grad_s = visible ? grad_s : 0.f;
        }
        v[e] = grad_s;
      }
      ds[j / 2][2 * (j % 2)] = pack2<T>(v[0], v[1]);
      ds[j / 2][2 * (j % 2) + 1] = pack2<T>(v[2], v[3]);
    }
    uint8_t* ds_tile = ds_tiles + (it & 1) * kDsBytes;
#pragma unroll
    for (int k = 0; k < 4 && kWithDq; ++k) {
      // Matrix m = lane / 8 of k-step k: keys key_base - lane / 4 + 8 (m & 1) + lane % 8,
      // queries 16 k + 8 (m >> 1) + (0..7): one 16-byte chunk of a swizzled 64-byte row.
      const int m = lane / 8, key = key_base - lane / 4 + 8 * (m & 1) + lane % 8;
      const int chunk = (2 * k + (m >> 1)) % 4;
      stmatrix_x4(ds_tile + (k / 2) * kDsSlabBytes + key * 64 + ((chunk ^ ((key >> 1) & 3)) * 16), ds[k]);
    }

    // 3. dk += dS^T . Q_s, Q_s read [64 queries][head dim] from the stage. For a head dim under
    // kDs the product also reads slabs no copy wrote: they only reach columns past the head
    // dim, which are never stored.
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(ds[k][e])::"memory");
    }
    fence_acc(dk);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      wgmma_rs<T, kDs / 8>(dk, ds[k], ring_mn_desc + slot.stage * desc_step(kStageBytes) + k * desc_step(1024), 1);
    }
    wgmma_commit();

    // Barrier B: the per-query data's buffers (above) and, with dq, both halves of dS stored.
    // Thread 0 of each warpgroup first makes sure that the previous tile's reduction has read the
    // staging buffer rewritten in step 5.
    if constexpr (kWithDq) {
      fence_proxy_async_shared();
      if (wg_thread == 0) bulk_wait_read();
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerThreads) : "memory");
    if constexpr (kWithDq) {
      // 4. dq slice = dS . K_s[:, this warpgroup's half of the head dim].
      TileAcc<kDqN> dq;
#pragma unroll
      for (int kk = 0; kk < kRows / 16; ++kk) {
        fence_acc(dq);
        wgmma_fence();
        wgmma_ss_mn<T, kDqN>(dq, ds_mn_desc + (it & 1) * desc_step(kDsBytes) + kk * desc_step(1024),
                             k_half_mn_desc + kk * desc_step(1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_acc(dk);
      fence_acc(dq);
      __syncwarp();  // the warp's products have read the stage before lane 0 releases it
      if (lane == 0) mbar_arrive(empty_addr + 8 * slot.stage);

      // 5. Stage the slice in fragment order (n-tile j of every thread, then the next n-tile) and
      // add it into the buffer with one bulk reduction (per-thread float4 reductions were 14%
      // slower: docs/notes/attention_kl.md).
      float* my_stage = dq_stage + consumer * kDqSliceFloats<kDs>;
#pragma unroll
      for (int j = 0; j < kDqN; ++j) {
        *reinterpret_cast<float4*>(my_stage + (j * 128 + wg_thread) * 4) =
            make_float4(dq.v[j][0], dq.v[j][1], dq.v[j][2], dq.v[j][3]);
      }
      fence_proxy_async_shared();
      asm volatile("bar.sync %0, %1;\n" ::"r"(2 + consumer), "n"(128) : "memory");
      if (wg_thread == 0) {
        const int64_t slice = ((blk.pair * blk.group + cur.g) * blk.q_tiles + cur.tile) * 2 + consumer;
        bulk_reduce_add_f32(a.dq_accum + slice * kDqSliceFloats<kDs>, my_stage, kDqSliceFloats<kDs> * 4);
        bulk_commit();
      }
    } else {
      wgmma_wait<0>();
      fence_acc(dk);
      __syncwarp();  // the warp's product has read the stage before lane 0 releases it
      if (lane == 0) mbar_arrive(empty_addr + 8 * slot.stage);
    }
    slot.advance();
    cur = next;
    next = ahead;
    blk.advance(ahead, a);
  }
  if (wg_thread == 0) bulk_wait();

  // The thread's two keys of dk, scaled back from dS's range.
  const float unscale = 1.f / grad_scale;
  const int d = a.d_s, col = 2 * (lane % 4);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int k = my_key0 + 8 * r;
    if (k >= a.n_k) continue;
    T* out = a.dk + ((blk.b * a.n_k + k) * a.key_heads_s + blk.head) * static_cast<int64_t>(d);
#pragma unroll
    for (int n = 0; n < kDs / 8; ++n) {
      if (8 * n + col < d) {
        *reinterpret_cast<uint32_t*>(out + 8 * n + col) = pack2<T>(dk.v[n][2 * r] * unscale, dk.v[n][2 * r + 1] * unscale);
      }
    }
  }
#endif
}

// dq from the float32 buffer of one chunk: one thread per float4 (an n-tile's four values of one
// consumer thread: rows r, r + 8 of its warp, columns c, c + 1), scaled back from dS's range.
template <typename T, int kDs>
__global__ void dq_from_fragments_kernel(const AttentionArgs<T> a, int64_t float4s) {
  constexpr int kDqN = kDs / 16;
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= float4s) return;
  const int group = a.heads / a.key_heads_s, q_tiles = (a.n_q + kCols - 1) / kCols;
  const int t = static_cast<int>(idx % 128);
  int64_t rest = idx / 128;
  const int j = static_cast<int>(rest % kDqN);
  rest /= kDqN;
  const int half = static_cast<int>(rest % 2);
  rest /= 2;
  const int q_tile = static_cast<int>(rest % q_tiles);
  rest /= q_tiles;
  const int g = static_cast<int>(rest % group);
  const int64_t pair = rest / group;
  const int64_t b = a.chunk_b0 + pair / a.chunk_key_heads;
  const int qh = (a.chunk_kh0 + static_cast<int>(pair % a.chunk_key_heads)) * group + g;
  const float4 v = reinterpret_cast<const float4*>(a.dq_accum)[idx];
  const float unscale = 1.f / dscore_range_scale(a.grad_max, a.c_s);
  const int row = 16 * (t / 32) + (t % 32) / 4, col = half * (kDs / 2) + 8 * j + 2 * (t % 4);
  if (col >= a.d_s) return;
  const float pair_values[2][2] = {{v.x, v.y}, {v.z, v.w}};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = q_tile * kCols + row + 8 * r;
    if (i >= a.n_q) continue;
    T* out = a.dq + ((b * a.n_q + i) * a.heads + qh) * static_cast<int64_t>(a.d_s) + col;
    *reinterpret_cast<uint32_t*>(out) = pack2<T>(pair_values[r][0] * unscale, pair_values[r][1] * unscale);
  }
}

// dk alone (deterministic=True: the dq kernel of bwd_dq_sm90.cu writes dq).
template <typename T, int kDs>
void launch_dk_only(const FusedBackwardMaps& maps, AttentionArgs<T> a, cudaStream_t stream) {
  auto* kernel = a.reverse ? &attention_kl_bwd_fused_kernel<T, kDs, true, false>
                           : &attention_kl_bwd_fused_kernel<T, kDs, false, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  a.chunk_b0 = 0;
  a.chunk_batches = a.batch;
  a.chunk_kh0 = 0;
  a.chunk_key_heads = a.key_heads_s;
  a.dq_accum = nullptr;
  const int64_t blocks = (a.n_k + kRows - 1) / kRows * a.batch * a.key_heads_s;
  TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (key tile, batch, key head) blocks: ", blocks);
  if (blocks == 0) return;
  kernel<<<static_cast<unsigned>(blocks), kThreadCount, kSmemBytes, stream>>>(maps, a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, int kDs>
void launch_fused(const FusedBackwardMaps& maps, AttentionArgs<T> a, const at::Tensor& q_s, cudaStream_t stream) {
  auto* kernel = a.reverse ? &attention_kl_bwd_fused_kernel<T, kDs, true, true>
                           : &attention_kl_bwd_fused_kernel<T, kDs, false, true>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const int64_t group = a.heads / a.key_heads_s, q_tiles = (a.n_q + kCols - 1) / kCols;
  const int64_t key_blocks = (a.n_k + kRows - 1) / kRows;
  const int64_t bytes_per_key_head = group * q_tiles * 2 * kDqSliceFloats<kDs> * static_cast<int64_t>(sizeof(float));
  const std::vector<DqChunk> chunks = dq_accum_chunks(a.batch, a.key_heads_s, bytes_per_key_head);
  int64_t most_pairs = 0;
  for (const DqChunk& c : chunks) most_pairs = std::max(most_pairs, c.batches * c.key_heads);
  at::Tensor accum = at::empty({most_pairs * bytes_per_key_head / 4}, q_s.options().dtype(at::kFloat));
  for (const DqChunk& c : chunks) {
    a.chunk_b0 = c.b0;
    a.chunk_batches = c.batches;
    a.chunk_kh0 = c.kh0;
    a.chunk_key_heads = c.key_heads;
    const int64_t pairs = c.batches * c.key_heads;
    at::Tensor chunk = accum.narrow(0, 0, pairs * bytes_per_key_head / 4);
    chunk.zero_();
    a.dq_accum = chunk.data_ptr<float>();
    const int64_t blocks = key_blocks * pairs;
    TORCH_CHECK(blocks < INT_MAX, "attention_kl: too many (key tile, batch, key head) blocks: ", blocks);
    kernel<<<static_cast<unsigned>(blocks), kThreadCount, kSmemBytes, stream>>>(maps, a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int64_t float4s = chunk.numel() / 4;
    const int64_t convert_blocks = (float4s + 255) / 256;
    TORCH_CHECK(convert_blocks < INT_MAX, "attention_kl: dq buffer too large: ", float4s);
    dq_from_fragments_kernel<T, kDs><<<static_cast<unsigned>(convert_blocks), 256, 0, stream>>>(a, float4s);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

template <typename T>
void launch_attention_kl_backward_hopper_fused(AttentionArgs<T> a, const at::Tensor& q_s, const at::Tensor& k_s,
                                               const at::Tensor& q_t, const at::Tensor& k_t, bool with_dq,
                                               cudaStream_t stream) {
  TORCH_CHECK(attention_kl_hopper_supports(a.d_s, a.d_t), "attention_kl: head dims over 128");
  const FusedBackwardMaps maps{head_tensor_map(k_s, kRows), head_tensor_map(k_t, kRows),
                               head_tensor_map(q_s, kCols), head_tensor_map(q_t, kCols)};
  if (a.d_s <= 64) {
    with_dq ? launch_fused<T, 64>(maps, a, q_s, stream) : launch_dk_only<T, 64>(maps, a, stream);
  } else {
    with_dq ? launch_fused<T, 128>(maps, a, q_s, stream) : launch_dk_only<T, 128>(maps, a, stream);
  }
}

template void launch_attention_kl_backward_hopper_fused(AttentionArgs<__nv_bfloat16>, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        bool, cudaStream_t);
template void launch_attention_kl_backward_hopper_fused(AttentionArgs<__half>, const at::Tensor&, const at::Tensor&,
                                                        const at::Tensor&, const at::Tensor&, bool, cudaStream_t);

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
