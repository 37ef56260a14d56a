// CUDA kernels of the top-K teacher ops from logits (nitrobrew.logits.topk_kl), normalize="full": forward
// KL over the K ids a teacher kept, sum_k q_k (log q_k - log p_{id_k}), with the same math as the CPU op
// (topk_logits_cpu.cpp). normalize="topk" (any divergence) is the K gathered logits' row math
// (divergence/topk_rows.h), shared with the CPU op. One block per row:
//   forward:  gathers the K student logits at the ids into the row's statistics first (the
//             backward reads them there, not scattered over the row), then the student's
//             log-normalizer (one streaming pass over the row in 16-byte loads, float32
//             exponentials summed per load, float64 across loads), the teacher's kept mass, and the
//             K terms in float64;
//   backward: writes (sum_k q_k) p_v for every v (float32 math, 16-byte stores) and each id's entry
//             in float64 with its q's subtracted. An id that appears several times gets one entry with every
//             occurrence's terms in the order of the ids: the row's (id, position) pairs are sorted
//             in shared memory first (bitonic, K up to kMaxSortedIds). The ids' entries are computed
//             before the pass over the row, which finds them among the entries it writes (K up to
//             kMaxStreamedIds, V up to 2^19); otherwise they are written again after it, by each
//             id's first occurrence (for K above kMaxSortedIds, found by comparing each id with the
//             ones before it, O(K^2) per row).
// The teacher's log-probabilities are read as float32 or float64, as given (other dtypes are
// widened to float32 first); the loss is written, and its gradient read, in the loss's dtype: no
// conversion kernels around the two launches.
// Non-finite inputs follow nonfinite.h: a teacher log-probability of NaN or +inf gives the row a NaN loss
// and a NaN gradient row. Ids outside
// [0, V) arrive here as id 0 with a NaN log-probability (guard_topk_ids): no device-side assertion.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include <limits>
#include <tuple>
#include <type_traits>

#include "../divergence/nonfinite.h"
#include "../divergence/online_state.h"
#include "../divergence/topk_rows.h"
#include "logits_params.h"
#include "../engine/cuda/cuda_types.h"
#include "../engine/cuda/row_kernels.cuh"

namespace nitrobrew {
namespace cuda {
namespace {


// The scaled logits s = z / tau are rounded to float32 for 16- and 32-bit inputs (float64 for
// float64), identically in every pass, as the other CUDA kernels round them; the row math on them
// runs in float64.
template <typename T>
using ScaleType = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The loss's dtype (and its gradient's): float32, float64 for float64 logits, as on the CPU.
template <typename T>
using LossType = std::conditional_t<std::is_same_v<T, double>, double, float>;

// The teacher's [N, K] log-probabilities (contiguous), float32 or float64.
struct LogProbs {
  const void* data;
  bool is_double;
  __device__ __forceinline__ double operator[](int64_t i) const {
    return is_double ? static_cast<const double*>(data)[i] : static_cast<double>(static_cast<const float*>(data)[i]);
  }
};

template <typename T>
struct TopKArgs {
  Rows<T> zs;
  bool vectorized;  // rows 16-byte aligned with unit stride (and dzs rows, in the backward)
  const int64_t* ids;   // [N, K] contiguous
  LogProbs lps;         // [N, K]
  const int64_t* labels;  // nullptr without labels
  int64_t ignore_index, vocab, k;
  double inv_t;
  __device__ __forceinline__ bool valid(int64_t n) const { return labels == nullptr || labels[n] != ignore_index; }
  // Entry v of row n as float64 (exact), as the statistics keep the gathered logits.
  __device__ __forceinline__ double z(int64_t n, int64_t v) const {
    return static_cast<double>(to_acc<ScaleType<T>>(zs.row(n)[v * zs.stride]));
  }
  // The scaled logit of a raw one, rounded as every pass rounds it.
  __device__ __forceinline__ double s(double z) const {
    using scale_t = ScaleType<T>;
    return scale_logit(static_cast<scale_t>(z), static_cast<scale_t>(inv_t));
  }
  __device__ __forceinline__ int64_t id(int64_t n, int64_t j) const { return ids[n * k + j]; }  // in [0, V)
};

// Block-wide maximum (NaN if any thread holds one); valid in every thread.
__device__ double block_max(double x) {
  __shared__ double scratch[kRowThreads / 32];
  __shared__ double result;
  for (int mask = 16; mask >= 1; mask >>= 1) x = nan_max(x, shfl(x, mask));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kRowThreads / 32; ++w) x = nan_max(x, scratch[w]);
    result = x;
  }
  __syncthreads();
  return result;
}

