"""The three divergence functions of a family (forward_kl, reverse_kl, jsd), made from one
implementation, one signature and one docstring source.

A family defines its loss once, as `impl(divergence, *tensors, *, beta=..., <options>)`, and documents
its arguments once; divergence_functions turns it into the three public functions, each showing the
implementation's signature (without `divergence`, and without `beta` but for jsd) to help() and IDEs.
"""

from __future__ import annotations

import inspect
from typing import Callable

# p = softmax of the student's logits, q = the teacher's, per row.
SUMMARIES = {
    "forward_kl": "Forward KL(teacher || student) = sum_v q_v (log q_v - log p_v), per row.",
    "reverse_kl": "Reverse KL(student || teacher) = sum_v p_v (log p_v - log q_v), per row.",
    "jsd": (
        "Generalized Jensen-Shannon divergence beta * KL(q || M) + (1 - beta) * KL(p || M) with\n"
        "M = (1 - beta) p + beta q, per row (TRL / Liger convention: beta = 0 is forward KL, 1 reverse KL)."
    ),
}


def divergence_functions(impl: Callable, module: str, arguments_doc: str) -> tuple[Callable, Callable, Callable]:
    """(forward_kl, reverse_kl, jsd) calling impl("forward_kl" | "reverse_kl" | "jsd", ...).

    arguments_doc: the family's "Args: ... Returns ..." text, appended to each summary."""
    signature = inspect.signature(impl)
    parameters = [p for name, p in signature.parameters.items() if name != "divergence"]

    def make(divergence: str) -> Callable:
        takes_beta = divergence == "jsd"

        def loss(*args, **options):
            if not takes_beta and "beta" in options:
                raise TypeError(f"{divergence}() got an unexpected keyword argument 'beta' (jsd's mixture weight)")
            return impl(divergence, *args, **options)

        loss.__name__ = loss.__qualname__ = divergence
        loss.__module__ = module
        loss.__doc__ = f"{SUMMARIES[divergence]}\n\n{arguments_doc}"
        loss.__signature__ = signature.replace(
            parameters=[p for p in parameters if takes_beta or p.name != "beta"]
        )
        return loss

    return make("forward_kl"), make("reverse_kl"), make("jsd")
