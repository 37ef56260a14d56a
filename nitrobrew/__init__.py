"""nitrobrew: fused distillation losses that never materialize the logits.

    import nitrobrew
    loss = nitrobrew.forward_kl(xs, xt, ws, wt, temperature=2.0, labels=labels)
"""

from nitrobrew import hf, logits
from nitrobrew.attention_kl import attention_kl
from nitrobrew.fused_linear import forward_kl, jsd, reverse_kl, skew_forward_kl, skew_reverse_kl, tvd
from nitrobrew.modules import DistillationLoss
from nitrobrew.topk_linear import topk_kl
from nitrobrew.topk_logprobs import topk_logprobs

__version__ = "0.1.0"
__all__ = ["forward_kl", "reverse_kl", "jsd", "skew_forward_kl", "skew_reverse_kl", "tvd", "topk_kl", "topk_logprobs", "attention_kl", "logits", "hf", "DistillationLoss"]
