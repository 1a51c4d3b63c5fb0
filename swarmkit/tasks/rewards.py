"""What a built-in task's reward means: its scale in words, and the reward of a fully right answer.

The main job prints the legend beside every mean and counts the episodes that got full credit, so that
a mean of 0.469 on ``arithmetic`` (partial credit 0.5) does not read as 47% right. A task family's scorer
and its legend live side by side here under :mod:`swarmkit.tasks`; a family without one has no legend.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RewardScale:
    #: the scale in words (what 1.0, 0.5, 0 ... mean)
    legend: str
    #: the reward of a fully right answer (an episode at or above it counts as full credit)
    full: float


#: task family -> its reward scale (the scorers: swarmkit/tasks/single.py, swarmkit/tasks/calc_agent.py)
REWARD_SCALES: dict[str, RewardScale] = {
    "arithmetic": RewardScale("1.0 = the right number in <answer></answer>, 0.5 = the right number after the first "
                              "'=' (partial credit), 0 = wrong", 1.0),
    "token_rule": RewardScale("the share of the reply's non-space characters that are the target letter "
                              "(1.0 = all of them)", 1.0),
    "calc_agent": RewardScale("1.0 = the right answer, + 0.1 for a well-formed calculator call "
                              "(1.1 = right, with the tool), 0 = wrong without a valid call", 1.0),
    "reasoning_gym": RewardScale("reasoning-gym's own score of the <answer></answer>: 1.0 = right, the family's "
                                 "partial credit otherwise (gsm_symbolic: 0.01 for a wrong number), 0 = no tag", 1.0),
    "bfcl": RewardScale("the share of the entry's user turns that pass BFCL's multi-turn checker before the first "
                        "failure (1.0 = the whole entry passes), + task.options.tool_credit for a well-formed call",
                        1.0),
}


def reward_scale(family: str) -> RewardScale | None:
    """The reward scale of task family ``family`` (None: not described)."""
    return REWARD_SCALES.get(family)


def full_credit(rewards: list[float], scale: RewardScale) -> tuple[int, int]:
    """How many of ``rewards`` reached full credit, of how many."""
    return sum(r >= scale.full for r in rewards), len(rewards)
