"""RL maths as pure functions over torch tensors.

Shapes: ``G`` episodes, ``B`` sequences (rows) of a micro-batch, ``T`` tokens.
``mask`` (B, T) is 1.0 on tokens the policy generated (the loss mask) and 0.0
elsewhere (prompt, environment text, padding). ``logprobs[b, t]`` is the log
probability of token ``t`` of row ``b``; ``old_logprobs`` are the ones the
inference engine recorded at rollout time. Functions that give a loss return
``(loss, metrics)`` where ``loss`` is a 0-d tensor and ``metrics`` a dict of
floats computed without gradient.

Loss aggregation modes (``aggregate_loss``), with ``L`` the (B, T) per-token
loss and ``m`` the mask; rows with no masked token are ignored:

- ``token-mean``: ``sum(L*m) / sum(m)``, every token of the micro-batch weighs
  the same (DAPO); long answers weigh more.
- ``seq-mean-token-mean``: mean over rows of ``sum_t(L*m) / sum_t(m)``, every
  sequence weighs the same (original GRPO); a token of a short answer weighs
  more.
- ``seq-mean-token-sum-norm``: mean over rows of ``sum_t(L*m) / C`` with a
  constant ``C`` (``norm_constant``, e.g. the maximum generation length;
  Dr. GRPO): no length bias from the normaliser.
"""

from __future__ import annotations

import torch

from swarmkit.contract.algo import LOSS_AGG_MODES as AGG_MODES

KL_KINDS = ("k1", "k2", "k3")


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(x * mask)`` over ``dim`` (all if None); masked-out entries never propagate NaN."""
    x = torch.where(mask.bool(), x, torch.zeros_like(x))
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over entries where ``mask`` is non-zero (weighted by ``mask``).

    ``x``, ``mask``: same shape. Over ``dim`` (all entries if None). An empty
    selection gives 0.
    """
    mask = mask.to(x.dtype)
    num = masked_sum(x * mask, mask, dim)
    den = mask.sum() if dim is None else mask.sum(dim)
    return torch.where(den > 0, num / den.clamp(min=torch.finfo(x.dtype).tiny), torch.zeros_like(num))


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (population std); 0 outside the mask."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) / (var.sqrt() + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def grpo_advantages(
    rewards: torch.Tensor, group_index: torch.Tensor, std_normalize: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-relative advantages.

    ``rewards`` (G,) float, ``group_index`` (G,) long (episodes of one task share
    an index, any non-negative ints). Returns (G,): ``r - mean(group)``, divided
    by ``std(group) + eps`` when ``std_normalize`` (unbiased std; a group of one
    has std 0, so its advantage is 0).
    """
    if rewards.dim() != 1 or rewards.shape != group_index.shape:
        raise ValueError(f"rewards and group_index must be (G,), got {tuple(rewards.shape)} "
                         f"and {tuple(group_index.shape)}")
    gi = group_index.long()
    n_groups = int(gi.max().item()) + 1 if gi.numel() else 0
    counts = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    counts.index_add_(0, gi, torch.ones_like(rewards))
    sums = torch.zeros_like(counts).index_add_(0, gi, rewards)
    mean = sums / counts.clamp(min=1)
    centred = rewards - mean[gi]
    if not std_normalize:
        return centred
    sq = torch.zeros_like(counts).index_add_(0, gi, centred**2)
    std = (sq / (counts - 1).clamp(min=1)).sqrt()
    return centred / (std[gi] + eps)


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
    norm_constant: float = 1024.0,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar; ``mode`` is one of :data:`AGG_MODES`."""
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    mask = mask.to(loss_mat.dtype)
    rows = mask.sum(-1) > 0
    n_rows = rows.sum()
    per_row_sum = masked_sum(loss_mat * mask, mask, dim=-1)
    if mode == "seq-mean-token-mean":
        per_row = per_row_sum / mask.sum(-1).clamp(min=torch.finfo(loss_mat.dtype).tiny)
    elif mode == "seq-mean-token-sum-norm":
        per_row = per_row_sum / float(norm_constant)
    else:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; choose one of {AGG_MODES}")
    total = torch.where(rows, per_row, torch.zeros_like(per_row)).sum()
    return torch.where(n_rows > 0, total / n_rows.clamp(min=1), torch.zeros_like(total))


def policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
    mode: str = "token-mean", norm_constant: float = 1024.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss with separate clip ranges.

    All inputs (B, T). With ``r = exp(logprobs - old_logprobs)`` the per-token
    loss is ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)``, aggregated by
    ``mode``. Metrics (token means over the mask): ``pg_loss``, ``clip_frac``
    (tokens where the clipped term is the active one), ``approx_kl``
    (``mean((r-1) - log r)``, the k3 estimate of KL(old || new)) and
    ``ratio_mean``.
    """
    on = mask.bool()
    log_ratio = torch.where(on, logprobs - old_logprobs, torch.zeros_like(logprobs))
    term, ratio, clipped = clipped_surrogate(log_ratio, advantages, clip_low, clip_high)
    loss = aggregate_loss(-term, mask, mode, norm_constant)
    return loss, surrogate_metrics(loss, log_ratio, ratio, clipped, mask)


def clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token objective ``min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)`` with
    ``r = exp(log_ratio)``; returns it, ``r`` and where the clipped term is the active one, all (B, T)."""
    ratio = torch.exp(log_ratio)
    surr = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    return torch.minimum(surr, surr_clipped), ratio, surr_clipped < surr


def surrogate_metrics(loss: torch.Tensor, log_ratio: torch.Tensor, ratio: torch.Tensor, clipped: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, float]:
    """``pg_loss``, ``clip_frac``, ``approx_kl`` (k3) and ``ratio_mean`` over the mask (no gradient)."""
    with torch.no_grad():
        return {
            "pg_loss": float(loss.item()),
            "clip_frac": float(masked_mean(clipped.to(ratio.dtype), mask).item()),
            "approx_kl": float(masked_mean((ratio - 1) - log_ratio, mask).item()),
            "ratio_mean": float(masked_mean(ratio, mask).item()),
        }


