// CUDA merge of vocabulary shards' row states (nitrobrew.distributed): the kernel that merges a
// single device's vocabulary splits (divergence/merge_rows.cuh), with the shards as its parts.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <tuple>

#include "../divergence/merge_rows.cuh"
#include "shard_merge_params.h"

namespace nitrobrew {
namespace cuda {
namespace {

std::tuple<at::Tensor, at::Tensor> merge_shards_cuda(const at::Tensor& partials_in,
                                                     const c10::optional<at::Tensor>& mixture_in,
                                                     const c10::optional<at::Tensor>& labels_in, int64_t ignore_index,
                                                     c10::string_view divergence, double beta, double ce_weight,
                                                     int64_t vocab_size) {
  const DistillParams p =
      make_merge_params(partials_in, mixture_in, labels_in, ignore_index, divergence, beta, ce_weight, vocab_size);
  TORCH_CHECK(partials_in.is_cuda(), "partials must be a CUDA tensor here, got ", partials_in.device());
  const c10::cuda::CUDAGuard guard(partials_in.device());
  const at::Tensor partials = partials_in.contiguous();
  const at::Tensor labels = labels_in.has_value() ? labels_in->contiguous() : at::Tensor();
  const at::Tensor mixture = mixture_in.has_value() ? mixture_in->contiguous() : at::Tensor();
  at::Tensor loss = at::zeros({p.num_rows}, partials.options());
  at::Tensor row_stats = at::zeros({p.num_rows, kNumRowStats}, partials.options());
  if (p.num_rows == 0) return {loss, row_stats};
  const MergeRowsArgs a{p.num_rows, static_cast<int>(partials.size(0)),
                        labels.defined() ? labels.data_ptr<int64_t>() : nullptr, p.ignore_index,
                        RowFinish{p.kind == Divergence::kReverseKL, p.ce_weight, p.vocab_size}};
  const int row_blocks = static_cast<int>((p.num_rows + 255) / 256);
  AT_DISPATCH_FLOATING_TYPES(partials.scalar_type(), "merge_shards_cuda", [&] {
    merge_rows_kernel<scalar_t, double><<<row_blocks, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        a, divergence_params<double>(p), partials.data_ptr<scalar_t>(), nullptr,
        mixture.defined() ? mixture.data_ptr<double>() : nullptr, nullptr, loss.data_ptr<scalar_t>(),
        row_stats.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, row_stats};
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CUDA, m) { m.impl("merge_shards", &merge_shards_cuda); }

}  // namespace cuda
}  // namespace nitrobrew
