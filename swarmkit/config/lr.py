"""``optim.lr: auto``: the learning rate from the model's size and whether it trains LoRA.

:data:`FULL_LR_ANCHORS` is the one source of the default learning rate
(docs/training.md, "Learning rate", shows it; tests/test_lr.py checks that
page against it): the full-weight RL learning rate at a few model sizes, interpolated linearly in
log(parameters) × log(lr) between them and flat beyond the ends; LoRA trains at
:data:`LORA_FACTOR` times that (a low-rank adapter with ``lora_alpha / r``
scaling needs about ten times the full-weight rate for the same progress per
step), never above :data:`MAX_LR`. The engine resolves ``auto`` once the model
is loaded (:func:`base_param_count` counts it exactly, adapters left out) and
logs the number; every step's ``lr`` metric shows it. With ``model.adapters``
an adapter without an ``lr`` of its own (or with ``lr: auto``) gets the LoRA rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: the value of ``optim.lr`` that asks for :func:`auto_lr`
AUTO = "auto"

#: (parameters, full-weight RL learning rate), ascending. Where each comes from:
#: 1e6 (the built-in tiny model, 0.35M, random init): 1e-2, what every tiny learning test and benchmark here uses;
#: 1.35e8 (SmolLM2-135M): 3e-5, the shipped LoRA rate 3e-4 (tuned on SmolLM2) / LORA_FACTOR;
#: 7e9: 1e-6, the usual full-weight GRPO rate of 7B models (the configure-server skill's Qwen2.5-7B example);
#: 7e10: 3e-7, the same trend one decade on (not measured here).
FULL_LR_ANCHORS: tuple[tuple[float, float], ...] = ((1e6, 1e-2), (1.35e8, 3e-5), (7e9, 1e-6), (7e10, 3e-7))
#: LoRA's learning rate over the full-weight one at the same size
LORA_FACTOR = 10.0
#: no auto learning rate above this (AdamW on any model here)
MAX_LR = 1e-2


def full_weight_lr(params: float, anchors: Iterable[tuple[float, float]] = FULL_LR_ANCHORS) -> float:
    """Full-weight learning rate of a model of ``params`` parameters: log-log interpolation of
    ``anchors`` (ascending ``(params, lr)`` pairs), their first / last lr outside them."""
    pts = list(anchors)
    if params <= pts[0][0]:
        return pts[0][1]
    for (n0, lr0), (n1, lr1) in zip(pts, pts[1:], strict=False):
        if params <= n1:
            t = (math.log(params) - math.log(n0)) / (math.log(n1) - math.log(n0))
            return math.exp(math.log(lr0) + t * (math.log(lr1) - math.log(lr0)))
    return pts[-1][1]


def auto_lr(params: int, lora: bool) -> float:
    """``optim.lr: auto`` for a model of ``params`` (base) parameters, LoRA or full weights."""
    if params <= 0:
        raise ValueError(f"auto learning rate: the model has {params} parameters")
    lr = full_weight_lr(float(params)) * (LORA_FACTOR if lora else 1.0)
    return min(lr, MAX_LR)


def is_auto(value: Any) -> bool:
    """Whether an ``optim.lr`` value asks for the auto learning rate."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def lr_problem(key: str, value: Any, allow_none: bool = False) -> str | None:
    """Why ``value`` is not a valid ``optim.<key>`` (a number > 0 or ``auto``; None when
    ``allow_none``), or None when it is."""
    if value is None and allow_none:
        return None
    if is_auto(value):
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return f"optim.{key}: Value {value!r} is not a number > 0 or '{AUTO}'"
    try:
        number = float(value)
    except ValueError:
        return f"optim.{key}: Value '{value}' is not a number > 0 or '{AUTO}'"
    if not number > 0:
        return f"optim.{key}: must be > 0, got {value}"
    return None


def base_param_count(named_parameters: Iterable[tuple[str, Any]]) -> int:
    """Parameters of the base model among ``named_parameters`` (``model.named_parameters()``: tied
    weights once), LoRA adapters (``lora_`` in the name) and a value head left out."""
    return sum(int(p.numel()) for name, p in named_parameters if "lora_" not in name and "value_head" not in name)