// log of sum_j exp(x_j - max) for the block's values (max known to every thread; -inf: none).
__device__ LogNormalizer<double> block_normalizer(double max, double sum) {
  double unused = 0;
  block_sum2(sum, unused);
  __shared__ double result;
  if (threadIdx.x == 0) result = sum;
  __syncthreads();
  return {max, log(result)};
}

// ------------------------------------------------------------------ the row's ids -----
// Up to this many ids per row the kernels sort them in shared memory (above, the backward compares
// each id with the ones before it).
constexpr int64_t kMaxSortedIds = 4096;
// Up to this many ids, and a vocabulary bitmap of at most kMaxBitmapBytes (V <= 2^19), the backward's
// pass over the row finds the ids among the entries it writes (one shared-memory word per 16-byte
// store) and writes their entries there, instead of visiting the ids afterwards with scattered
// 2-byte stores (which cost 0.29 ms of 3.1 at K = 512, 8192 x 152064 bf16).
constexpr int64_t kMaxStreamedIds = 1024;
constexpr int64_t kMaxBitmapBytes = 64 * 1024;

// Shared memory for the row's ids: `slots` sorted keys (0: no sort) and, for finding them in the
// stream (words > 0), a per-id value, a hash table from id to its first key, and a bitmap of the
// vocabulary (`words` 32-bit words).
struct IdLayout {
  int slots = 0, words = 0;
  __host__ __device__ int table_entries() const { return 2 * slots; }
  size_t bytes() const {
    size_t b = size_t(slots) * sizeof(uint64_t);
    if (words > 0) b += size_t(slots) * sizeof(double) + size_t(table_entries()) * sizeof(uint2) + size_t(words) * 4;
    return b;
  }
};

// Sorting needs K <= kMaxSortedIds and ids that fit the keys' 32 bits; `slots` is K rounded up to a
// power of two.
IdLayout id_layout(int64_t k, int64_t vocab) {
  IdLayout layout;
  if (k > kMaxSortedIds || vocab > (int64_t(1) << 32)) return layout;
  layout.slots = 1;
  while (layout.slots < k) layout.slots *= 2;
  const int64_t words = (vocab + 31) / 32;
  if (k <= kMaxStreamedIds && words * 4 <= kMaxBitmapBytes) layout.words = static_cast<int>(words);
  return layout;
}

// The row's ids as (id << 32 | position) keys, sorted ascending in `keys` (`slots` entries, a power
// of two >= K, padded with the largest key): equal ids end up adjacent, in the order of their
// positions. Every thread of the block must call it.
template <typename T>
__device__ void sort_row_ids(const TopKArgs<T>& a, int64_t n, uint64_t* keys, int slots) {
  for (int j = threadIdx.x; j < slots; j += blockDim.x) {
    keys[j] = j < a.k ? (static_cast<uint64_t>(a.id(n, j)) << 32) | static_cast<uint32_t>(j) : ~uint64_t(0);
  }
  __syncthreads();
  for (int size = 2; size <= slots; size *= 2) {  // bitonic sort
    for (int stride = size / 2; stride > 0; stride /= 2) {
      for (int t = threadIdx.x; t < slots / 2; t += blockDim.x) {
        const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
        const bool ascending = (lo & size) == 0;
        const uint64_t x = keys[lo], y = keys[hi];
        if ((x > y) == ascending) {
          keys[lo] = y;
          keys[hi] = x;
        }
      }
      __syncthreads();
    }
  }
}

constexpr uint32_t kNoId = 0xFFFFFFFFu;  // an empty hash-table entry (ids are < 2^19 there)

