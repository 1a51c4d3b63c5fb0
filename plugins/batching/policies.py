"""Built-in batching policies C1-C5.

Each policy looks at the untrained episodes of the pool (oldest first) and the
clients, and answers with a :class:`~swarmkit.contract.Decision`: whether to
train now, its progress towards the trigger (``current``/``target``/``unit``)
and, when it fires, the ids of the episodes that form the batch.

What goes into a batch (see ``docs/batching.md``):

- C1 ``EpisodeCount``: the ``B*N`` oldest episodes, whatever their task.
- C2 ``TaskCount``: the ``B`` oldest complete tasks (a task's age is that of
  its oldest episode), each with its ``N`` oldest episodes.
- C3 ``NonDegenerateTaskCount``: as C2, over tasks whose ``N`` oldest rewards
  are not all equal. Degenerate complete groups are listed in
  ``detail["filtered"]`` so the server can retire them explicitly.
- C4 ``AllClientsReady`` / C5 ``AnyClientReady``: every untrained episode.

Episodes not selected stay in the pool for the next batch; a policy never
drops anything. ``selected`` is grouped by task (tasks oldest first, episodes
oldest first within a task).

Cocktail limits cap the share of a task family in a batch. For C1 the unit is
episodes (cap ``max(1, floor(share*B*N))``), for C2/C3 tasks (cap
``max(1, floor(share*B))``). For C4/C5 whole tasks are admitted oldest first
while the family's episodes stay within ``share`` of the batch (the first task
of each family is always admitted). Families without a limit are not capped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from swarmkit.contract import BatchingPolicy, ClientState, Decision, PoolEpisode
from swarmkit.errors import ConfigError
from swarmkit_plugins.batching.schema import BatchingConfig

#: rewards that differ by no more than this count as equal (C3)
DEGENERATE_EPS = 1e-9


def _group_by_task(episodes: Sequence[PoolEpisode]) -> dict[str, list[PoolEpisode]]:
    """Task id -> its episodes, both in order of first appearance (oldest first)."""
    groups: dict[str, list[PoolEpisode]] = {}
    for ep in episodes:
        groups.setdefault(ep.task_id, []).append(ep)
    return groups


class PoolPolicy(BatchingPolicy):
    """Shared set-up of the built-in policies: B, N, the active window and cocktail caps."""

    unit: str = ""

    def __init__(self, **config: Any):
        # BatchingConfig holds the defaults; keys of a plugin's own schema (a subclass option) stay in options
        known = {f.name for f in dataclasses.fields(BatchingConfig)}
        cfg = BatchingConfig(**{k: v for k, v in config.items() if k in known})
        options = {k: v for k, v in config.items() if k not in known}
        batch_size, rollouts_per_task, active_window_s = cfg.batch_size, cfg.rollouts_per_task, cfg.active_window_s
        cocktail, name = cfg.cocktail, cfg.name
        problems = []
        if int(batch_size) < 1:
            problems.append(f"batching.batch_size must be >= 1, got {batch_size}")
        if int(rollouts_per_task) < 1:
            problems.append(f"batching.rollouts_per_task must be >= 1, got {rollouts_per_task}")
        if float(active_window_s) <= 0:
            problems.append(f"batching.active_window_s must be > 0, got {active_window_s}")
        cocktail = dict(cocktail or {})
        for fam, share in cocktail.items():
            if not isinstance(share, int | float) or not 0 < float(share) <= 1:
                problems.append(
                    f"batching.cocktail[{fam!r}] must be a share in (0, 1], got {share!r}"
                )
        if problems:
            raise ConfigError(problems)
        super().__init__(int(batch_size), int(rollouts_per_task), active_window_s=float(active_window_s), **options)
        self.cfg = cfg
        self.cocktail: dict[str, float] = {str(k): float(v) for k, v in cocktail.items()}
        self.name = name

    # ------------------------------------------------------------------ helpers
    def active_clients(
        self, clients: Mapping[str, ClientState], now: float
    ) -> dict[str, ClientState]:
        """The clients seen within ``active_window_s`` of ``now``."""
        return {
            cid: c for cid, c in clients.items() if now - c.last_seen <= self.active_window_s
        }

    def family_cap(self, family: str, total: int) -> int | None:
        """Most units of ``family`` in a batch of ``total`` units; None if uncapped."""
        share = self.cocktail.get(family)
        if share is None:
            return None
        return max(1, math.floor(share * total + 1e-9))

    def _capped_pick(
        self, units: Sequence[tuple[str, Any]], total: int
    ) -> tuple[list[Any], int]:
        """Pick up to ``total`` units oldest first, respecting family caps.

        ``units`` are ``(family, unit)`` pairs. Returns the picked units and
        how many units count towards the trigger (the sum over families of
        ``min(available, cap)``: all units but those the caps hold back).
        """
        countable = len(units) - sum(self.held_by_caps(units, total).values())
        picked: list[Any] = []
        used: dict[str, int] = {}
        for fam, unit in units:
            if len(picked) >= total:
                break
            cap = self.family_cap(fam, total)
            if cap is not None and used.get(fam, 0) >= cap:
                continue
            used[fam] = used.get(fam, 0) + 1
            picked.append(unit)
        return picked, countable

    def held_by_caps(self, units: Sequence[tuple[str, Any]], total: int) -> dict[str, int]:
        """Per capped family, its units past its cap in a batch of ``total``: what the caps hold back."""
        per_family: dict[str, int] = {}
        for fam, _ in units:
            per_family[fam] = per_family.get(fam, 0) + 1
        held = {}
        for fam, n in per_family.items():
            cap = self.family_cap(fam, total)
            if cap is not None and n > cap:
                held[fam] = n - cap
        return held

    @staticmethod
    def _ordered_ids(episodes: Sequence[PoolEpisode], chosen: set[str]) -> list[str]:
        """``chosen`` ids grouped by task (tasks oldest first), oldest first within."""
        out: list[str] = []
        for group in _group_by_task([e for e in episodes if e.episode_id in chosen]).values():
            out.extend(e.episode_id for e in group)
        return out

    def _base_detail(self, episodes: Sequence[PoolEpisode]) -> dict[str, Any]:
        groups = _group_by_task(episodes)
        complete = sum(1 for g in groups.values() if len(g) >= self.rollouts_per_task)
        return {"episodes": len(episodes), "tasks": len(groups), "complete_tasks": complete}


# ---------------------------------------------------------------------- C1
class EpisodeCount(PoolPolicy):
    """C1: train when at least ``B*N`` episodes are in the pool.

    Batch: the ``B*N`` oldest episodes (under cocktail caps, in episodes),
    regardless of task, so a task's group may be split across batches.
    """

    unit = "episodes"

    def decide(
        self, episodes: Sequence[PoolEpisode], clients: Mapping[str, ClientState], now: float
    ) -> Decision:
        target = self.batch_size * self.rollouts_per_task
        units = [(e.task_family, e) for e in episodes]
        picked, current = self._capped_pick(units, target)
        detail = self._base_detail(episodes)
        fire = len(picked) >= target
        if not fire and len(units) >= target:  # enough in the pool: only the caps keep the batch short
            detail["held_by_cocktail"] = self.held_by_caps(units, target)
        chosen = {e.episode_id for e in picked} if fire else set()
        return Decision(fire, current, target, self.unit,
                        self._ordered_ids(episodes, chosen), detail)


# ---------------------------------------------------------------------- C2 / C3
class TaskCount(PoolPolicy):
    """C2: train when at least ``B`` tasks have at least ``N`` episodes.

    Batch: the ``B`` oldest complete tasks (under cocktail caps, in tasks),
    each with its ``N`` oldest episodes; extra episodes of a task stay in the
    pool for a later batch.
    """

    unit = "tasks"
    filters_degenerate = False

    def _eligible(self, group: list[PoolEpisode]) -> bool:
        return len(group) >= self.rollouts_per_task

    def decide(
        self, episodes: Sequence[PoolEpisode], clients: Mapping[str, ClientState], now: float
    ) -> Decision:
        n = self.rollouts_per_task
        groups = _group_by_task(episodes)
        units = []
        filtered: list[str] = []
        for group in groups.values():
            if len(group) < n:
                continue
            if self._eligible(group):
                units.append((group[0].task_family, group[:n]))
            else:
                filtered.extend(e.episode_id for e in group[:n])
        picked, current = self._capped_pick(units, self.batch_size)
        detail = self._base_detail(episodes)
        if self.filters_degenerate:
            detail["degenerate_tasks"] = len(filtered) // n
            detail["filtered"] = filtered
        fire = len(picked) >= self.batch_size
        if not fire and len(units) >= self.batch_size:  # enough complete tasks: only the caps keep it short
            detail["held_by_cocktail"] = self.held_by_caps(units, self.batch_size)
        selected = [e.episode_id for group in picked for e in group] if fire else []
        return Decision(fire, current, self.batch_size, self.unit, selected, detail)


class NonDegenerateTaskCount(TaskCount):
    """C3: like C2, counting only complete tasks whose ``N`` oldest rewards differ.

    A group whose rewards are all equal carries no group-relative signal (DAPO
    dynamic sampling). Such groups are never selected; their ids are reported
    in ``detail["filtered"]`` (and ``detail["degenerate_tasks"]`` counts them)
    so the server can retire them with ``SamplePool.mark_filtered``.
    """

    filters_degenerate = True

    def _eligible(self, group: list[PoolEpisode]) -> bool:
        rewards = [e.reward for e in group[: self.rollouts_per_task]]
        return max(rewards) - min(rewards) > DEGENERATE_EPS


# ---------------------------------------------------------------------- C4 / C5
class _ClientVote(PoolPolicy):
    """Fire on the ready flags of the active clients; the batch is the whole pool."""

    unit = "ready clients"

    def _agreed(self, ready: int, active: int) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def _target(self, active: int) -> int:
        return active

    def _select(self, episodes: Sequence[PoolEpisode]) -> list[str]:
        groups = list(_group_by_task(episodes).values())
        if not self.cocktail:
            return [e.episode_id for g in groups for e in g]
        admitted = [False] * len(groups)
        fam_count: dict[str, int] = {}
        total = 0
        changed = True
        while changed:  # admitting a task only loosens other families' limits
            changed = False
            for i, group in enumerate(groups):
                if admitted[i]:
                    continue
                fam, w = group[0].task_family, len(group)
                share = self.cocktail.get(fam)
                have = fam_count.get(fam, 0)
                if share is None or have == 0 or have + w <= share * (total + w) + 1e-9:
                    admitted[i] = True
                    fam_count[fam] = have + w
                    total += w
                    changed = True
        return [e.episode_id for i, g in enumerate(groups) if admitted[i] for e in g]

    def decide(
        self, episodes: Sequence[PoolEpisode], clients: Mapping[str, ClientState], now: float
    ) -> Decision:
        active = self.active_clients(clients, now)
        ready = sorted(cid for cid, c in active.items() if c.ready)
        detail = self._base_detail(episodes)
        detail.update(active_clients=sorted(active), ready_clients=ready)
        agreed = bool(active) and self._agreed(len(ready), len(active))
        selected = self._select(episodes) if agreed else []
        if agreed and not selected:
            detail["reason"] = "clients agree but the pool is empty"
        target = self._target(len(active))
        return Decision(bool(selected), len(ready), target, self.unit, selected, detail)


class AllClientsReady(_ClientVote):
    """C4: train when every active client has signalled ready (and the pool is not empty).

    Fill: ready active clients against all active clients. Batch: every
    untrained episode, grouped by task (cocktail caps apply).
    """

    def _agreed(self, ready: int, active: int) -> bool:
        return ready == active


class AnyClientReady(_ClientVote):
    """C5: train when any active client has signalled ready (and the pool is not empty).

    Fill: ready active clients against 1. Batch: every untrained episode,
    grouped by task (cocktail caps apply).
    """

    def _agreed(self, ready: int, active: int) -> bool:
        return ready >= 1

    def _target(self, active: int) -> int:
        return 1
