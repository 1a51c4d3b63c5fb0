"""``turn_grpo``: GRPO's loss with per-turn credit (``credit = "turn"``).

Each call of an episode is a turn with its own reward (``call_rewards`` in the report; 0 when
none was given) and the episode's reward on its last turn. A turn's advantage is its
γ-discounted return against the per-turn baseline of its task's group of rollouts
(:mod:`swarmkit_plugins.algo_rl.turn_credit`); every token the call generated gets it. A call
the client sent its own per-token advantages for (the expert option) trains with exactly those.
Written to the public contract only (:class:`swarmkit.contract.Algorithm`, ``turn_advantages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swarmkit.contract import CreditUnit
from swarmkit.errors import ConfigError
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.algo_rl.turn_credit import BASELINES, turn_advantages
from swarmkit_plugins.algo_rl.turn_schema import TurnGRPOConfig


class TurnGRPO(GRPO):
    """GRPO with per-turn credit, built as ``TurnGRPO(**fields of TurnGRPOConfig)``."""

    config_cls = TurnGRPOConfig
    credit = "turn"

    def __init__(self, **config: Any):
        self.cfg = TurnGRPOConfig(**config)  # the schema holds the only defaults
        problems = []
        if not 0.0 <= self.cfg.gamma <= 1.0:
            problems.append(f"algo.gamma must be in [0, 1], got {self.cfg.gamma}")
        if self.cfg.baseline not in BASELINES:
            problems.append(f"algo.baseline must be one of {BASELINES}, got {self.cfg.baseline!r}")
        if problems:
            raise ConfigError(problems)
        self._init_common(self.cfg)
        self.std_normalize = bool(self.cfg.std_normalize)
        self.adv_eps = float(self.cfg.adv_eps)
        self.gamma = float(self.cfg.gamma)
        self.baseline = self.cfg.baseline

    def turn_advantages(self, units: Sequence[CreditUnit]) -> list[list[list[float]]]:
        """Per-token advantages of every call: its turn's advantage on each of its tokens, or the
        client's own advantages where it sent them."""
        if not units:
            return []
        index: dict[str, int] = {}
        groups = torch.tensor([index.setdefault(u.group, len(index)) for u in units])
        lengths = torch.tensor([len(u.turns) for u in units])
        T = max(1, int(lengths.max()))
        rewards = torch.zeros(len(units), T, dtype=torch.float64)
        for i, u in enumerate(units):
            for t, turn in enumerate(u.turns):
                rewards[i, t] = turn.reward
        final = torch.tensor([u.reward for u in units], dtype=torch.float64)
        adv = turn_advantages(rewards, lengths, final, groups, self.gamma, self.baseline,
                              self.std_normalize, self.adv_eps).tolist()
        return [[list(turn.advantages) if turn.advantages is not None else [adv[i][t]] * turn.tokens
                 for t, turn in enumerate(u.turns)] for i, u in enumerate(units)]