// A block's view of its row's ids in shared memory.
struct RowIds {
  const uint64_t* keys = nullptr;  // sorted
  const uint32_t* bits = nullptr;  // the vocabulary bitmap, or nullptr: the ids are not found in the stream
  uint2* table = nullptr;          // (id, its first key), open addressing
  double* values = nullptr;        // a value per id, at its first key
  int k = 0, table_mask = 0, table_shift = 32;
  __device__ __forceinline__ uint32_t id_at(int r) const { return static_cast<uint32_t>(keys[r] >> 32); }
  __device__ __forceinline__ uint32_t position_at(int r) const { return static_cast<uint32_t>(keys[r]); }
  __device__ __forceinline__ bool first_of_its_id(int r) const { return r == 0 || id_at(r - 1) != id_at(r); }
  // Which of the kN entries from v0 are ids (bit k: entry v0 + k); v0 is a multiple of kN, which
  // divides 32, so they share one word.
  template <int kN>
  __device__ __forceinline__ uint32_t ids_among(int64_t v0) const {
    return (bits[v0 >> 5] >> (v0 & 31)) & ((1u << kN) - 1u);
  }
  // The product's high bits: its low ones depend only on v's low bits, and ids that share many low
  // zero bits (multiples of 1024, say) would all land in one entry.
  __device__ __forceinline__ uint32_t slot(uint32_t v) const { return (v * 0x9E3779B1u) >> table_shift; }
  // The first key of id v (one of the ids), from the hash table.
  __device__ __forceinline__ int first(uint32_t v) const {
    uint32_t h = slot(v);
    while (table[h].x != v) h = (h + 1) & table_mask;
    return static_cast<int>(table[h].y);
  }
};

// Sorts the row's ids and, for a layout that finds them in the stream, marks them in the bitmap and
// enters each id's first key in the hash table. Every thread of the block must call it.
template <typename T>
__device__ RowIds load_row_ids(const TopKArgs<T>& a, int64_t n, uint64_t* smem, const IdLayout& layout) {
  sort_row_ids(a, n, smem, layout.slots);
  RowIds ids;
  ids.keys = smem;
  ids.k = static_cast<int>(a.k);
  if (layout.words == 0) return ids;
  ids.values = reinterpret_cast<double*>(smem + layout.slots);
  ids.table = reinterpret_cast<uint2*>(ids.values + layout.slots);
  ids.table_mask = layout.table_entries() - 1;
  ids.table_shift = 32 - (31 - __clz(layout.table_entries()));  // table_entries is a power of two >= 2
  uint32_t* bits = reinterpret_cast<uint32_t*>(ids.table + layout.table_entries());
  for (int w = threadIdx.x; w < layout.words; w += blockDim.x) bits[w] = 0;
  for (int e = threadIdx.x; e < layout.table_entries(); e += blockDim.x) ids.table[e] = make_uint2(kNoId, 0);
  __syncthreads();
  for (int r = threadIdx.x; r < a.k; r += blockDim.x) {
    const uint32_t v = ids.id_at(r);
    atomicOr(&bits[v >> 5], 1u << (v & 31));
    if (!ids.first_of_its_id(r)) continue;
    uint32_t h = ids.slot(v);
    while (atomicCAS(&ids.table[h].x, kNoId, v) != kNoId) h = (h + 1) & ids.table_mask;
    ids.table[h].y = static_cast<uint32_t>(r);
  }
  __syncthreads();
  ids.bits = bits;
  return ids;
}

// ------------------------------------------------------------------------ forward -----
// A thread's online (max, sum) over its entries of the row, summed in float64: for 16-bit inputs
// the special-function unit's float32 exponentials (a relative error of ~1e-7 per term, below the
// inputs' rounding), float64 ones otherwise (as the CPU op).
template <typename T>
struct NormAccumulator {
  using scale_t = ScaleType<T>;
  scale_t m = kNegInf<scale_t>;
  double l = 0;

  template <int kN>
  __device__ __forceinline__ void chunk(const scale_t (&s)[kN], int64_t) {
    scale_t chunk_max = s[0];
#pragma unroll
    for (int k = 1; k < kN; ++k) chunk_max = nan_max(s[k], chunk_max);
    if (chunk_max == kNegInf<scale_t>) return;  // only masked entries
    if (!(chunk_max <= m)) {  // rare after the row's first chunks; a NaN makes l NaN from here on
      l *= m == kNegInf<scale_t> ? 0.0 : exp(static_cast<double>(m) - chunk_max);
      m = chunk_max;
    }
    if constexpr (sizeof(T) == 2) {  // a load's 8 exponentials summed in float32 first
      float part = 0;
#pragma unroll
      for (int k = 0; k < kN; ++k) part += RowExp<T, float>{}(s[k] - m);  // exp(-inf) = 0
      l += part;
    } else {  // float64 exponentials: float32 ones were off by 3.5x float32 PyTorch at logit scale 1e-3
#pragma unroll
      for (int k = 0; k < kN; ++k) l += exp(static_cast<double>(s[k]) - m);
    }
  }
};