def decoupled_policy_loss(
    logprobs: torch.Tensor, prox_logprobs: torch.Tensor, behav_logprobs: torch.Tensor,
    advantages: torch.Tensor, mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2,
    weight_cap: float | None = 5.0, mode: str = "token-mean", norm_constant: float = 1024.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss for off-policy (asynchronous) samples, all inputs (B, T).

    Three policies: the *behaviour* policy that sampled the tokens (``behav_logprobs``,
    recorded by the inference engine, possibly several versions old), the *proximal*
    policy (``prox_logprobs``: the trainer's weights before this step, scored without
    gradient) and the policy being trained (``logprobs``). The trust region is taken
    around the proximal policy, and the behaviour policy is corrected by importance
    weights::

        w = exp(prox - behav)                       (no gradient)
        r = exp(logprobs - prox)
        L = -w * min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)

    A token whose weight exceeds ``weight_cap`` (None or <= 0: no cap) is left out
    of the loss (its term is 0; it still counts in the aggregation's normaliser),
    so one very unlikely stale token cannot dominate the step. On-policy
    (``behav == prox``) this is :func:`policy_loss`.

    Metrics: ``pg_loss``, ``clip_frac``, ``approx_kl`` and ``ratio_mean`` (of ``r``,
    as in :func:`policy_loss`), ``behav_weight_mean`` (of ``w`` over kept tokens),
    ``behav_capped_frac`` (tokens left out by the cap) and ``behav_kl`` (the k3
    estimate of KL(behaviour || proximal): how far off-policy the batch was).
    """
    on = mask.bool()
    zeros = torch.zeros_like(logprobs)
    behav_log_w = torch.where(on, prox_logprobs - behav_logprobs, zeros).detach()
    weight = torch.exp(behav_log_w)
    keep = on if weight_cap is None or weight_cap <= 0 else on & (weight <= weight_cap)
    weight = torch.where(keep, weight, zeros)
    log_ratio = torch.where(on, logprobs - prox_logprobs.detach(), zeros)
    term, ratio, clipped = clipped_surrogate(log_ratio, advantages, clip_low, clip_high)
    loss = aggregate_loss(-weight * term, mask, mode, norm_constant)
    metrics = surrogate_metrics(loss, log_ratio, ratio, clipped, mask)
    with torch.no_grad():
        metrics |= {
            "behav_weight_mean": float(masked_mean(weight, keep.to(weight.dtype)).item()),
            "behav_capped_frac": float(masked_mean((on & ~keep).to(weight.dtype), mask).item()),
            "behav_kl": float(masked_mean(torch.exp(behav_log_w) - 1 - behav_log_w, mask).item()),
        }
    return loss, metrics


def kl_per_token(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy, (B, T).

    With ``d = ref_logprobs - logprobs``: ``k1 = -d``, ``k2 = d**2 / 2``,
    ``k3 = exp(d) - d - 1`` (unbiased and non-negative; Schulman's k3).
    """
    d = ref_logprobs - logprobs
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d**2
    if kind == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_KINDS}")


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str = "k3",
    mode: str = "token-mean", norm_constant: float = 1024.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(policy || reference) penalty, all inputs (B, T); aggregated like the policy loss.

    Metrics: ``kl`` (token mean over the mask).
    """
    on = mask.bool()
    kl = kl_per_token(logprobs, ref_logprobs, kind)
    kl = torch.where(on, kl, torch.zeros_like(kl))
    loss = aggregate_loss(kl, mask, mode, norm_constant)
    with torch.no_grad():
        metrics = {"kl": float(masked_mean(kl, mask).item())}
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean", norm_constant: float = 1024.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The entropy bonus as a loss term: ``−aggregate(entropy)``, all inputs (B, T).

    ``entropy[b, t]`` is the entropy (nats) of the policy's next-token distribution where token
    ``t`` of row ``b`` was sampled (the engine's logprob kernel gives it with gradient). Adding
    ``entropy_coef`` times this term to the loss rewards keeping the distribution spread out;
    it is aggregated like the policy loss so the two keep their relative weight. Metrics:
    ``entropy_loss`` (the term).
    """
    on = mask.bool()
    ent = torch.where(on, entropy, torch.zeros_like(entropy))
    loss = -aggregate_loss(ent, mask, mode, norm_constant)
    with torch.no_grad():
        metrics = {"entropy_loss": float(loss.item())}
    return loss, metrics


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the masked tokens of each row.

    ``rewards``, ``values``, ``mask``: (B, T). The steps of a row are its masked
    tokens in order; unmasked tokens (prompt, environment text between turns,
    padding) are skipped, so the step after a generated token is the next
    generated token of the row, and the last one is terminal (next value 0):
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma*lam*A_next``.
    Returns ``(advantages, returns)``, both (B, T), ``returns = A + V``; 0 outside
    the mask.
    """
    on = mask.bool()
    B, T = rewards.shape
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros(B, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    for t in range(T - 1, -1, -1):
        m = on[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        next_adv = torch.where(m, a, next_adv)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, a, torch.zeros_like(a))
    returns = torch.where(on, adv + values, torch.zeros_like(adv))
    return adv, returns


def sequence_rewards_to_tokens(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each row's reward (B,) on its last masked token; (B, T), 0 elsewhere."""
    B, T = mask.shape
    on = mask.bool()
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(on, pos, torch.full_like(pos, -1)).max(-1).values
    out = torch.zeros(B, T, dtype=rewards.dtype, device=rewards.device)
    rows = last >= 0
    out[rows, last[rows]] = rewards[rows]
    return out


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
    clip: float | None = 0.2, mode: str = "token-mean", norm_constant: float = 1024.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, all inputs (B, T).

    ``v_clip = old_values + clamp(values - old_values, -clip, clip)``; per token
    ``0.5 * max((values - R)**2, (v_clip - R)**2)`` (no clipping when ``clip``
    is None or <= 0), aggregated by ``mode``. Metrics: ``vf_loss``,
    ``vf_clip_frac`` (tokens where the clipped error is the larger),
    ``value_mean``.
    """
    err = (values - returns) ** 2
    if clip is not None and clip > 0:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err_clip = (v_clip - returns) ** 2
        loss_mat = 0.5 * torch.maximum(err, err_clip)
        clipped = (err_clip > err).to(values.dtype)
    else:
        loss_mat = 0.5 * err
        clipped = torch.zeros_like(values)
    loss = aggregate_loss(loss_mat, mask, mode, norm_constant)
    with torch.no_grad():
        metrics = {
            "vf_loss": float(loss.item()),
            "vf_clip_frac": float(masked_mean(clipped, mask).item()),
            "value_mean": float(masked_mean(values, mask).item()),
        }
    return loss, metrics
