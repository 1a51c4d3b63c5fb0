"""Per-turn credit in the training core: from calls to credit units, and advantages back onto tokens.

An algorithm with ``credit = "turn"`` labels every call of a reward unit with per-token
advantages (:meth:`swarmkit.contract.Algorithm.turn_advantages`). This module builds what it
is handed (:func:`credit_units`: each call's own reward and the client's own advantages come
from the call's timeline meta, where the report route stored them) and puts its answer on the
tokens: after merging, a sample holds the generated blocks of several calls (each absorbed
block keeps the tokens its call generated), and :func:`sample_advantages` gives each of them
the advantages of the call it came from.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from swarmkit.contract import Algorithm, CreditUnit, Turn, check_turn_advantages
from swarmkit.timelines import Block, Timeline
from swarmkit.timelines.merging import MergeResult

#: timeline meta keys the report route writes: the call's own reward, the client's own advantages
CALL_REWARD, CALL_ADVANTAGES = "call_reward", "call_advantages"


def generated_tokens(timeline: Timeline) -> int:
    """How many tokens a recorded call generated (its ``llm`` blocks; the completion block)."""
    return sum(len(b) for b in timeline.blocks if b.author == "llm")


def call_turn(timeline: Timeline, index: int) -> Turn:
    """The :class:`Turn` of one recorded call (``index``: its place in the unit, when the meta has no call)."""
    meta = timeline.meta
    reward = meta.get(CALL_REWARD)
    adv = meta.get(CALL_ADVANTAGES)
    tokens = generated_tokens(timeline)
    advantages = None
    if adv is not None:
        advantages = tuple(float(a) for a in adv)
        if len(advantages) != tokens or not all(math.isfinite(a) for a in advantages):
            raise ValueError(f"call {meta.get('call', index)} of episode {meta.get('episode_id')!r} carries "
                             f"{len(advantages)} advantages for {tokens} generated tokens")
    return Turn(call=_call_index(timeline, index), reward=float(reward) if reward is not None else 0.0,
                tokens=tokens, advantages=advantages)


def _call_index(timeline: Timeline, default: int) -> int:
    """The call's index in its episode (``meta["call"]``), ``default`` when the meta has none."""
    value = timeline.meta.get("call")
    return int(value) if value is not None else default


def _ordered(calls: Sequence[Timeline]) -> list[int]:
    """The indices of ``calls`` in the order they were made (call index, then choice)."""
    return sorted(range(len(calls)), key=lambda k: (_call_index(calls[k], k), int(calls[k].meta.get("choice") or 0), k))


def credit_units(unit_calls: Sequence[Sequence[Timeline]], rewards: Sequence[float], groups: Sequence[str],
                 episode_ids: Sequence[str]) -> list[CreditUnit]:
    """One :class:`CreditUnit` per reward unit; its turns are its calls in the order they were made."""
    units = []
    for calls, reward, group, eid in zip(unit_calls, rewards, groups, episode_ids, strict=True):
        units.append(CreditUnit(episode_id=str(eid), group=str(group), reward=float(reward),
                                turns=tuple(call_turn(calls[k], k) for k in _ordered(calls))))
    return units


def call_advantages(algo: Algorithm, unit_calls: Sequence[Sequence[Timeline]], rewards: Sequence[float],
                    groups: Sequence[str], episode_ids: Sequence[str]) -> dict[int, list[float]]:
    """``id(call timeline) -> (generated tokens,)`` advantages, from ``algo.turn_advantages``.

    :raises ValueError: the algorithm's answer does not have one finite advantage per generated
        token of every call (:func:`swarmkit.contract.check_turn_advantages`).
    """
    units = credit_units(unit_calls, rewards, groups, episode_ids)
    answer = algo.turn_advantages(units) if units else []
    check_turn_advantages(units, answer)
    out: dict[int, list[float]] = {}
    for calls, per_turn in zip(unit_calls, answer, strict=True):
        for k, adv in zip(_ordered(calls), per_turn, strict=True):
            out[id(calls[k])] = [float(a) for a in adv]
    return out


def _origin(k: int, s: int, absorbed: Mapping[int, list[int]], blocks: Sequence[Sequence[Block]]) -> int | None:
    """The input timeline whose call generated block ``k`` of survivor ``s``: ``s`` itself when the
    block was generated there, else the last timeline absorbed into ``s`` with a generated block at
    ``k`` (the merge absorbs from the latest down, and the first absorption of a position wins)."""
    if blocks[s][k].author == "llm":
        return s
    for j in absorbed.get(s, ()):  # descending
        if len(blocks[j]) > k and blocks[j][k].author == "llm":
            return j
    return None


def sample_advantages(timelines: Sequence[Timeline], result: MergeResult,
                      per_call: Mapping[int, Sequence[float]]) -> list[list[float]]:
    """Token-aligned advantages of each surviving timeline of a merge: every generated block gets
    the advantages its own call was given (``per_call``: ``id(call timeline) -> advantages`` over
    that call's generated tokens), every other token 0.

    :param timelines: the merge's input (one reward unit's calls, or one role's of them).
    :param result: ``merge(timelines, ...)``.
    :returns: one list per ``result.timelines``, as long as its tokens.
    """
    blocks = [t.blocks for t in timelines]
    absorbed: dict[int, list[int]] = {}
    for j in range(len(timelines) - 1, -1, -1):
        into = result.absorbed_into[j]
        if into is not None:
            absorbed.setdefault(into, []).append(j)
    out = []
    for s, merged in zip(result.survivors, result.timelines, strict=True):
        assert isinstance(merged, Timeline)
        row: list[float] = []
        for k, block in enumerate(merged.blocks):
            origin = _origin(k, s, absorbed, blocks) if block.author == "llm" else None
            if origin is None:
                row.extend([0.0] * len(block))
                continue
            adv = per_call.get(id(timelines[origin]))
            if adv is None:
                row.extend([0.0] * len(block))
                continue
            offset = sum(len(b) for b in blocks[origin][:k] if b.author == "llm")
            row.extend(float(a) for a in adv[offset:offset + len(block)])
        out.append(row)
    return out
