"""TRL's distillation trainers with nitrobrew's loss: the same generalized JSD from the models' hidden
states, without the [B, T, V] logits of either model. Switching is one line:

    from nitrobrew.trl import GKDTrainer            # instead of: from trl.experimental.gkd import GKDTrainer
    from nitrobrew.trl import DistillationTrainer   # instead of: from trl import DistillationTrainer

Both take two more keyword arguments: `divergence` ("jsd", TRL's, by default; or any of nitrobrew's:
"forward_kl", "reverse_kl", "skew_forward_kl", "skew_reverse_kl", "tvd") and `alpha` (the skew KLs' weight,
0.1). JSD's beta stays TRL's `args.beta`.

Needs TRL (an optional dependency, tested with 1.16.0); `import nitrobrew` never imports this module.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from trl import DistillationTrainer as _TRLDistillationTrainer
from trl.experimental.gkd import GKDTrainer as _TRLGKDTrainer
from trl.trainer import distillation_trainer as _distillation_module

from nitrobrew import _checks, _divergences, fused_linear, hf

__all__ = ["GKDTrainer", "DistillationTrainer"]


def _divergence_options(divergence: str, alpha: float) -> tuple[str, float]:
    return _divergences.check_name(divergence, "divergence"), _checks.unit_interval(alpha, "alpha")


class GKDTrainer(_TRLGKDTrainer):
    """trl.experimental.gkd.GKDTrainer whose training loss is nitrobrew.hf.distillation_loss(loss=divergence,
    beta=args.beta, alpha=alpha): by default TRL's generalized JSD, at temperature 1 over the positions whose
    shifted label is not -100, divided by `num_items_in_batch` where the Trainer passes it (gradient
    accumulation) and by the number of scored positions otherwise, as TRL's own compute_loss does. On-policy
    generation, `lmbda` and `seq_kd` are TRL's. Evaluation (`return_outputs=True`, which wants the logits) runs
    TRL's own loss (its JSD, whatever `divergence` is)."""

    def __init__(self, *args, divergence: str = "jsd", alpha: float = 0.1, **kwargs):
        self.nitrobrew_divergence, self.nitrobrew_alpha = _divergence_options(divergence, alpha)
        super().__init__(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            return super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self.teacher_model.eval()
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        per_batch = num_items_in_batch is not None
        # accelerate's mixed precision lives in the prepared model's forward, which nitrobrew.hf runs around.
        autocast = getattr(self.accelerator, "autocast", None)
        with autocast() if callable(autocast) else contextlib.nullcontext():
            loss = hf.distillation_loss(model, teacher, inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                        labels=inputs["labels"], loss=self.nitrobrew_divergence,
                                        reduction="sum" if per_batch else "mean",
                                        # TRL's beta is JSD's; alpha the skew KLs'
                                        **_divergences.weight_kwargs(self.nitrobrew_divergence, self.beta,
                                                                     self.nitrobrew_alpha))
        if per_batch:  # the global count of scored tokens (gradient accumulation, several ranks)
            count = num_items_in_batch
            loss = loss / (count.to(loss.device) if isinstance(count, torch.Tensor) else count)
        return loss


def _divergence_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                     completion_mask, beta, num_items_in_batch=None, student_lm_head_bias=None,
                     teacher_lm_head_bias=None, student_logit_scale=1.0, teacher_logit_scale=1.0,
                     student_final_logit_softcapping=None, teacher_final_logit_softcapping=None, temperature=1.0,
                     *, divergence="jsd", alpha=0.1):
    """TRL's _chunked_divergence_loss contract on nitrobrew's `divergence` (JSD with TRL's beta, or the skew
    KLs with `alpha`): (loss, student entropy sum, valid count),
    with TRL's logits scale * (h @ lm_head.T + bias), soft-capped, then divided by the temperature. The
    entropy (of the student's temperature-scaled distribution, over the completion tokens) is formed in the
    loss's own pass (return_entropy)."""
    dtype = student_hidden_states.dtype
    weights = []
    for weight in (student_lm_head_weight, teacher_lm_head_weight, student_lm_head_bias, teacher_lm_head_bias):
        if isinstance(weight, torch.distributed.tensor.DTensor):  # FSDP2: gathered once, as TRL does
            weight = weight.full_tensor()
        weights.append(None if weight is None else weight.to(dtype))
    valid = completion_mask != 0
    labels = torch.where(valid, 0, -100).long()  # a mask only (no CE add-on): any id serves for the kept rows
    loss_sum, entropy = getattr(fused_linear, divergence)(
        student_hidden_states, teacher_hidden_states.to(dtype), weights[0], weights[1],
        **_divergences.weight_kwargs(divergence, beta, alpha),
        temperature=temperature, labels=labels, reduction="sum", bias_s=weights[2], bias_t=weights[3],
        logit_scale_s=student_logit_scale, logit_scale_t=teacher_logit_scale,
        softcap_s=student_final_logit_softcapping, softcap_t=teacher_final_logit_softcapping, return_entropy=True)
    n_valid = valid.sum()
    if num_items_in_batch is None:
        loss = loss_sum / n_valid.clamp(min=1)
    else:
        count = num_items_in_batch
        loss = loss_sum / (count.to(loss_sum.device) if isinstance(count, torch.Tensor) else count)
    return loss, entropy.sum(), n_valid


class DistillationTrainer(_TRLDistillationTrainer):
    """trl.DistillationTrainer whose divergence (TRL's chunked generalized JSD over the completion tokens,
    with `beta` and `temperature`; or nitrobrew's `divergence`, with `alpha` for the skew KLs) is computed by
    nitrobrew from the same hidden states. Generation, masks and the reduction are TRL's; the logged student
    entropy is formed in nitrobrew's pass."""

    def __init__(self, *args, divergence: str = "jsd", alpha: float = 0.1, **kwargs):
        self.nitrobrew_divergence, self.nitrobrew_alpha = _divergence_options(divergence, alpha)
        super().__init__(*args, **kwargs)

    def _compute_loss(self, unwrapped_student, inputs, num_items_in_batch):
        loss = functools.partial(_divergence_loss, divergence=self.nitrobrew_divergence, alpha=self.nitrobrew_alpha)
        with _swapped(_distillation_module, "_chunked_divergence_loss", loss):
            return _TRLDistillationTrainer._compute_loss(self, unwrapped_student, inputs, num_items_in_batch)


@contextlib.contextmanager
def _swapped(module, name, value):
    """TRL's _compute_loss calls a module-level function; it is replaced for the call only."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)