// The student's log-normalizer over the whole row, merged across the block (every thread).
template <typename T>
__device__ LogNormalizer<double> full_normalizer(const TopKArgs<T>& a, int64_t n) {
  using scale_t = ScaleType<T>;
  NormAccumulator<T> acc;
  for_each_row_chunk<16 / sizeof(T), T, scale_t>(a.zs.row(n), a.zs.stride, a.vocab, a.vectorized,
                                                 static_cast<scale_t>(a.inv_t), acc);
  const double m = acc.m == kNegInf<scale_t> ? kNegInf<double> : static_cast<double>(acc.m);
  const double row_max = block_max(m);
  const double scaled = m == kNegInf<double> ? 0.0 : acc.l * exp(m - row_max);
  return block_normalizer(row_max, scaled);
}

// The row's normalizers as the CPU op forms them (its row_norms), in every thread.
template <typename T>
__device__ void row_norms(const TopKArgs<T>& a, int64_t n, LogNormalizer<double>& student,
                          LogNormalizer<double>& teacher) {
  // The student's first: the teacher's values live through the stream over the row spilled the 16-bit kernel
  // on sm_80 (16 bytes at its 40-register bound), once its "topk" branch was gone.
  student = full_normalizer(a, n);
  const int64_t lp0 = n * a.k;
  double lp_key = kNegInf<double>;
  for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) lp_key = fmax(lp_key, teacher_max_key(a.lps[lp0 + j]));
  const double lp_max = teacher_row_max(block_max(lp_key));
  double mass = 0;
  if (lp_max != kNegInf<double>) {
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) mass += exp(a.lps[lp0 + j] - lp_max);
  }
  teacher = block_normalizer(lp_max, mass);
}

// Blocks per SM the kernels are compiled for: 6 (<= 40 registers) for 16-bit logits, enough bytes in
// flight per SM with two 16-byte loads per thread (for_each_row_chunk); float32 and float64 logits
// (float64 exponentials) would spill at 40.
template <typename T>
constexpr int RowBlocksPerSM = sizeof(T) == 2 ? 6 : 1;

// Writes loss[n] and the row's statistics: [kNumTopKRowStats + K] columns, the last K the raw
// logits at the ids (kTopKLogitsColumn, as the ops from hidden states keep them), gathered first so
// that these scattered loads are in flight with the pass over the row. (Finding the ids in the
// pass over the row instead, as the backward does, made this kernel slower: 1.17 against 0.87 ms at
// K = 32, 1.44 against 1.01 at K = 512, 8192 x 152064 bf16.)
template <typename T>
__global__ void __launch_bounds__(kRowThreads, RowBlocksPerSM<T>)
    topk_forward_kernel(TopKArgs<T> a, LossType<T>* loss, double* stats) {
  const int64_t n = blockIdx.x;
  double* row = stats + n * (kTopKLogitsColumn + a.k);
  double* gathered = row + kTopKLogitsColumn;
  if (!a.valid(n)) {
    for (int64_t j = threadIdx.x; j < kTopKLogitsColumn + a.k; j += blockDim.x) row[j] = 0.0;
    if (threadIdx.x == 0) loss[n] = 0;
    return;
  }
  // Each thread reads back only the entries it gathered here (positions j = threadIdx.x mod blockDim.x).
  for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) gathered[j] = a.z(n, a.id(n, j));
  LogNormalizer<double> student, teacher;
  row_norms(a, n, student, teacher);
  const int64_t lp0 = n * a.k;
  double total = 0, unused = 0;
  const bool undefined = topk_row_undefined(teacher.max);  // uniform in the block
  if (teacher.max != kNegInf<double> && !undefined) {
    for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) {
      const double lp = a.lps[lp0 + j];
      if (lp == kNegInf<double>) continue;  // q = 0: 0 log 0 = 0
      total += exp(lp) * (lp - log_prob(a.s(gathered[j]), student));
    }
  }
  block_sum2(total, unused);
  if (threadIdx.x != 0) return;
  row[kTopKMax] = student.max;
  row[kTopKLogSum] = student.log_sum;
  row[kTopKTeacherMax] = teacher.max;
  row[kTopKTeacherLogSum] = teacher.log_sum;
  row[kTopKGradCenter] = 0.0;  // renormalized rows' only
  loss[n] = static_cast<LossType<T>>(undefined ? kNaN<double> : total);
}

