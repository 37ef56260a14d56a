// The attention-KL ops on CUDA: input checks, the layout the kernels read, output allocation, and
// the choice of kernels; the kernels and their launchers are in fwd_sm90.cu (sm_90a
// forward), fwd_sm80.cu (mma.sync forward), bwd_sm90.cu (sm_90a
// backward), bwd_dq_sm90.cu (its deterministic form) and bwd_sm80.cu (mma.sync
// backward). float32 inputs take the chunked ATen path (attention_kl_chunked.h) instead: the
// kernels multiply 16-bit operands on tensor cores, and float32 results must be float32-exact.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <climits>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "../engine/cuda/arch.h"
#include "../engine/cuda/sm90/tma.h"
#include "attention_kl_chunked.h"
#include "attention_kl_kernels.h"
#include "attention_kl_params.h"

namespace nitrobrew {
namespace cuda {
namespace attention {
namespace {

inline int round_up(int x, int multiple) { return (x + multiple - 1) / multiple * multiple; }

inline bool is_16_bit(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf;
}

inline void check_cuda_inputs(const at::Tensor& q_s, const AttentionKLParams& p) {
  TORCH_CHECK(is_16_bit(q_s) || q_s.scalar_type() == at::kFloat,
              "attention_kl: CUDA takes bfloat16 or float16 inputs (tensor cores, as FlashAttention) or float32 "
              "ones (exact float32 products, slower), got ", q_s.scalar_type(),
              "; cast q and k, e.g. q.to(torch.bfloat16)");
  TORCH_CHECK(!is_16_bit(q_s) || (p.dim_s <= 256 && p.dim_t <= 256),
              "attention_kl: the CUDA kernels take head dims up to 256, got ", p.dim_s, " (student) and ", p.dim_t,
              " (teacher)");
  TORCH_CHECK(p.n_queries < INT_MAX / 2 && p.n_keys < INT_MAX / 2 && p.heads < INT_MAX / 2,
              "attention_kl: sequence lengths and head counts must be below 2^30");
}

// Whether the kernels can read a [B, N, H, D] view where it lies: 16-byte chunks of a contiguous
// head dim (D % 8 == 0), a 16-byte aligned base, and B, N, H strides (of the dims longer than 1) that
// are positive multiples of 16 bytes, below TMA's 2^40 bytes. A [B, H, N, D] tensor viewed as
// [B, N, H, D] qualifies, as does any contiguous one with D % 8 == 0.
inline bool readable_in_place(const at::Tensor& t) {
  const int64_t per_chunk = 16 / t.element_size();
  if (t.size(3) % per_chunk != 0 || t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) {
    return false;
  }
  for (int dim = 0; dim < 3; ++dim) {
    const int64_t stride = t.stride(dim), bytes = stride * t.element_size();
    if (t.size(dim) > 1 && (stride <= 0 || stride % per_chunk != 0 || bytes >= (int64_t(1) << 40))) return false;
  }
  return true;
}

// An input as the kernels read it: the tensor itself where readable_in_place; otherwise a
// contiguous copy, D padded with zeros to a multiple of 8 (16-byte cp.async chunks; zeros leave
// every dot product unchanged), 16-byte aligned.
inline at::Tensor kernel_layout(const at::Tensor& t) {
  if (readable_in_place(t)) return t;
  at::Tensor out = t.contiguous();
  if (out.size(3) % 8 != 0) out = at::constant_pad_nd(out, {0, 8 - out.size(3) % 8});
  if (reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 != 0) out = out.clone();
  return out;
}

// The four inputs and the mask in kernel layout (kept alive for the launches).
struct KernelInputs {
  at::Tensor q_s, k_s, q_t, k_t, key_mask;

  KernelInputs(const at::Tensor& q_s_, const at::Tensor& k_s_, const at::Tensor& q_t_, const at::Tensor& k_t_,
               const c10::optional<at::Tensor>& mask)
      : q_s(kernel_layout(q_s_)), k_s(kernel_layout(k_s_)), q_t(kernel_layout(q_t_)), k_t(kernel_layout(k_t_)) {
    if (mask.has_value()) key_mask = mask->contiguous();
  }

