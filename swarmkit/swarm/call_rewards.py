"""Rewards (or per-token advantages) of single recorded calls, given when an episode ends.

A report (or prepare) may carry ``call_rewards``: a list of items, each naming one recorded
LLM call of the episode and giving it its own reward or, the expert option, the advantages of
each token it generated::

    {"call": 1, "reward": 0.5}                           # the episode's call 1 (timeline meta "call")
    {"turn": 2, "reward": 1.0}                           # the 3rd call of the episode (of its only role)
    {"role": "spy", "turn": 0, "reward": -1.0}           # the first call of role "spy"
    {"call": 3, "advantages": [0.1, 0.1, -0.2, ...]}     # one per token the call generated

:func:`resolve_call_rewards` checks every item against the episode (a call that does not exist,
one named twice, advantages whose length is not the call's generated tokens, NaN or inf: a 422
naming the item) before anything is stored; :func:`store_call_rewards` writes them into the
calls' timeline meta (``call_reward``, ``call_advantages``), which the journal stores with the
episode (so they survive a crash as the episode's reward does) and the trainer reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from swarmkit.errors import ApiError
from swarmkit.timelines import Timeline
from swarmkit.training.credit import CALL_ADVANTAGES, CALL_REWARD

_KEYS = frozenset({"call", "turn", "role", "choice", "reward", "advantages"})
PARAM = "call_rewards"


def _bad(message: str, where: str) -> ApiError:
    return ApiError(422, f"{where}: {message}", "invalid_call_reward", param=PARAM)


def _index(item: dict[str, Any], key: str, where: str) -> int | None:
    value = item.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"'{key}' must be an integer >= 0, got {value!r}", where)
    return value


def _finite(value: Any, what: str, where: str, max_abs: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(f"{what} must be a number, got {type(value).__name__}", where)
    try:
        x = float(value)
    except OverflowError:
        raise _bad(f"{what} is too large", where) from None
    if not math.isfinite(x):
        raise _bad(f"{what} must be finite, got {x}", where)
    if abs(x) > max_abs:
        raise _bad(f"{what} = {x:g} is larger than this server allows (server.max_abs_reward = {max_abs:g})", where)
    return x


def _target(item: dict[str, Any], calls: Sequence[Timeline], roles: Sequence[str], where: str) -> Timeline:
    """The one recorded call an item names."""
    call, turn, choice = _index(item, "call", where), _index(item, "turn", where), _index(item, "choice", where)
    role = item.get("role")
    if (call is None) == (turn is None):
        raise _bad("name the call with exactly one of 'call' (its index in the episode) or 'turn' "
                   "(its place among its role's calls)", where)
    if role is not None and not isinstance(role, str):
        raise _bad(f"'role' must be a string, got {type(role).__name__}", where)
    if call is not None:
        if role is not None:
            raise _bad("'role' goes with 'turn', not with 'call' (a call index is the episode's)", where)
        matching = [t for t in calls if t.meta.get("call") == call]
        if not matching:
            known = sorted({int(t.meta.get("call", -1)) for t in calls})
            raise _bad(f"the episode has no recorded call {call} (its calls: "
                       f"{', '.join(map(str, known)) if known else 'none'})", where)
    else:
        if roles and role is None:
            raise _bad(f"the episode has roles ({', '.join(roles)}): name the 'role' whose turn it is", where)
        if role is not None and role not in roles:
            raise _bad(f"unknown role {role!r}" + (f"; roles are {', '.join(roles)}" if roles else
                                                    " (the episode was registered without roles)"), where)
        own = sorted({int(t.meta.get("call", -1)) for t in calls if t.role == role})
        assert turn is not None
        if turn >= len(own):
            raise _bad(f"{'role ' + repr(role) if role else 'the episode'} made {len(own)} call(s); there is no "
                       f"turn {turn}", where)
        matching = [t for t in calls if t.meta.get("call") == own[turn] and t.role == role]
    if choice is not None:
        matching = [t for t in matching if int(t.meta.get("choice", 0)) == choice]
        if not matching:
            raise _bad(f"that call has no choice {choice}", where)
    elif len(matching) > 1:
        raise _bad(f"that call returned {len(matching)} choices: name one with 'choice'", where)
    return matching[0]


def resolve_call_rewards(items: Any, calls: Sequence[Timeline], roles: Sequence[str],
                         max_abs: float = math.inf) -> list[tuple[Timeline, float | None, list[float] | None]]:
    """``(call timeline, reward, advantages)`` per item of ``call_rewards``, all checked.

    :param items: the request's ``call_rewards`` (None: no item).
    :param calls: the episode's recorded timelines (demonstrations are not calls of the policy).
    :param roles: the episode's roles (empty without roles).
    :param max_abs: the largest reward or advantage allowed (``server.max_abs_reward``).
    :raises ApiError: 422 ``invalid_call_reward`` naming the first wrong item.
    """
    if items is None:
        return []
    if not isinstance(items, list):
        raise ApiError(422, f"'{PARAM}' must be a list of objects, got {type(items).__name__}",
                       "invalid_call_reward", param=PARAM)
    sampled = [t for t in calls if not t.meta.get("demonstration")]
    out: list[tuple[Timeline, float | None, list[float] | None]] = []
    seen: dict[int, str] = {}
    for n, item in enumerate(items):
        where = f"{PARAM}[{n}]"
        if not isinstance(item, dict):
            raise _bad(f"must be an object, got {type(item).__name__}", where)
        unknown = sorted(set(item) - _KEYS)
        if unknown:
            raise _bad(f"unknown field(s) {', '.join(map(repr, unknown))}; an item has call or turn (and role, "
                       "choice) and one of reward or advantages", where)
        target = _target(item, sampled, roles, where)
        if id(target) in seen:
            raise _bad(f"names the same call as {seen[id(target)]}", where)
        seen[id(target)] = where
        has_reward, has_adv = item.get("reward") is not None, item.get("advantages") is not None
        if has_reward == has_adv:
            raise _bad("give exactly one of 'reward' (a number) or 'advantages' (one number per generated token)",
                       where)
        if has_reward:
            out.append((target, _finite(item["reward"], "'reward'", where, max_abs), None))
            continue
        adv = item["advantages"]
        tokens = sum(len(b) for b in target.blocks if b.author == "llm")
        if not isinstance(adv, list):
            raise _bad(f"'advantages' must be a list of numbers, got {type(adv).__name__}", where)
        if len(adv) != tokens:
            raise _bad(f"'advantages' has {len(adv)} values but the call generated {tokens} tokens", where)
        out.append((target, None, [_finite(a, f"'advantages'[{k}]", where, max_abs) for k, a in enumerate(adv)]))
    return out


def store_call_rewards(calls: Sequence[Timeline],
                       resolved: Sequence[tuple[Timeline, float | None, list[float] | None]]) -> int:
    """Write resolved items into their calls' meta, first clearing what an earlier (failed) report left;
    returns how many calls got a reward or advantages."""
    for t in calls:
        t.meta.pop(CALL_REWARD, None)
        t.meta.pop(CALL_ADVANTAGES, None)
    for target, reward, adv in resolved:
        if reward is not None:
            target.meta[CALL_REWARD] = reward
        if adv is not None:
            target.meta[CALL_ADVANTAGES] = adv
    return len(resolved)