// ----------------------------------------------------------------------- backward -----
// The id entry's value: the dense term (from the first occurrence's p) and every occurrence's term,
// added in the order of the occurrences.
struct IdEntry {
  double coef, mass, p;
  __device__ __forceinline__ double start() const { return coef * mass * p; }
  __device__ __forceinline__ double term(double lp) const { return lp == kNegInf<double> ? 0.0 : -coef * exp(lp); }
};

// What the backward knows of an active row: the gradient's scale, both normalizers, the teacher's
// log-probabilities.
struct RowGrad {
  double coef, mass;
  LogNormalizer<double> student;
  LogProbs lps;
  int64_t lp0;
  // The entry of the id at sorted keys [r, ...); s_at(j): the scaled logit of the occurrence at position j.
  template <typename ScaledLogitAt>
  __device__ __forceinline__ double id_entry(const RowIds& ids, int r, ScaledLogitAt s_at) const {
    const IdEntry e{coef, mass, exp(log_prob(s_at(ids.position_at(r)), student))};
    const uint32_t v = ids.id_at(r);
    double g = e.start();
    for (int i = r; i < ids.k && ids.id_at(i) == v; ++i) g += e.term(lps[lp0 + ids.position_at(i)]);
    return g;
  }
};

// The backward's pass over the row: every entry as if no id were there, scale * p_v, in the scaled
// logits' precision, 16-byte stores where the rows allow; with the
// row's id bitmap also the ids' entries, computed before the pass (ids.values; else phase 2 of the
// kernel rewrites them).
template <typename T>
struct DenseGradWriter {
  using scale_t = ScaleType<T>;
  LogNormalizer<scale_t> norm;
  scale_t scale;  // g_n (sum_k q_k) / tau, or 0
  T* out;
  RowIds ids;

  template <int kN>
  __device__ __forceinline__ void chunk(const scale_t (&s)[kN], int64_t v0) {
    alignas(16) T g[kN];
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      g[k] = from_acc<T>(scale == scale_t(0) ? scale_t(0) : scale * RowExp<T, scale_t>{}(log_prob(s[k], norm)));
    }
    if (ids.bits != nullptr) {
      const uint32_t found = ids.ids_among<kN>(v0);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
        if ((found >> k) & 1u) g[k] = from_acc<T>(ids.values[ids.first(static_cast<uint32_t>(v0 + k))]);
      }
    }
    if constexpr (kN * sizeof(T) == 16) {
      *reinterpret_cast<uint4*>(out + v0) = *reinterpret_cast<const uint4*>(g);
    } else {
#pragma unroll
      for (int k = 0; k < kN; ++k) out[v0 + k] = g[k];
    }
  }
};

