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
    ``versions[t]`` is the policy version that sampled token ``t`` (meaningful
    where ``loss_mask[t] == 1``; None: all ``policy_version``); a partial
    rollout has several.
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
    versions: list[int] | None = None

    def token_versions(self) -> list[int]:
        """``[T]`` the policy version of every token (``policy_version`` where none was recorded)."""
        if self.versions is None:
            return [int(self.policy_version)] * len(self.input_ids)
        return [int(v) for v in self.versions]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSample:
        return cls(**dict(d))
