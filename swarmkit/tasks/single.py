"""Single-call tasks with verifiable rewards: one chat call per episode, scored on its reply.

- ``arithmetic``: "What is a + b?"; reward 1.0 for the right number in
  ``<answer></answer>``, 0.5 when the first number after the first ``=`` is
  right ("3 + 4 = 7", the way a small chat model answers before it learns
  the tag), 0 otherwise. The partial credit gives SmolLM2-135M a learning
  signal from its first step.
- ``token_rule``: any prompt; the reward is the share of the reply's
  non-space characters that are the target letter (default ``e``). A
  trivial, dense rule a tiny random model learns in a few dozen steps
  (by emitting the tokens made of that letter): used by the fast learning test.
"""

from __future__ import annotations

import random
import re
from typing import Any

from swarmkit.tasks.base import Task

_ANSWER_RE = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
_EQUALS_RE = re.compile(r"=\s*(-?\d+)")


def _arithmetic(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    rng = random.Random(f"arith-{split}-{seed}")
    hi = int(options.get("max_operand", 9))
    system = options.get(
        "system",
        "You are a calculator. Reply with the result in the form <answer>N</answer> and nothing else.",
    )
    tasks = []
    for i in range(n):
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        tasks.append(
            Task(
                task_id=f"arith-{split}-{i}",
                messages=[
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"What is {a} + {b}?"},
                ],
                answer=str(a + b),
                family="arithmetic",
            )
        )
    return tasks


def _token_rule(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    rng = random.Random(f"rule-{split}-{seed}")
    words = ["apple", "banana", "hello", "world", "weather", "Paris", "tool", "think"]
    target = str(options.get("target", "e"))
    return [
        Task(
            task_id=f"rule-{split}-{i}",
            messages=[{"role": "user", "content": " ".join(rng.choices(words, k=3))}],
            answer=target,
            family="token_rule",
        )
        for i in range(n)
    ]


def score_single(task: Task, completion: str) -> float:
    """Reward of ``completion`` (the assistant's reply text) for a single-call ``task``."""
    if task.family == "arithmetic":
        m = _ANSWER_RE.search(completion)
        if m is not None and m.group(1) == task.answer:
            return 1.0
        m = _EQUALS_RE.search(completion)
        return 0.5 if m is not None and m.group(1) == task.answer else 0.0
    if task.family == "token_rule":
        chars = [c for c in completion if not c.isspace()]
        return sum(c in task.answer for c in chars) / len(chars) if chars else 0.0
    raise ValueError(f"no single-call scorer for task family '{task.family}'")


SINGLE_TASKS = {"arithmetic": _arithmetic, "token_rule": _token_rule}
