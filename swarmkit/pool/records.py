"""What the journal stores of one accepted training episode."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmkit.errors import SwarmkitError

UNTRAINED, TRAINED, FILTERED = "untrained", "trained", "filtered"


class DuplicateEpisodeError(SwarmkitError, ValueError):
    """An episode id that the journal already holds was added again."""


@dataclass
class EpisodeRecord:
    """One accepted training episode as stored in the journal.

    ``timelines`` are ``Timeline.to_dict()`` outputs, stored as JSON and
    treated as opaque. ``status`` is ``untrained``, ``trained`` or
    ``filtered``; it is set by the pool, not by callers of ``add``.
    """

    episode_id: str
    task_id: str
    client_id: str
    reward: float | dict[str, float]
    timelines: list[dict[str, Any]]
    policy_version: int
    task_family: str = ""
    accepted_at: float = field(default_factory=time.time)
    trained_step: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    status: str = UNTRAINED
    #: the LoRA adapter the episode sampled with and trains (``model.adapters``); "" = the one model
    adapter: str = ""


def check_reward(reward: Any) -> float | dict[str, float]:
    """A finite number, or a role -> finite number dict (copied); ValueError otherwise."""
    values = reward.values() if isinstance(reward, Mapping) else [reward]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"reward must be a finite number or role->number dict, got {reward!r}")
    if isinstance(reward, Mapping):
        return {str(k): float(v) for k, v in reward.items()}
    return float(reward)
