"""What every built-in task shares: the task item, an episode's outcome, the chat call, the tool loop."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
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


#: runs one tool call: (name, arguments as the model wrote them) -> (result text, well formed)
ToolRunner = Callable[[str, "str | dict[str, Any]"], tuple[str, bool]]


@dataclass
class ToolLoop:
    """What :func:`run_tool_loop` saw: the final reply, the whole conversation, each tool call's
    ``(result, well_formed)`` in order, and the number of chat calls."""

    final: str
    messages: list[dict[str, Any]]
    results: list[tuple[str, bool]]
    turns: int


#: runs the tool calls of one assistant reply (as the endpoint returned them) -> each call's result text
CallsRunner = Callable[[list[dict[str, Any]]], list[str]]


def chat_tool_turn(http: httpx.Client, base_url: str, api_key: str, messages: list[dict[str, Any]], *,
                   tools: list[dict[str, Any]], run_calls: CallsRunner, max_steps: int, max_tokens: int,
                   temperature: float, seed: int | None = None) -> tuple[str, int]:
    """One agent turn over the raw OpenAI chat protocol: call with ``tools``, run each reply's tool calls
    with ``run_calls`` and send the results back as ``tool`` messages, until a reply without tool calls
    or ``max_steps`` chat calls. ``messages`` grows in place; returns (the final reply's text, chat calls)."""
    for step in range(max_steps):
        body: dict[str, Any] = {"messages": messages, "tools": tools, "max_tokens": max_tokens,
                                "temperature": temperature}
        if seed is not None:
            body["seed"] = seed
        msg = chat(http, base_url, api_key, body)
        calls = msg.get("tool_calls") or []
        reply: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if calls:
            reply["tool_calls"] = calls
        messages.append(reply)
        if not calls:
            return msg.get("content") or "", step + 1
        results = run_calls(calls)
        messages.extend({"role": "tool", "tool_call_id": c.get("id", ""), "content": r}
                        for c, r in zip(calls, results, strict=True))
    return "", max_steps


def run_tool_loop(http: httpx.Client, base_url: str, api_key: str, task: Task, *, tool: dict[str, Any],
                  run_tool: ToolRunner, max_turns: int, max_tokens: int = 48, temperature: float = 1.0,
                  seed: int | None = None) -> ToolLoop:
    """The agent loop of the single-tool tasks: :func:`chat_tool_turn` from the task's opening messages,
    each call run by ``run_tool`` (its ``(result, well_formed)`` kept in order), at most ``max_turns`` chat
    calls."""
    messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
    results: list[tuple[str, bool]] = []

    def run_calls(calls: list[dict[str, Any]]) -> list[str]:
        done = [run_tool(c["function"]["name"], c["function"].get("arguments", "{}")) for c in calls]
        results.extend(done)
        return [text for text, _ in done]

    final, turns = chat_tool_turn(http, base_url, api_key, messages, tools=[tool], run_calls=run_calls,
                                  max_steps=max_turns, max_tokens=max_tokens, temperature=temperature, seed=seed)
    return ToolLoop(final=final, messages=messages, results=results, turns=turns)


def cycle(tasks: list[Task], seed: int = 0) -> Iterator[Task]:
    """Shuffle and repeat ``tasks`` forever (a new order each epoch)."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order
