"""Per-turn credit: what an algorithm with ``credit = "turn"`` receives and answers.

An episode (or, with role rewards, one role of it) is a *reward unit*. Besides the unit's
reward, a client may give each recorded LLM call of the unit a reward of its own, or (the
expert option) the per-token advantages of its generated tokens (``POST .../report`` with
``call_rewards``; see docs/server_api.md). The trainer hands the units of a batch to
:meth:`swarmkit.contract.Algorithm.turn_advantages` as :class:`CreditUnit` s, their calls in
order as :class:`Turn` s, and places the per-token advantages it gets back on the very tokens
each call generated, also after timeline merging moved them into a longer call's sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: how an algorithm labels tokens: one advantage per reward unit, or per-token advantages per turn
CREDIT_MODES: tuple[str, ...] = ("episode", "turn")


@dataclass(frozen=True)
class Turn:
    """One recorded LLM call of a reward unit.

    :param call: the call's index in its episode (timeline ``meta["call"]``).
    :param reward: the call's own reward (``call_rewards``); 0.0 when the client gave none.
    :param tokens: how many tokens the call generated (its completion block).
    :param advantages: ``(tokens,)`` the client's own per-token advantages for this call (the
        expert option), or None.
    """

    call: int
    reward: float
    tokens: int
    advantages: tuple[float, ...] | None = None


@dataclass(frozen=True)
class CreditUnit:
    """One reward unit with its turns.

    :param episode_id: the episode.
    :param group: the unit's group (the task id, or task id and role for role rewards): compare a
        unit only with the units of its group, as ``episode_advantages`` does.
    :param reward: the episode's (or the role's) reward, after any overlong penalty.
    :param turns: the unit's calls, in the order they were made.
    """

    episode_id: str
    group: str
    reward: float
    turns: tuple[Turn, ...]


def check_turn_advantages(units: Sequence[CreditUnit], answer: Sequence[Sequence[Sequence[float]]]) -> None:
    """Raise :class:`ValueError` unless ``answer`` has one list per unit, one per turn, and exactly
    ``turn.tokens`` finite numbers per turn."""
    import math

    if len(answer) != len(units):
        raise ValueError(f"turn_advantages answered {len(answer)} units for {len(units)}")
    for unit, per_turn in zip(units, answer, strict=True):
        if len(per_turn) != len(unit.turns):
            raise ValueError(f"turn_advantages answered {len(per_turn)} turns for episode {unit.episode_id!r}, "
                             f"which has {len(unit.turns)}")
        for turn, adv in zip(unit.turns, per_turn, strict=True):
            if len(adv) != turn.tokens:
                raise ValueError(f"turn_advantages answered {len(adv)} advantages for call {turn.call} of episode "
                                 f"{unit.episode_id!r}, which generated {turn.tokens} tokens")
            if not all(math.isfinite(a) for a in adv):
                raise ValueError(f"turn_advantages answered a non-finite advantage for call {turn.call} of episode "
                                 f"{unit.episode_id!r}")
