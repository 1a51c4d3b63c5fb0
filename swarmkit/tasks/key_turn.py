"""``key_turn``: a four-turn dialogue in which only one turn decides success (per-turn credit's test bed).

The agent answers four user turns in one conversation. Turns 1, 3 and 4 are small talk whose
replies are never scored. Turn 2 is the "tool call": the user names the argument (a letter),
and the turn scores the share of the reply's non-space characters that are that letter (a
dense version of "call the tool with the right argument", which the random-init tiny model can
learn in a few dozen steps). The episode's reward is turn 2's score; :func:`run_key_turn`
also returns every turn's score, so a client can report them per turn
(``ep.report(0.0, turn_rewards=per_turn)``) or as one episode reward. Used by
``benchmarks/turn_credit.py``; not a main-job task (the main job reports one reward per episode).
"""

from __future__ import annotations

import random
from typing import Any

import httpx

from swarmkit.tasks.base import Outcome, Task, chat

#: the turn (0-based) whose reply decides the episode
KEY_TURN = 1
TURNS = 4
_WORDS = ["apple", "banana", "hello", "world", "weather", "Paris", "tool", "think", "yes", "no"]
_LETTERS = "e"


def make_key_turn_tasks(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    """``n`` items: four user turns each; turn :data:`KEY_TURN` names the argument letter."""
    rng = random.Random(f"key-turn-{split}-{seed}")
    letters = str(options.get("letters", _LETTERS))
    tasks = []
    for i in range(n):
        letter = rng.choice(letters)
        turns = [" ".join(rng.choices(_WORDS, k=3)) for _ in range(TURNS)]
        turns[KEY_TURN] = f"tool {letter} " + " ".join(rng.choices(_WORDS, k=2))
        tasks.append(Task(task_id=f"key-{split}-{i}", messages=[{"role": "user", "content": turns[0]}],
                          answer=letter, family="key_turn", meta={"turns": turns}))
    return tasks


def score_key(reply: str, letter: str) -> float:
    """The share of ``reply``'s non-space characters that are ``letter`` (0 for an empty reply)."""
    chars = [c for c in reply if not c.isspace()]
    return sum(c == letter for c in chars) / len(chars) if chars else 0.0


def run_key_turn(http: httpx.Client, base_url: str, api_key: str, task: Task, *, max_tokens: int,
                 temperature: float, seed: int | None = None) -> tuple[Outcome, list[float]]:
    """One episode: the four turns in one conversation. Returns the outcome (reward = the key
    turn's score) and the per-turn rewards (the key turn's score there, 0 elsewhere)."""
    messages: list[dict[str, Any]] = []
    replies = []
    for k, text in enumerate(task.meta["turns"]):
        messages.append({"role": "user", "content": text})
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature}
        if seed is not None:
            body["seed"] = seed + k
        reply = chat(http, base_url, api_key, body).get("content") or ""
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    score = score_key(replies[KEY_TURN], task.answer)
    per_turn = [score if k == KEY_TURN else 0.0 for k in range(TURNS)]
    return Outcome(score, replies[KEY_TURN], {"key_score": score}, messages), per_turn
