"""TRL's GKD trainer with nitrobrew's loss: the same generalized JSD from the models' hidden states,
without the [B, T, V] logits of either model. Switching is one line:

    from nitrobrew.trl import GKDTrainer      # instead of: from trl.experimental.gkd import GKDTrainer

Needs TRL (an optional dependency); `import nitrobrew` never imports this module.
"""

from __future__ import annotations

import torch
from trl.experimental.gkd import GKDTrainer as _TRLGKDTrainer

from nitrobrew import hf

__all__ = ["GKDTrainer"]


class GKDTrainer(_TRLGKDTrainer):
    """trl.experimental.gkd.GKDTrainer whose training loss is nitrobrew.hf.distillation_loss(loss="jsd",
    beta=args.beta): TRL's generalized JSD at temperature 1 over the positions whose shifted label is not
    -100, divided by `num_items_in_batch` where the Trainer passes it (gradient accumulation) and by the
    number of scored positions otherwise, as TRL's own compute_loss does. On-policy generation, `lmbda`
    and `seq_kd` are TRL's. Evaluation (`return_outputs=True`, which wants the logits) runs TRL's own loss."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            return super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self.teacher_model.eval()
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        per_batch = num_items_in_batch is not None
        loss = hf.distillation_loss(model, teacher, inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                    labels=inputs["labels"], loss="jsd", beta=self.beta,
                                    reduction="sum" if per_batch else "mean")
        if per_batch:  # the global count of scored tokens (gradient accumulation, several ranks)
            count = num_items_in_batch
            loss = loss / (count.to(loss.device) if isinstance(count, torch.Tensor) else count)
        return loss