// `layout`: the ids' shared memory (sorted keys, with or without the bitmap; none: O(K^2) search).
template <typename T>
__global__ void __launch_bounds__(kRowThreads, RowBlocksPerSM<T>)
    topk_backward_kernel(TopKArgs<T> a, const LossType<T>* grad_loss, const double* stats, T* dzs,
                         IdLayout layout) {
  extern __shared__ uint64_t id_smem[];
  const int64_t n = blockIdx.x;
  const double* row = stats + n * (kTopKLogitsColumn + a.k);
  const double* gathered = row + kTopKLogitsColumn;  // the forward's logits at the ids
  const auto scaled_at = [&](int j) { return a.s(gathered[j]); };
  T* out = dzs + n * a.vocab;
  if (a.valid(n) && topk_row_undefined(row[kTopKTeacherMax])) {  // uniform in the block
    for (int64_t v = threadIdx.x; v < a.vocab; v += blockDim.x) out[v] = from_acc<T>(kNaN<double>);
    return;
  }
  const bool active = a.valid(n) && row[kTopKTeacherMax] != kNegInf<double>;  // uniform in the block
  const RowGrad grad{static_cast<double>(grad_loss[n]) * a.inv_t,
                     active ? exp(row[kTopKTeacherMax] + row[kTopKTeacherLogSum]) : 0.0,
                     {row[kTopKMax], row[kTopKLogSum]},
                     a.lps,
                     n * a.k};
  RowIds ids;
  if (active && layout.slots > 0) ids = load_row_ids(a, n, id_smem, layout);
  if (ids.bits != nullptr) {  // the ids' entries, for the pass over the row to write
    for (int r = threadIdx.x; r < a.k; r += blockDim.x) {
      if (ids.first_of_its_id(r)) ids.values[r] = grad.id_entry(ids, r, scaled_at);
    }
    __syncthreads();
  }
  using scale_t = ScaleType<T>;
  DenseGradWriter<T> writer{{static_cast<scale_t>(grad.student.max), static_cast<scale_t>(grad.student.log_sum)},
                            static_cast<scale_t>(active ? grad.coef * grad.mass : 0.0), out, ids};
  for_each_row_chunk<16 / sizeof(T), T, scale_t>(a.zs.row(n), a.zs.stride, a.vocab, a.vectorized,
                                                 static_cast<scale_t>(a.inv_t), writer);
  if (!active || ids.bits != nullptr) return;
  __syncthreads();  // the pass's stores are visible to the block before any id's entry is rewritten
  // Phase 2: each id's entry, written once by its first occurrence.
  if (layout.slots > 0) {
    for (int r = threadIdx.x; r < a.k; r += blockDim.x) {
      if (!ids.first_of_its_id(r)) continue;
      out[ids.id_at(r)] = from_acc<T>(grad.id_entry(ids, r, scaled_at));
    }
    return;
  }
  for (int64_t j = threadIdx.x; j < a.k; j += blockDim.x) {
    const int64_t v = a.id(n, j);
    bool first = true;
    for (int64_t i = 0; i < j && first; ++i) first = a.id(n, i) != v;
    if (!first) continue;
    const IdEntry e{grad.coef, grad.mass, exp(log_prob(a.s(gathered[j]), grad.student))};
    double g = e.start();
    for (int64_t i = j; i < a.k; ++i) {
      if (a.id(n, i) == v) g += e.term(a.lps[grad.lp0 + i]);
    }
    out[v] = from_acc<T>(g);
  }
}

template <typename T>
TopKArgs<T> topk_args(const at::Tensor& zs, const at::Tensor& ids, const at::Tensor& lps,
                      const c10::optional<at::Tensor>& labels, const TopKParams& p) {
  TopKArgs<T> a;
  a.zs = {reinterpret_cast<const T*>(zs.data_ptr()), zs.stride(0), zs.stride(1)};
  a.ids = ids.data_ptr<int64_t>();
  a.lps = {lps.data_ptr(), lps.scalar_type() == at::kDouble};
  a.labels = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  a.ignore_index = p.ignore_index;
  a.vocab = p.vocab_size;
  a.k = p.k;
  a.inv_t = p.inv_temperature;
  a.vectorized = zs.stride(1) == 1 && reinterpret_cast<uintptr_t>(zs.data_ptr()) % 16 == 0 &&
                 (zs.stride(0) * zs.element_size()) % 16 == 0;
  return a;
}

// Launches one block per row with the ids' shared memory as the kernel's last argument (opting in to
// more than 48 KB where the layout needs it).
template <typename... Params, typename... Args>
void launch_rows(void (*kernel)(Params...), int64_t rows, const IdLayout& layout, Args... args) {
  const size_t smem = layout.bytes();
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
  // Shared memory before L1, so that the blocks per SM the kernels are built for fit beside their ids.
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      smem > 0 ? cudaSharedmemCarveoutMaxShared : cudaSharedmemCarveoutDefault));
  kernel<<<static_cast<unsigned>(rows), kRowThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(args..., layout);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The teacher's log-probabilities as the kernels read them: float32 or float64 as given, contiguous.
at::Tensor kernel_logprobs(const at::Tensor& lps) {
  const bool readable = lps.scalar_type() == at::kFloat || lps.scalar_type() == at::kDouble;
  return (readable ? lps : lps.to(at::kFloat)).contiguous();
}

