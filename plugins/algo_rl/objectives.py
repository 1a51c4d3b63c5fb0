"""Policy objectives beside PPO's clipped surrogate: GSPO and CISPO, and the importance-weighted loss.

Shapes: ``B`` rows, ``T`` tokens; every tensor is (B, T) unless said otherwise. ``log_ratio`` is
``logprobs − anchor`` on trained tokens (0 elsewhere), where the anchor (the "old" policy of the
trust region) carries no gradient. Each surrogate returns ``(term, ratio, clipped)``: the per-token
objective to maximise, the ratio it used and where its clipping acted.

- ``clip`` (PPO, GRPO, DAPO): ``min(r·A, clip(r, 1−clip_low, 1+clip_high)·A)``, ``r = exp(log_ratio)``.
- ``gspo`` (Group Sequence Policy Optimization): one ratio per sequence, length-normalised,
  ``s = exp(mean_t log_ratio)``, clipped like PPO's. Written in its token form
  ``s_t = sg(s) · exp(log_ratio_t − sg(log_ratio_t))``: the value of every token's ratio is the
  sequence's ``s`` and its gradient is ``s · ∇log π_t``, so per-token advantages work, and with
  ``seq-mean-token-mean`` aggregation and one advantage per sequence it is GSPO's sequence
  objective exactly. GSPO's clip ranges are far narrower than PPO's (the paper: 3e-4 / 4e-4).
- ``cispo`` (MiniMax-M1): ``sg(clip(r, 1−clip_low, 1+clip_high)) · A · log π``: the importance
  weight is clipped and never stops a token's gradient (PPO's clip drops the gradient of a
  token whose ratio left the trust region). ``clip_low = 1`` leaves it without a lower bound.
"""

from __future__ import annotations

import torch

from swarmkit_plugins.algo_rl import losses

#: ``algo.policy_loss``
POLICY_LOSSES: tuple[str, ...] = ("clip", "gspo", "cispo")


def gspo_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, clip_low: float,
                   clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GSPO's token-form objective: PPO's clipped term on the sequence ratio ``s`` (value) with
    gradient ``s · ∇log π_t`` per token; returns ``(term, s_t, clipped)``."""
    seq = losses.masked_mean(log_ratio, mask, dim=-1)  # (B,) mean log-ratio of each row
    token_log_s = seq.detach()[:, None] + log_ratio - log_ratio.detach()  # value: seq; grad: ∇log π_t
    token_log_s = torch.where(mask.bool(), token_log_s, torch.zeros_like(token_log_s))
    return losses.clipped_surrogate(token_log_s, advantages, clip_low, clip_high)


def cispo_surrogate(log_ratio: torch.Tensor, logprobs: torch.Tensor, advantages: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO's objective ``sg(clip(r)) · A · log π``; returns ``(term, r, clipped)`` (``r`` without
    gradient; ``clipped`` where ``r`` left ``[1−clip_low, 1+clip_high]``)."""
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return weight * advantages * logprobs, ratio, weight != ratio


def surrogate(kind: str, logprobs: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(term, log_ratio, ratio, clipped)`` of policy loss ``kind`` (one of :data:`POLICY_LOSSES`)."""
    on = mask.bool()
    log_ratio = torch.where(on, logprobs - anchor.detach(), torch.zeros_like(logprobs))
    if kind == "clip":
        term, ratio, clipped = losses.clipped_surrogate(log_ratio, advantages, clip_low, clip_high)
    elif kind == "gspo":
        term, ratio, clipped = gspo_surrogate(log_ratio, advantages, mask, clip_low, clip_high)
    elif kind == "cispo":
        lp = torch.where(on, logprobs, torch.zeros_like(logprobs))
        term, ratio, clipped = cispo_surrogate(log_ratio, lp, advantages, clip_low, clip_high)
    else:
        raise ValueError(f"unknown policy loss {kind!r}; choose one of {POLICY_LOSSES}")
    return term, log_ratio, ratio, clipped


def weighted_policy_loss(
    logprobs: torch.Tensor, anchor: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    weights: torch.Tensor | None = None, kind: str = "clip", clip_low: float = 0.2, clip_high: float = 0.2,
    mode: str = "token-mean", norm_constant: float = 1024.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``aggregate(−w · term)`` for policy loss ``kind``, its trust region around ``anchor``.

    ``weights`` (B, T), no gradient: the importance weights from the policy that sampled the
    tokens to ``anchor`` (see :mod:`.mismatch`); None = 1. A token of weight 0 is out of the loss
    but still counts in the aggregation's normaliser. With ``kind="clip"`` and no weights this is
    :func:`losses.policy_loss`. Metrics: ``pg_loss``, ``clip_frac``, ``approx_kl`` (k3, of the
    per-token ratio to ``anchor``) and ``ratio_mean`` (of the ratio the objective used).
    """
    term, log_ratio, ratio, clipped = surrogate(kind, logprobs, anchor, advantages, mask, clip_low, clip_high)
    if weights is not None:
        term = weights.detach() * term
    loss = losses.aggregate_loss(-term, mask, mode, norm_constant)
    metrics = losses.surrogate_metrics(loss, log_ratio, torch.exp(log_ratio), clipped, mask)
    with torch.no_grad():
        metrics["ratio_mean"] = float(losses.masked_mean(ratio, mask).item())
    return loss, metrics
