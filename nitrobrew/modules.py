"""nn.Module forms of the losses."""

from __future__ import annotations

from torch import Tensor, nn

from nitrobrew import _checks, _divergences, _forward_grads, fused_linear


class DistillationLoss(nn.Module):
    """Fused distillation loss from hidden states and unembedding matrices.

    loss = DistillationLoss("jsd", beta=0.5, temperature=2.0)(xs, xt, ws, wt, labels)

    `loss` is "forward_kl" (KL(teacher || student)), "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl"
    or "tvd"; the keyword options are those of the function of that name (`beta`, default 0.5, is taken by "jsd"
    only and `alpha`, default 0.1, by the skew KLs only: either given to another loss is an error;
    `process_group`: the group over which ws and wt are vocabulary shards, nitrobrew.distributed;
    `grad_in_forward`, `grad_chunk_mib`: the training path, which forms the gradients in the forward).
    """

    def __init__(
        self,
        loss: str = "forward_kl",
        *,
        beta: float | None = None,
        alpha: float | None = None,
        temperature: float = 1.0,
        reduction: str = "mean",
        ignore_index: int = -100,
        ce_weight: float = 0.0,
        softcap_s: float | None = None,
        softcap_t: float | None = None,
        vocab_size: int | None = None,
        chunk_V: int | None = None,
        logit_scale_s: float = 1.0,
        logit_scale_t: float = 1.0,
        process_group=None,
        grad_in_forward: bool | None = None,
        grad_chunk_mib: int | None = None,
    ):
        super().__init__()
        self.loss = _divergences.check_name(loss)
        self.weight = _divergences.chosen_weight(self.loss, beta, alpha)  # {"beta": ...}, {"alpha": ...} or {}
        # Fail at construction, not at the first training step.
        _checks.positive_number(temperature, "temperature")
        _checks.reduction(reduction)
        _checks.non_negative_number(ce_weight, "ce_weight")
        _checks.optional_positive_number(softcap_s, "softcap_s")
        _checks.optional_positive_number(softcap_t, "softcap_t")
        _checks.optional_positive_int(vocab_size, "vocab_size")
        _checks.optional_positive_int(chunk_V, "chunk_V")
        _checks.positive_number(logit_scale_s, "logit_scale_s")
        _checks.positive_number(logit_scale_t, "logit_scale_t")
        if grad_in_forward is not None and not isinstance(grad_in_forward, bool):
            raise TypeError(f"grad_in_forward must be None (automatic), True or False, got {grad_in_forward!r}")
        _forward_grads.chunk_budget_bytes(grad_chunk_mib)
        self.options = dict(
            temperature=temperature, reduction=reduction, ignore_index=ignore_index, ce_weight=ce_weight,
            softcap_s=softcap_s, softcap_t=softcap_t, vocab_size=vocab_size, chunk_V=chunk_V,
            logit_scale_s=logit_scale_s, logit_scale_t=logit_scale_t, grad_in_forward=grad_in_forward,
            grad_chunk_mib=grad_chunk_mib,
        )
        self.process_group = process_group

    def forward(self, xs: Tensor, xt: Tensor, ws: Tensor, wt: Tensor, labels: Tensor | None = None,
                bias_s: Tensor | None = None, bias_t: Tensor | None = None) -> Tensor:
        return getattr(fused_linear, self.loss)(xs, xt, ws, wt, labels=labels, bias_s=bias_s, bias_t=bias_t,
                                                **self.weight, process_group=self.process_group, **self.options)

    def extra_repr(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        weight = "".join(f"{k}={v}, " for k, v in self.weight.items())
        return f"{self.loss!r}, {weight}{options}"
