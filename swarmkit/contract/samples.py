"""What the trainer hands an optimizer engine: token-aligned training samples."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainSample:
    """One training sequence; all lists are token-aligned, length T.

    ``old_logprobs[t]`` is log p(input_ids[t] | input_ids[:t]) recorded at
    rollout time (only meaningful where ``loss_mask[t] == 1``; NaN asks the
    engine to score it); ``advantages[t]`` is the sample's advantage on
    generated tokens, 0 elsewhere. ``reward`` is the (episode, role) reward
    (PPO puts it on the last generated token). ``demonstration`` marks a
    supervised sample (a demonstrated conversation, see ``build_samples``).
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    episode_id: str = ""
    task_id: str = ""
    policy_version: int = 0
    role: str | None = None
    reward: float = 0.0
    demonstration: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSample:
        return cls(**dict(d))
