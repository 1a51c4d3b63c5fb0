"""Metrics per task family: what each family (``meta.task_family`` at register) put into a step.

A server fed by several clients with different tasks (cocktail training) logs,
for every family in a step, ``reward_mean/<family>``, ``episodes/<family>``
and ``tokens/<family>`` (the trained tokens of its timelines), and for the
eval episodes that ended since the previous step ``eval_reward/<family>`` and
``eval_episodes/<family>``. A reward per role (role → number) counts as the
mean over roles and adds ``reward_mean/<family>/<role>`` (``eval_reward/...``
likewise). Episodes registered without a family count as ``default``.
Demonstrations count under ``demonstrations/<family>`` only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from swarmkit.contract.batching import scalar_reward
from swarmkit.pool.records import EpisodeRecord

DEFAULT_FAMILY = "default"


def family_of(name: str | None) -> str:
    return str(name) if name else DEFAULT_FAMILY


def trained_tokens(timelines: Iterable[Mapping[str, Any]]) -> int:
    """Tokens with loss mask 1 in stored timelines (``Timeline.to_dict()`` form)."""
    return sum(sum(b.get("loss_mask") or ()) for t in timelines for b in t.get("blocks", ()))


def _add_reward(rewards: dict[str, list[float]], fam: str, reward: float | Mapping[str, float]) -> None:
    rewards.setdefault(fam, []).append(scalar_reward(reward))
    if isinstance(reward, Mapping):
        for role, value in reward.items():
            rewards.setdefault(f"{fam}/{role}", []).append(float(value))


def step_family_metrics(records: Sequence[EpisodeRecord]) -> dict[str, float]:
    """``reward_mean/<f>``, ``episodes/<f>``, ``tokens/<f>`` (and ``demonstrations/<f>``) of one step's records."""
    rewards: dict[str, list[float]] = {}
    tokens: dict[str, int] = {}
    demos: dict[str, int] = {}
    for r in records:
        fam = family_of(r.task_family)
        tokens[fam] = tokens.get(fam, 0) + trained_tokens(r.timelines)
        if r.meta.get("demonstration"):
            demos[fam] = demos.get(fam, 0) + 1
        else:
            _add_reward(rewards, fam, r.reward)
    out: dict[str, float] = {}
    for key, values in rewards.items():
        out[f"reward_mean/{key}"] = sum(values) / len(values)
        if "/" not in key:
            out[f"episodes/{key}"] = float(len(values))
    for fam, n in tokens.items():
        out[f"tokens/{fam}"] = float(n)
    for fam, n in demos.items():
        out[f"demonstrations/{fam}"] = float(n)
    return out


class EvalTally:
    """Eval rewards per family since the last :meth:`take` (fed as eval episodes finish; thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rewards: dict[str, list[float]] = {}

    def add(self, family: str | None, reward: float | Mapping[str, float]) -> None:
        with self._lock:
            _add_reward(self._rewards, family_of(family), reward)

    def take(self) -> dict[str, float]:
        """``eval_reward/<f>`` and ``eval_episodes/<f>`` since the previous call (then reset)."""
        with self._lock:
            rewards, self._rewards = self._rewards, {}
        out: dict[str, float] = {}
        for key, values in rewards.items():
            out[f"eval_reward/{key}"] = sum(values) / len(values)
            if "/" not in key:
                out[f"eval_episodes/{key}"] = float(len(values))
        return out
