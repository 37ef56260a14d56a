// The arguments of the fused-linear passes' kernels (the vocabulary walk's Args, vocab_walk.cuh):
// the operands, the row mask and the loss options. The top-K passes from hidden states use them too.
#pragma once

#include <ATen/ATen.h>

#include "../divergence/distill_params.h"
#include "../engine/cuda/vocab_walk.cuh"
#include "fused_linear_launch.h"

namespace nitrobrew {
namespace cuda {

template <typename T>
struct FusedLinearArgs {
  const T* xs;
  const T* xt;
  const T* ws;
  const T* wt;
  int64_t ld_xs, ld_xt, ld_ws, ld_wt;  // row strides in elements
  int64_t n_rows, d_s, d_t, vocab_size;
  const int64_t* labels;  // nullptr without labels
  int64_t ignore_index;
  float inv_temperature, ce_weight;
  ModelLogits<T> model_s, model_t;  // bias, logit scale and soft-cap per model
  DivergenceParams<float> div;
};

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? reinterpret_cast<const T*>(t->data_ptr()) : nullptr;
}

template <typename T>
FusedLinearArgs<T> make_args(const FusedLinearOperands& in, const DistillParams& p) {
  const at::Tensor &xs = in.xs, &xt = in.xt, &ws = in.ws, &wt = in.wt;
  const c10::optional<at::Tensor>& labels = in.labels;
  FusedLinearArgs<T> a;
  a.xs = reinterpret_cast<const T*>(xs.data_ptr());
  a.xt = reinterpret_cast<const T*>(xt.data_ptr());
  a.ws = reinterpret_cast<const T*>(ws.data_ptr());
  a.wt = reinterpret_cast<const T*>(wt.data_ptr());
  a.ld_xs = xs.stride(0);
  a.ld_xt = xt.stride(0);
  a.ld_ws = ws.stride(0);
  a.ld_wt = wt.stride(0);
  a.n_rows = p.num_rows;
  a.d_s = p.hidden_s;
  a.d_t = p.hidden_t;
  a.vocab_size = p.vocab_size;
  a.labels = labels.has_value() ? labels->data_ptr<int64_t>() : nullptr;
  a.ignore_index = p.ignore_index;
  a.inv_temperature = static_cast<float>(p.inv_temperature);
  a.model_s = {data_or_null<T>(in.bias_s), static_cast<float>(p.logit_scale_s), static_cast<float>(p.softcap_s)};
  a.model_t = {data_or_null<T>(in.bias_t), static_cast<float>(p.logit_scale_t), static_cast<float>(p.softcap_t)};
  a.ce_weight = static_cast<float>(p.ce_weight);
  a.div = divergence_params<float>(p);
  return a;
}

}  // namespace cuda
}  // namespace nitrobrew
