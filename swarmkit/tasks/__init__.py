"""Built-in tasks with verifiable rewards (client side: httpx only, no torch).

A task family makes :class:`Task` items (opening messages plus the expected
answer; train and held-out eval items come from disjoint seeds) and runs one
episode of an item against an episode's ``base_url``/``api_key``
(:func:`run_task`), giving an :class:`Outcome` (reward, final reply, metrics).

- single-call tasks (:mod:`.single`): ``arithmetic``, ``token_rule``;
- agent tasks: ``calc_agent`` (:mod:`.calc_agent`: multi-turn with a
  calculator tool; it also writes demonstrations for the supervised warm start),
  ``multi_calc`` (:mod:`.multi_calc`: two or three chained calculator calls per
  episode, one operation per call; demonstrations too);
- task suites (optional installs, imported when used): ``reasoning_gym``
  (:mod:`.rgym`: reasoning-gym's math families, its own scorers) and ``bfcl``
  (:mod:`.bfcl`: BFCL multi-turn tool use against its simulated APIs, its own
  checker); both with demonstrations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from swarmkit.tasks import bfcl, rgym
from swarmkit.tasks.base import Outcome, Task, chat, cycle
from swarmkit.tasks.calc_agent import demonstration as _calc_demonstration
from swarmkit.tasks.calc_agent import grade, load_agent, make_calc_tasks, run_calc_episode
from swarmkit.tasks.multi_calc import demonstration as _multi_demonstration
from swarmkit.tasks.multi_calc import make_multi_tasks, run_multi_episode
from swarmkit.tasks.single import SINGLE_TASKS, score_single

__all__ = ["TASKS", "Outcome", "Task", "cycle", "demonstration", "make_tasks", "run_task", "score"]

#: task name -> (n, seed, split, options) -> tasks
TASKS: dict[str, Callable[[int, int, str, dict[str, Any]], list[Task]]] = {**SINGLE_TASKS,
                                                                          "calc_agent": make_calc_tasks,
                                                                          "multi_calc": make_multi_tasks,
                                                                          "reasoning_gym": rgym.make_rg_tasks,
                                                                          "bfcl": bfcl.make_bfcl_tasks}


def make_tasks(name: str, n: int, seed: int = 0, split: str = "train", options: dict | None = None) -> list[Task]:
    """``n`` items of task ``name`` for ``split`` ("train" or "eval"; disjoint)."""
    try:
        factory = TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task '{name}'; built-in tasks: {', '.join(sorted(TASKS))}") from None
    return factory(n, seed, split, options or {})


def score(task: Task, completion: str) -> float:
    """Reward of ``completion`` (the assistant's reply text) for a single-call ``task``."""
    if task.family == "reasoning_gym":
        return rgym.score_rg(task, completion).reward
    return score_single(task, completion)


def run_task(http: httpx.Client, base_url: str, api_key: str, task: Task, *, max_tokens: int,
             temperature: float, seed: int | None = None) -> Outcome:
    """Run one episode of ``task`` against an episode's endpoint and grade it (no report)."""
    if task.family == "calc_agent":
        agent = task.meta.get("agent")
        max_turns = int(task.meta.get("max_turns", 3))
        if agent:  # the same agent written in another framework (task.options.agent)
            run = load_agent(str(agent))
            return grade(task, *run(base_url, api_key, task, temperature=temperature, seed=seed, max_tokens=max_tokens,
                                    max_turns=max_turns))
        return run_calc_episode(http, base_url, api_key, task, max_tokens=max_tokens, temperature=temperature,
                                max_turns=max_turns, seed=seed)
    if task.family == "multi_calc":
        return run_multi_episode(http, base_url, api_key, task, max_tokens=max_tokens, temperature=temperature,
                                 seed=seed)
    if task.family == "bfcl":
        return bfcl.run_bfcl_episode(http, base_url, api_key, task, max_tokens=max_tokens, temperature=temperature,
                                     seed=seed)
    body: dict[str, Any] = {"messages": task.messages, "max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    text = chat(http, base_url, api_key, body).get("content") or ""
    if task.family == "reasoning_gym":
        return rgym.score_rg(task, text)
    return Outcome(score_single(task, text), text)


def demonstration(task: Task) -> dict[str, Any] | None:
    """The demonstrated conversation of ``task`` for the supervised warm start, if the family has one."""
    if task.family == "calc_agent":
        return _calc_demonstration(task)
    if task.family == "multi_calc":
        return _multi_demonstration(task)
    if task.family == "reasoning_gym":
        return rgym.demonstration(task)
    if task.family == "bfcl":
        return bfcl.demonstration(task)
    return None
