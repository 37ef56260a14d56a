"""The divergence functions of a family (forward_kl, reverse_kl, jsd, skew_forward_kl, skew_reverse_kl,
tvd), made from one implementation, one signature and one docstring source.

A family defines its loss once, as `impl(divergence, *tensors, *, beta=..., <options>)`, and documents
its arguments once; divergence_functions turns it into the public functions, each showing the
implementation's signature to help() and IDEs: without `divergence`; with `beta` for jsd, `alpha` (in
beta's place) for the skew KLs, and neither for the others. The ops take one weight argument, named
`beta`: JSD's beta or the skew KLs' alpha (csrc/divergence/distill_params.h, parse_divergence).
"""

from __future__ import annotations

import inspect
from typing import Callable

from nitrobrew import _checks

# p = softmax of the student's logits, q = the teacher's, per row.
SUMMARIES = {
    "forward_kl": "Forward KL(teacher || student) = sum_v q_v (log q_v - log p_v), per row.",
    "reverse_kl": "Reverse KL(student || teacher) = sum_v p_v (log p_v - log q_v), per row.",
    "jsd": (
        "Generalized Jensen-Shannon divergence beta * KL(q || M) + (1 - beta) * KL(p || M) with\n"
        "M = (1 - beta) p + beta q, per row (TRL / Liger convention: beta = 0 is forward KL, 1 reverse KL)."
    ),
    "skew_forward_kl": (
        "Skew forward KL(q || alpha q + (1 - alpha) p), per row (DistiLLM; alpha = 0 is forward KL, alpha = 1\n"
        "gives 0)."
    ),
    "skew_reverse_kl": (
        "Skew reverse KL(p || alpha p + (1 - alpha) q), per row (DistiLLM; alpha = 0 is reverse KL, alpha = 1\n"
        "gives 0)."
    ),
    "tvd": (
        "Total variation distance 1/2 sum_v |p_v - q_v|, per row. Its gradient takes the subgradient\n"
        "sign(0) = 0 where p_v = q_v."
    ),
}

DIVERGENCES = tuple(SUMMARIES)

# The weight each divergence takes, and its default.
WEIGHTS = {"jsd": ("beta", 0.5), "skew_forward_kl": ("alpha", 0.1), "skew_reverse_kl": ("alpha", 0.1)}


def check_name(divergence: str, argument: str = "loss") -> str:
    if not isinstance(divergence, str) or divergence not in SUMMARIES:
        names = ", ".join(repr(name) for name in DIVERGENCES)
        raise ValueError(f"{argument} must be one of {names}, got {divergence!r}")
    return divergence


def weight_kwargs(divergence: str, beta: float = 0.5, alpha: float = 0.1) -> dict:
    """The keyword of a divergence's weight, as its public function takes it: {"beta": beta} for jsd,
    {"alpha": alpha} for the skew KLs, {} for the others."""
    name = WEIGHTS.get(divergence, (None,))[0]
    return {} if name is None else {name: beta if name == "beta" else alpha}


def chosen_weight(divergence: str, beta: float | None, alpha: float | None) -> dict:
    """The weight keyword of a divergence's public function ({"beta": ...}, {"alpha": ...} or {}) from optional
    beta and alpha: a missing weight takes its default, and a weight the divergence does not take is an error
    (silently ignored, it would train another loss than the one asked for)."""
    taken = WEIGHTS.get(divergence, (None,))[0]
    for name, value in (("beta", beta), ("alpha", alpha)):
        if value is not None and name != taken:
            users = " and ".join(repr(d) for d, (w, _) in WEIGHTS.items() if w == name)
            raise ValueError(f"{name} is the weight of {users} only, got it with {divergence!r}")
    if taken is None:
        return {}
    value = beta if taken == "beta" else alpha
    return {taken: _checks.unit_interval(WEIGHTS[divergence][1] if value is None else value, taken)}


def topk_weight(divergence: str, normalize: str, beta: float | None, alpha: float | None) -> float:
    """The ops' weight of topk_kl(divergence=, beta=, alpha=), after checking the pair: jsd takes beta (default 0.5),
    the skew KLs alpha (default 0.1), the others neither; normalize="full" takes forward_kl only."""
    check_name(divergence, "divergence")
    if normalize == "full" and divergence != "forward_kl":
        raise ValueError(f'normalize="full" takes divergence="forward_kl" only, got {divergence!r}: the other '
                         f'divergences need the teacher\'s probabilities beyond its K ids; use normalize="topk", '
                         f'which renormalizes both sides over them')
    return next(iter(chosen_weight(divergence, beta, alpha).values()), 0.0)


def runs_second_pass(divergence: str, weight: float) -> bool:
    """Whether a divergence with the ops' weight needs the second pass over the vocabulary (its loss is two
    sums per row formed from the first pass's log-normalizers): jsd with beta in (0, 1), the skew KLs with
    alpha > 0, tvd (the plain KLs need only the first)."""
    if divergence == "jsd":
        return 0.0 < weight < 1.0
    if divergence in ("skew_forward_kl", "skew_reverse_kl"):
        return weight > 0.0
    return divergence == "tvd"


def divergence_functions(impl: Callable, module: str, arguments_doc: str) -> tuple[Callable, ...]:
    """(forward_kl, reverse_kl, jsd, skew_forward_kl, skew_reverse_kl, tvd) calling
    impl(<name>, ..., beta=<the op's weight>, ...).

    arguments_doc: the family's "Args: ... Returns ..." text, appended to each summary."""
    signature = inspect.signature(impl)
    parameters = [p for name, p in signature.parameters.items() if name != "divergence"]

    def make(divergence: str) -> Callable:
        weight = WEIGHTS.get(divergence, (None, None))[0]

        def loss(*args, **options):
            for name, meaning in (("beta", "jsd's mixture weight"), ("alpha", "the skew KLs' weight")):
                if name in options and name != weight:
                    raise TypeError(f"{divergence}() got an unexpected keyword argument {name!r} ({meaning})")
            try:  # a misspelt option is named against the public function, not impl
                loss.__signature__.bind(*args, **options)
            except TypeError as e:
                raise TypeError(f"{module}.{divergence}(): {e}") from None
            if weight == "alpha":
                options["beta"] = _checks.unit_interval(options.pop("alpha", WEIGHTS[divergence][1]), "alpha")
            return impl(divergence, *args, **options)

        def shown(p: inspect.Parameter) -> inspect.Parameter | None:
            if p.name != "beta":
                return p
            if weight == "beta":
                return p
            if weight == "alpha":
                return p.replace(name="alpha", default=WEIGHTS[divergence][1])
            return None

        loss.__name__ = loss.__qualname__ = divergence
        loss.__module__ = module
        loss.__doc__ = f"{SUMMARIES[divergence]}\n\n{arguments_doc}"
        loss.__signature__ = signature.replace(parameters=[q for q in map(shown, parameters) if q is not None])
        return loss

    return tuple(make(name) for name in DIVERGENCES)
