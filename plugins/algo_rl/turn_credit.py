"""Per-turn credit assignment: pure functions over padded (N, T) tensors of turns.

N reward units (rollouts), each with ``lengths[i]`` turns (its calls, in order), padded to T.
``rewards[i, t]`` is the reward of turn ``t`` of unit ``i`` (its call's own reward; the unit's
episode reward is added to its last turn by the caller, :func:`effective_rewards`).

- :func:`discounted_returns`: ``G[i, t] = Σ_{k=t}^{L_i-1} γ^(k-t) r[i, k]`` (0 past the end).
- :func:`turn_baselines`: the per-turn group baseline, over the other units of the same group
  that reached turn ``t`` (``"loo"``, leave-one-out), or over all of them including the unit
  itself (``"mean"``: GRPO applied per turn, biased when the policy controls episode length,
  see :func:`turn_advantages`).
- :func:`turn_advantages`: ``(G − b) / (σ + eps)``.

Every function takes tensors and scalars, never a config, and is checked against a naive loop
implementation in ``tests/test_turn_credit.py``.
"""

from __future__ import annotations

import torch

#: how the per-turn baseline is formed (see :func:`turn_baselines`)
BASELINES: tuple[str, ...] = ("loo", "mean")


def turn_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(N, T) bool: ``True`` where turn ``t < lengths[i]`` exists."""
    return torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]


def effective_rewards(turn_rewards: torch.Tensor, lengths: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """(N, T) turn rewards with each unit's episode reward ``final`` (N,) added to its last turn.

    A unit with no turn (length 0) keeps its row (all padding)."""
    out = turn_rewards.clone() * turn_mask(lengths, turn_rewards.shape[1])
    rows = torch.nonzero(lengths > 0).flatten()
    out[rows, lengths[rows] - 1] += final[rows].to(out.dtype)
    return out


def discounted_returns(rewards: torch.Tensor, lengths: torch.Tensor, gamma: float) -> torch.Tensor:
    """(N, T) γ-discounted returns of (N, T) per-turn ``rewards``; 0 on padded turns.

    :param rewards: (N, T) per-turn rewards (padding ignored).
    :param lengths: (N,) turns per unit.
    :param gamma: discount per turn, in [0, 1].
    """
    mask = turn_mask(lengths, rewards.shape[1])
    r = rewards * mask
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in range(r.shape[1] - 1, -1, -1):
        running = r[:, t] + gamma * running
        out[:, t] = running
    return out * mask


def turn_baselines(returns: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor,
                   baseline: str = "loo") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn group baselines and how many units each was formed from.

    :param returns: (N, T) returns (0 on padded turns).
    :param lengths: (N,) turns per unit.
    :param group_index: (N,) int group of each unit (the task's group of rollouts).
    :param baseline: ``"loo"``: ``b[i, t]`` is the mean return at turn ``t`` of the *other* units
        of ``i``'s group that reached turn ``t`` (0 when none did); ``"mean"``: the mean over all
        units of the group that reached turn ``t``, ``i`` included.
    :returns: ``(b, n)``, both (N, T): the baseline, and the number of units it averages
        (0 on padded turns).
    """
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    mask = turn_mask(lengths, returns.shape[1]).to(returns.dtype)
    same = (group_index[:, None] == group_index[None, :]).to(returns.dtype)  # (N, N)
    sums = same @ (returns * mask)   # (N, T): Σ over the group's units that reached t
    counts = same @ mask             # (N, T)
    if baseline == "loo":
        sums = sums - returns * mask
        counts = counts - mask
    b = torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))
    return b * mask, counts * mask


def turn_std(returns: torch.Tensor, lengths: torch.Tensor, group_index: torch.Tensor, per_turn: bool) -> torch.Tensor:
    """(N, T) the scale advantages are divided by: the (population) standard deviation of the
    returns of ``i``'s group pooled over all its units' turns (``per_turn=False``), or over the
    units that reached turn ``t`` (``per_turn=True``)."""
    mask = turn_mask(lengths, returns.shape[1]).to(returns.dtype)
    same = (group_index[:, None] == group_index[None, :]).to(returns.dtype)
    x = returns * mask
    if per_turn:
        n = (same @ mask).clamp(min=1)
        dev = (x - (same @ x) / n) * mask            # two passes: no E[x²] − E[x]² cancellation
        var = (same @ (dev * dev)) / n
    else:
        n = (same @ mask).sum(dim=1, keepdim=True).clamp(min=1)
        dev = (x - (same @ x).sum(dim=1, keepdim=True) / n) * mask
        var = ((same @ (dev * dev)).sum(dim=1, keepdim=True) / n).expand_as(x)
    return var.clamp(min=0).sqrt() * mask


def turn_advantages(turn_rewards: torch.Tensor, lengths: torch.Tensor, final: torch.Tensor,
                    group_index: torch.Tensor, gamma: float = 1.0, baseline: str = "loo",
                    std_normalize: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(N, T) one advantage per turn: ``(G − b) / (σ + eps)`` (``σ`` only with ``std_normalize``).

    :param turn_rewards: (N, T) each call's own reward (0 where none was given).
    :param lengths: (N,) turns per unit.
    :param final: (N,) the unit's episode (or role) reward, added to its last turn.
    :param group_index: (N,) int group (task) of each unit.
    :param gamma: per-turn discount of the return.
    :param baseline: ``"loo"`` (default) or ``"mean"``.

    The length bias and its fix. When the policy decides how many turns an episode has, the
    number of a group's rollouts that reach turn ``t`` varies with ``t`` and with the policy. A
    baseline that includes the unit itself (``"mean"``) shrinks its advantage by ``1 − 1/n_t``:
    a turn that few rollouts reach learns less, and one that a single rollout reaches learns
    nothing (its advantage is exactly 0); a per-turn ``σ`` rescales turns by how many rollouts
    reached them. ``"loo"`` uses the other rollouts only (RLOO per turn: unbiased for any
    ``n_t``, the unit's own return never enters its baseline) and divides every turn of a group
    by the same ``σ`` (pooled over all its turns), so the length of an episode changes no
    token's weight except through its real returns.
    """
    rewards = effective_rewards(turn_rewards, lengths, final)
    returns = discounted_returns(rewards, lengths, gamma)
    b, _ = turn_baselines(returns, lengths, group_index, baseline)
    adv = returns - b
    if std_normalize:
        adv = adv / (turn_std(returns, lengths, group_index, per_turn=baseline == "mean") + eps)
    return adv * turn_mask(lengths, returns.shape[1])