std::tuple<at::Tensor, at::Tensor> topk_logits_fwd_cuda(const at::Tensor& zs, const at::Tensor& teacher_ids,
                                                              const at::Tensor& teacher_logprobs,
                                                              const c10::optional<at::Tensor>& labels_in,
                                                              int64_t ignore_index, double temperature,
                                                              bool renormalize, c10::string_view divergence,
                                                              double beta) {
  const TopKParams p = make_topk_logits_params(zs, teacher_ids, teacher_logprobs, labels_in, ignore_index, temperature,
                                              renormalize, divergence, beta, /*check_ids_on_host=*/false);
  TORCH_CHECK(zs.is_cuda() && zs.size(0) < (int64_t(1) << 31), "zs must be a CUDA tensor of fewer than 2^31 rows");
  const c10::cuda::CUDAGuard guard(zs.device());
  const GuardedTopK teacher = guard_topk_ids(teacher_ids, teacher_logprobs, p.vocab_size);
  if (p.renormalize) {
    return topk_gathered_forward(zs, teacher.ids, teacher.logprobs, topk_valid_rows(labels_in, p, zs), p,
                                 at::kDouble);
  }
  const at::Tensor ids = teacher.ids.contiguous(), lps = kernel_logprobs(teacher.logprobs);
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  // The loss in the inputs' accumulation dtype (float32, float64 for float64), as on the CPU.
  const auto loss_dtype = zs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor loss = at::empty({p.num_rows}, zs.options().dtype(loss_dtype));
  at::Tensor stats = at::empty({p.num_rows, kTopKLogitsColumn + p.k}, zs.options().dtype(at::kDouble));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "topk_logits_fwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    if (p.num_rows == 0) return;
    topk_forward_kernel<T><<<static_cast<unsigned>(p.num_rows), kRowThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        topk_args<T>(zs, ids, lps, labels, p), loss.data_ptr<LossType<T>>(), stats.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, stats};
}

at::Tensor topk_logits_bwd_cuda(const at::Tensor& grad_loss, const at::Tensor& zs, const at::Tensor& teacher_ids,
                                       const at::Tensor& teacher_logprobs, const c10::optional<at::Tensor>& labels_in,
                                       const at::Tensor& row_stats, int64_t ignore_index, double temperature,
                                       bool renormalize, c10::string_view divergence, double beta) {
  const TopKParams p = make_topk_logits_params(zs, teacher_ids, teacher_logprobs, labels_in, ignore_index, temperature,
                                              renormalize, divergence, beta, /*check_ids_on_host=*/false);
  check_topk_backward_inputs(grad_loss, row_stats, kTopKLogitsColumn + p.k, p, zs.device());
  const c10::cuda::CUDAGuard guard(zs.device());
  const GuardedTopK teacher = guard_topk_ids(teacher_ids, teacher_logprobs, p.vocab_size);
  if (p.renormalize) {
    return topk_gathered_backward(grad_loss, zs, teacher.ids, teacher.logprobs, topk_valid_rows(labels_in, p, zs),
                                  row_stats, p, at::kDouble);
  }
  const at::Tensor ids = teacher.ids.contiguous(), lps = kernel_logprobs(teacher.logprobs);
  const auto loss_dtype = zs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor g = grad_loss.to(loss_dtype).contiguous(), stats = row_stats.to(at::kDouble).contiguous();
  const c10::optional<at::Tensor> labels =
      labels_in.has_value() ? c10::optional<at::Tensor>(labels_in->contiguous()) : c10::nullopt;
  at::Tensor dzs = at::empty({p.num_rows, p.vocab_size}, zs.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, zs.scalar_type(), "topk_logits_bwd_cuda", [&] {
    using T = cuda_type_t<scalar_t>;
    if (p.num_rows == 0) return;
    TopKArgs<T> a = topk_args<T>(zs, ids, lps, labels, p);
    a.vectorized = a.vectorized && (p.vocab_size * dzs.element_size()) % 16 == 0;  // dzs rows take 16-byte stores
    launch_rows(topk_backward_kernel<T>, p.num_rows, id_layout(p.k, p.vocab_size), a,
                g.data_ptr<LossType<T>>(), stats.data_ptr<double>(), reinterpret_cast<T*>(dzs.data_ptr()));
  });
  return dzs;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("topk_logits_fwd", &topk_logits_fwd_cuda);
  m.impl("topk_logits_bwd", &topk_logits_bwd_cuda);
}

}  // namespace cuda
}  // namespace nitrobrew
