"""Config schema of the ``turn_grpo`` algorithm (group ``algo``): GRPO's keys and the per-turn ones."""

from dataclasses import dataclass

from swarmkit_plugins.algo_rl.schema import GRPOConfig


@dataclass
class TurnGRPOConfig(GRPOConfig):
    name: str = "turn_grpo"
    #: discount of a turn's return per later turn (1.0: every turn is credited with all later rewards)
    gamma: float = 1.0
    #: per-turn group baseline: "loo" (the other rollouts that reached the turn; unbiased when the
    #: policy controls episode length, one std per group) | "mean" (GRPO per turn, itself included)
    baseline: str = "loo"
