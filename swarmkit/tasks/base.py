"""What every built-in task shares: the task item, an episode's outcome, the chat call."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Task:
    """One task item: the opening chat messages, the expected answer, the family that runs it."""

    task_id: str
    messages: list[dict[str, Any]]
    answer: str
    family: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class Outcome:
    """How an episode went: the reward to report, the final reply, and per-episode metrics
    (e.g. ``correct``, ``valid_tool_call``, ``turns``) that evaluations average."""

    reward: float
    completion: str
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)


def chat(http: httpx.Client, base_url: str, api_key: str, body: dict[str, Any]) -> dict[str, Any]:
    """One ``POST {base_url}/chat/completions``; the first choice's message (raises on HTTP errors)."""
    resp = http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                     json={"model": "swarm", **body})
    resp.raise_for_status()
    return dict(resp.json()["choices"][0]["message"])


def cycle(tasks: list[Task], seed: int = 0) -> Iterator[Task]:
    """Shuffle and repeat ``tasks`` forever (a new order each epoch)."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order
