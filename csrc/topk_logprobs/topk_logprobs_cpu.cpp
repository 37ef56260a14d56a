// CPU implementation of topk_logprobs: one walk over vocabulary tiles of the logits
// softcap(logit_scale * (x . w^T + bias)) / temperature, formed by ATen's BLAS a tile at a time, with
// each row's running top-K (a heap of K candidates) and online log-sum-exp and entropy sums. Memory
// beyond the outputs: one [row_tile, vocab_tile] tile and w's tile in the accumulation dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "../engine/cpu/tile_walk.h"
#include "../engine/numerics.h"
#include "topk_logprobs_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

template <typename T>
struct Candidate {
  T value;
  int64_t id;
};

// The order of the output: larger value first, ties to the lower id. As a heap's "less than" it puts the
// worst kept candidate on top.
template <typename T>
bool better(const Candidate<T>& a, const Candidate<T>& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// One row's state through the walk: the log-sum-exp as (max m, sum of exp(s - m)), the entropy's
// sum of exp(s - m) * (s - m), and the K best candidates so far.
template <typename T>
struct RowState {
  T max = kNegInf<T>, sum = T(0), centered = T(0);
  bool undefined = false;  // a NaN or +inf logit: the row's outputs are NaN
  int64_t kept = 0;

  void add(T s, int64_t id, Candidate<T>* heap, int64_t k) {
    if (std::isnan(s) || s == std::numeric_limits<T>::infinity()) {
      undefined = true;
      return;
    }
    if (s > max) {  // a new maximum: rescale the sums to it (s - max is 0 for s itself)
      if (max == kNegInf<T>) {
        sum = T(1);
        centered = T(0);
      } else {
        const T shift = max - s, scale = std::exp(shift);
        centered = scale * (centered + shift * sum);
        sum = scale * sum + T(1);
      }
      max = s;
    } else if (s != kNegInf<T>) {  // -inf: probability 0, no term
      const T d = s - max, e = std::exp(d);
      sum += e;
      centered += e * d;
    }
    // Ids arrive in increasing order, so a candidate equal to the worst kept one loses the tie.
    const Candidate<T> c{s, id};
    if (kept < k) {
      heap[kept++] = c;
      std::push_heap(heap, heap + kept, better<T>);
    } else if (s > heap[0].value) {
      std::pop_heap(heap, heap + k, better<T>);
      heap[k - 1] = c;
      std::push_heap(heap, heap + k, better<T>);
    }
  }
};

template <typename scalar_t>
std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_logprobs_walk(const at::Tensor& x, const at::Tensor& w,
                                                                  const c10::optional<at::Tensor>& bias,
                                                                  const TopKLogprobsParams& p) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto acc_dtype = c10::CppTypeToScalarType<acc_t>::value;
  const int64_t n = p.num_rows, k = p.k;
  const at::Tensor x_acc = x.to(acc_dtype).contiguous();
  const at::Tensor bias_acc = bias.has_value() ? bias->to(acc_dtype) : at::Tensor();
  std::vector<RowState<acc_t>> rows(n);
  std::vector<Candidate<acc_t>> heaps(n * k);
  const TilePlan plan = plan_tiles(n, p.vocab_size, p.chunk_v);
  at::Tensor buffer = at::empty({n == 0 ? 0 : plan.row_tile * plan.vocab_tile}, x_acc.options());
  const acc_t scale = static_cast<acc_t>(p.logit_scale), cap = static_cast<acc_t>(p.softcap);
  const acc_t inv_t = static_cast<acc_t>(p.inv_temperature);

  for (int64_t v0 = 0; v0 < p.vocab_size && n > 0; v0 += plan.vocab_tile) {
    const int64_t cols = std::min(plan.vocab_tile, p.vocab_size - v0);
    const at::Tensor w_tile = w.narrow(0, v0, cols).to(acc_dtype).contiguous();
    for (int64_t r0 = 0; r0 < n; r0 += plan.row_tile) {
      const int64_t count = std::min(plan.row_tile, n - r0);
      at::Tensor z = buffer.narrow(0, 0, count * cols).view({count, cols});
      at::mm_out(z, x_acc.narrow(0, r0, count), w_tile.t());
      if (bias_acc.defined()) z.add_(bias_acc.narrow(0, v0, cols));
      const acc_t* z_data = z.data_ptr<acc_t>();
      at::parallel_for(0, count, 8, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          RowState<acc_t>& state = rows[r0 + r];
          Candidate<acc_t>* heap = heaps.data() + (r0 + r) * k;
          const acc_t* z_row = z_data + r * cols;
          for (int64_t v = 0; v < cols; ++v) {
            state.add(scale_logit(model_logit(z_row[v], scale, cap), inv_t), v0 + v, heap, k);
          }
        }
      });
    }
  }

  at::Tensor logprobs = at::empty({n, k}, x_acc.options());
  at::Tensor ids = at::empty({n, k}, x.options().dtype(at::kLong));
  at::Tensor stats = at::empty({n, kNumTopKLogprobsStats}, x_acc.options());
  acc_t* lp = logprobs.data_ptr<acc_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  acc_t* st = stats.data_ptr<acc_t>();
  const acc_t nan = std::numeric_limits<acc_t>::quiet_NaN();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const RowState<acc_t>& state = rows[r];
      if (state.undefined || state.max == kNegInf<acc_t>) {  // no distribution: NaN, ids 0..k-1
        for (int64_t j = 0; j < k; ++j) {
          lp[r * k + j] = nan;
          id[r * k + j] = j;
        }
        st[r * kNumTopKLogprobsStats + kLogNormalizer] = nan;
        st[r * kNumTopKLogprobsStats + kEntropy] = nan;
        continue;
      }
      Candidate<acc_t>* heap = heaps.data() + r * k;
      std::sort_heap(heap, heap + k, better<acc_t>);  // best first
      const acc_t log_sum = std::log(state.sum), lse = state.max + log_sum;
      for (int64_t j = 0; j < k; ++j) {
        lp[r * k + j] = heap[j].value - lse;
        id[r * k + j] = heap[j].id;
      }
      st[r * kNumTopKLogprobsStats + kLogNormalizer] = lse;
      st[r * kNumTopKLogprobsStats + kEntropy] = log_sum - state.centered / state.sum;
    }
  });
  return {logprobs, ids, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> topk_logprobs_cpu(const at::Tensor& x, const at::Tensor& w, int64_t k,
                                                                 const c10::optional<at::Tensor>& bias,
                                                                 double temperature, c10::optional<double> softcap,
                                                                 double logit_scale, int64_t vocab_size,
                                                                 int64_t chunk_v) {
  const TopKLogprobsParams p =
      make_topk_logprobs_params(x, w, k, bias, temperature, softcap, logit_scale, vocab_size, chunk_v);
  TORCH_CHECK(x.device().is_cpu(), "x must be a CPU tensor here, got ", x.device());
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "topk_logprobs_cpu",
                                  [&] { out = topk_logprobs_walk<scalar_t>(x, w, bias, p); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) { m.impl("topk_logprobs", &topk_logprobs_cpu); }

}  // namespace cpu
}  // namespace nitrobrew