  // The kernels' arguments; d_s_pad is the student's product extent (the backward kernels hold
  // D_s-wide accumulators and pass their template width).
  template <typename T>
  AttentionArgs<T> args(const AttentionKLParams& p, int d_s_pad) const {
    AttentionArgs<T> a{};
    a.q_s = reinterpret_cast<const T*>(q_s.data_ptr());
    a.k_s = reinterpret_cast<const T*>(k_s.data_ptr());
    a.q_t = reinterpret_cast<const T*>(q_t.data_ptr());
    a.k_t = reinterpret_cast<const T*>(k_t.data_ptr());
    a.st_q_s = head_strides(q_s);
    a.st_k_s = head_strides(k_s);
    a.st_q_t = head_strides(q_t);
    a.st_k_t = head_strides(k_t);
    a.key_mask = key_mask.defined() ? key_mask.data_ptr<bool>() : nullptr;
    a.batch = p.batch;
    a.n_q = static_cast<int>(p.n_queries);
    a.n_k = static_cast<int>(p.n_keys);
    a.heads = static_cast<int>(p.heads);
    a.key_heads_s = static_cast<int>(p.key_heads_s);
    a.key_heads_t = static_cast<int>(p.key_heads_t);
    a.d_s = static_cast<int>(q_s.size(3));
    a.d_t = static_cast<int>(q_t.size(3));
    a.d_s_pad = d_s_pad;
    a.d_t_pad = round_up(a.d_t, 16);
    a.c_s = static_cast<float>(p.scale_s * p.inv_temperature);
    a.c_t = static_cast<float>(p.scale_t * p.inv_temperature);
    a.reverse = p.reverse;
    a.causal = p.causal;
    return a;
  }
};

std::tuple<at::Tensor, at::Tensor> attention_kl_fwd_cuda(const at::Tensor& q_s, const at::Tensor& k_s,
                                                         const at::Tensor& q_t, const at::Tensor& k_t,
                                                         const c10::optional<at::Tensor>& key_mask, c10::string_view divergence,
                                                         bool causal, double scale_s, double scale_t,
                                                         double temperature, bool /*deterministic*/) {
  const AttentionKLParams p =
      make_attention_kl_params(q_s, k_s, q_t, k_t, key_mask, divergence, causal, scale_s, scale_t, temperature);
  check_cuda_inputs(q_s, p);
  const c10::cuda::CUDAGuard guard(q_s.device());
  if (q_s.scalar_type() == at::kFloat) return chunked::attention_kl_forward(p, q_s, k_s, q_t, k_t, key_mask);
  // The kernel writes every row, zeros for rows that see no key.
  at::Tensor loss = at::empty({p.batch, p.heads, p.n_queries}, q_s.options().dtype(at::kFloat));
  at::Tensor row_stats = at::empty({p.batch, p.heads, p.n_queries, kNumAttentionRowStats}, loss.options());
  if (loss.numel() == 0 || p.n_keys == 0) return {loss.zero_(), row_stats.zero_()};
  const KernelInputs in(q_s, k_s, q_t, k_t, key_mask);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int d_s_pad = round_up(static_cast<int>(in.q_s.size(3)), 16);
  // Hopper with the sm_90a build: TMA + wgmma for head dims up to 128; elsewhere (or
  // NITROBREW_FORCE_SM80=1) mma.sync.
  const bool hopper = use_sm90a_kernels() && attention_kl_hopper_supports(in.q_s.size(3), in.q_t.size(3));
  auto launch = [&](auto a) {
    a.loss = loss.data_ptr<float>();
    a.row_stats = row_stats.data_ptr<float>();
    if (hopper) {
      launch_attention_kl_forward_hopper(a, in.q_s, in.k_s, in.q_t, in.k_t, stream);
    } else {
      launch_attention_kl_forward(a, stream);
    }
  };
  if (q_s.scalar_type() == at::kBFloat16) {
    launch(in.args<__nv_bfloat16>(p, d_s_pad));
  } else {
    launch(in.args<__half>(p, d_s_pad));
  }
  return {loss, row_stats};
}

std::tuple<at::Tensor, at::Tensor> attention_kl_bwd_cuda(const at::Tensor& grad_loss, const at::Tensor& q_s,
                                                         const at::Tensor& k_s, const at::Tensor& q_t,
                                                         const at::Tensor& k_t,
                                                         const c10::optional<at::Tensor>& key_mask,
                                                         const at::Tensor& row_stats, c10::string_view divergence, bool causal,
                                                         double scale_s, double scale_t, double temperature,
                                                         bool deterministic) {
  const AttentionKLParams p =
      make_attention_kl_params(q_s, k_s, q_t, k_t, key_mask, divergence, causal, scale_s, scale_t, temperature);
  check_cuda_inputs(q_s, p);
  check_attention_kl_backward_inputs(grad_loss, row_stats, p, q_s.device());
  const c10::cuda::CUDAGuard guard(q_s.device());
  if (q_s.scalar_type() == at::kFloat) {
    return chunked::attention_kl_backward(p, grad_loss, q_s, k_s, q_t, k_t, key_mask, row_stats);
  }
  if (grad_loss.numel() == 0 || p.n_keys == 0 || k_s.numel() == 0) {
    return {at::zeros_like(q_s, at::MemoryFormat::Contiguous), at::zeros_like(k_s, at::MemoryFormat::Contiguous)};
  }
  const KernelInputs in(q_s, k_s, q_t, k_t, key_mask);
  const at::Tensor grad = grad_loss.to(at::kFloat).contiguous();
  const at::Tensor stats = row_stats.to(at::kFloat).contiguous();
  // float16's dS needs a range scale derived from the largest upstream gradient (on the device: no sync).
  const at::Tensor grad_max = q_s.scalar_type() == at::kHalf ? grad.abs().amax() : at::Tensor();
  at::Tensor dq = at::empty(in.q_s.sizes(), in.q_s.options());
  at::Tensor dk = at::empty(in.k_s.sizes(), in.k_s.options());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  // Hopper with the sm_90a build: the TMA + wgmma kernels for head dims up to 128 (the fused
  // kernel with dq in float32 by default; when deterministic a dq kernel and the fused kernel for
  // dk alone); elsewhere the mma.sync kernels.
  const bool hopper = use_sm90a_kernels() && attention_kl_hopper_supports(in.q_s.size(3), in.q_t.size(3));
  at::Tensor grad_rows;  // the Hopper kernels over key rows copy 64 queries' GradRows at a time
  if (hopper) {
    const int64_t per_head = (p.n_queries + 63) / 64 * 64;
    grad_rows = at::zeros({p.batch * p.heads, per_head, 6}, grad.options());
    at::Tensor rows = grad_rows.narrow(1, 0, p.n_queries);
    rows.narrow(2, 0, 5).copy_(stats.view({p.batch * p.heads, p.n_queries, kNumAttentionRowStats}));
    rows.select(2, 5).copy_(grad.view({p.batch * p.heads, p.n_queries}) * (p.scale_s * p.inv_temperature));
  }
  auto fill = [&](auto a) {
    if (hopper) {
      a.grad_rows = grad_rows.data_ptr<float>();
      a.grad_rows_per_head = grad_rows.size(1);
    }
    a.grad_loss = grad.data_ptr<float>();
    a.grad_stats = stats.data_ptr<float>();
    a.grad_max = grad_max.defined() ? grad_max.data_ptr<float>() : nullptr;
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(a.dq)>>;
    a.dq = reinterpret_cast<T*>(dq.data_ptr());
    a.dk = reinterpret_cast<T*>(dk.data_ptr());
    if (hopper && deterministic) {
      launch_attention_kl_backward_hopper(a, in.q_s, in.k_s, in.q_t, in.k_t, stream);
    } else if (hopper) {
      launch_attention_kl_backward_hopper_fused(a, in.q_s, in.k_s, in.q_t, in.k_t, /*with_dq=*/true, stream);
    } else {
      launch_attention_kl_backward(a, p, dq, deterministic, stream);
    }
  };
  if (q_s.scalar_type() == at::kBFloat16) {
    fill(in.args<__nv_bfloat16>(p, 0));
  } else {
    fill(in.args<__half>(p, 0));
  }
  if (dq.size(3) != p.dim_s) {  // head dim padded to a multiple of 8
    return {dq.narrow(3, 0, p.dim_s).contiguous(), dk.narrow(3, 0, p.dim_s).contiguous()};
  }
  return {dq, dk};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) {
  m.impl("attention_kl_fwd", &attention_kl_fwd_cuda);
  m.impl("attention_kl_bwd", &attention_kl_bwd_cuda);
}

}  // namespace attention
}  // namespace cuda
}  // namespace nitrobrew
