// CPU merge of vocabulary shards' row states (nitrobrew.distributed): the same merge and finish
// as a single device's forward (divergence/cpu_passes.h, finish_rows).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "../divergence/cpu_passes.h"
#include "shard_merge_params.h"

namespace nitrobrew {
namespace cpu {
namespace {

std::tuple<at::Tensor, at::Tensor> merge_shards_cpu(const at::Tensor& partials,
                                                    const c10::optional<at::Tensor>& mixture,
                                                    const c10::optional<at::Tensor>& labels, int64_t ignore_index,
                                                    c10::string_view divergence, double beta, double ce_weight,
                                                    int64_t vocab_size) {
  const DistillParams p =
      make_merge_params(partials, mixture, labels, ignore_index, divergence, beta, ce_weight, vocab_size);
  TORCH_CHECK(partials.device().is_cpu(), "partials must be a CPU tensor here, got ", partials.device());
  const std::vector<uint8_t> valid = row_mask(labels, p, /*check_label_range=*/false);
  std::tuple<at::Tensor, at::Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(partials.scalar_type(), "merge_shards_cpu", [&] {
    out = finish_rows<scalar_t>(partials, mixture, labels, valid, p);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(nitrobrew, CPU, m) { m.impl("merge_shards", &merge_shards_cpu); }

}  // namespace cpu
}  // namespace nitrobrew
