"""Train/inference mismatch correction: importance weights from the engine's logprobs to the trainer's.

The inference engine (vLLM in bf16, a quantised or differently batched kernel) samples from a
distribution ``μ`` that is not exactly the trainer's ``π``, even at the same weights. The
loss then takes its trust region around the trainer's own logprobs before the step and weights
each token by how much more (or less) likely the trainer found it than the engine that sampled
it, with the weight bounded so a single outlier cannot dominate a step.

Shapes: ``B`` rows, ``T`` tokens. ``trainer_logprobs`` and ``engine_logprobs`` are (B, T) log
probabilities of the sampled tokens (the trainer's before the step; the engine's as recorded at
rollout), ``mask`` (B, T) is 1.0 on trained tokens. Weights carry no gradient.

Levels (what one weight is the ratio of), with ``d_t = trainer_t − engine_t``:

- ``token``: ``w_t = exp(d_t)``, each token on its own (TIS, IcePop);
- ``sequence``: ``w = exp(Σ_t d_t)``, the exact ratio of the whole sampled sequence, the same
  for all its tokens; its spread grows with the length;
- ``geometric``: ``w = exp(mean_t d_t)``, the per-token geometric mean of the sequence ratio:
  length-normalised, so one band fits short and long answers (as GSPO normalises its ratio).

Modes (what happens to a weight outside the band ``[floor, cap]``):

- ``truncate``: ``min(w, cap)``, nothing is dropped (truncated importance sampling; ``floor`` unused);
- ``mask``: the token (level ``token``) or the whole sequence is left out of the loss (weight 0;
  it still counts in the aggregation's normaliser); weights inside the band are kept as they are.
"""

from __future__ import annotations

import math

import torch

#: ``algo.mismatch.level``
LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")
#: ``algo.mismatch.mode``; "none" keeps the loss around the engine's logprobs, uncorrected
MODES: tuple[str, ...] = ("none", "truncate", "mask")


def check_mismatch(mode: str, level: str, cap: float, floor: float) -> list[str]:
    """The problems of an ``algo.mismatch`` group (empty when it is valid)."""
    problems = []
    if mode not in MODES:
        problems.append(f"algo.mismatch.mode must be one of {MODES}, got {mode!r}")
    if level not in LEVELS:
        problems.append(f"algo.mismatch.level must be one of {LEVELS}, got {level!r}")
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not cap >= 1 or not math.isfinite(cap):
        problems.append(f"algo.mismatch.cap must be a finite number >= 1 (a weight of 1 is always kept), got {cap!r}")
    if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1:
        problems.append(f"algo.mismatch.floor must be in [0, 1] (a weight of 1 is always kept), got {floor!r}")
    return problems


def log_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                level: str) -> torch.Tensor:
    """(B, T) log importance weight of each token at ``level`` (0 outside the mask; no gradient)."""
    on = mask.bool()
    d = torch.where(on, trainer_logprobs.detach() - engine_logprobs.detach(), torch.zeros_like(trainer_logprobs))
    if level == "token":
        return d
    per_row = d.sum(-1, keepdim=True)  # (B, 1)
    if level == "geometric":
        per_row = per_row / on.sum(-1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown mismatch level {level!r}; choose one of {LEVELS}")
    return torch.where(on, per_row.expand_as(d), torch.zeros_like(d))


def importance_weights(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor,
                       level: str = "token", mode: str = "truncate", cap: float = 2.0,
                       floor: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The corrected importance weights ``(weights, changed)``, both (B, T), no gradient.

    ``weights`` multiply the per-token policy loss (0 outside the mask and on dropped tokens);
    ``changed`` is True where the correction acted: a truncated weight (``truncate``) or a dropped
    token (``mask``). ``mode="none"`` gives the raw weights ``exp(log w)``. Never overflows:
    the exponent is capped at ``log(cap)`` before ``exp``.
    """
    on = mask.bool()
    lw = log_weights(trainer_logprobs, engine_logprobs, mask, level)
    zeros = torch.zeros_like(lw)
    if mode == "none":
        return torch.where(on, torch.exp(lw), zeros), torch.zeros_like(on)
    log_cap = math.log(cap)
    if mode == "truncate":
        changed = on & (lw > log_cap)
        return torch.where(on, torch.exp(lw.clamp(max=log_cap)), zeros), changed
    if mode == "mask":
        low = math.log(floor) if floor > 0 else -math.inf
        keep = on & (lw <= log_cap) & (lw >= low)
        return torch.where(keep, torch.exp(lw.clamp(max=log_cap)), zeros), on & ~keep
    raise ValueError(f"unknown mismatch mode {mode!r}; choose one of {MODES}")


def mismatch_kl(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean over the mask of the k3 estimate of KL(engine ‖ trainer), a 0-d tensor (no gradient).

    The tokens were sampled by the engine, so with ``d = trainer − engine`` the per-token
    ``exp(d) − 1 − d`` is an unbiased, non-negative estimate of KL(μ ‖ π). 0 for an empty mask.
    """
    on = mask.bool()
    d = torch.where(on, trainer_logprobs.detach() - engine_logprobs.detach(), torch.zeros_like(trainer_logprobs))
    k3 = torch.where(on, torch.expm1(d) - d, torch.zeros_like(d))
    n = on.sum()
    return torch.where(n > 0, k3.sum() / n.clamp(min=1), torch.zeros_like(k3.sum()))


def weight_metrics(weights: torch.Tensor, changed: torch.Tensor, mask: torch.Tensor, mode: str) -> dict[str, float]:
    """``mismatch_weight_mean`` (over the tokens still trained) and ``mismatch_truncated_frac`` or
    ``mismatch_masked_frac`` (share of trained tokens the correction acted on)."""
    with torch.no_grad():
        on = mask.bool()
        kept = on & (weights > 0) if mode == "mask" else on
        n_on = on.sum().clamp(min=1)
        out = {"mismatch_weight_mean": float((weights.sum() / kept.sum().clamp(min=1)).item())}
        if mode == "truncate":
            out["mismatch_truncated_frac"] = float((changed.sum() / n_on).item())
        elif mode == "mask":
            out["mismatch_masked_frac"] = float((changed.sum() / n_on).item())
        return out
