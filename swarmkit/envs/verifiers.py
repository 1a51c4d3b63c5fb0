"""A verifiers environment (``verifiers`` 0.4.0, ``verifiers.v1``) played as swarm episodes.

A verifiers ``Env`` runs its own agent: each task is handed to a *harness* (a program in a
runtime, or a loop in the env's process) whose model calls go through the env's interception
server to the endpoint of a ``ModelContext``. There is no reset/step loop to drive, so the
adapter does not use :mod:`.loop`: it opens a swarm episode, points the env's model endpoint at
that episode (``EvalClientConfig(base_url=ep.base_url)``, the episode's key read from an
environment variable of its own, as verifiers reads keys), runs ``Env.run_episode(task, ctx)``
and reports what the env's rubric said.

What flows into the swarm episode, unchanged: the reward (a trace's ``reward``, the weighted
sum of its ``@vf.reward`` functions; the mean over the traces of a multi-agent episode);
``eval`` (a held-out task: scored, never trained on); ``meta`` at registration (with
``task_family`` and the task's ``id``/``idx``/``name``/``key``); with the report
``meta["metrics"]`` (every reward's score, every ``@vf.metric``, ``vf_reward``, ``ok``,
``turns``, ``truncated``) and ``meta["verifiers"]`` (rewards with their weights, metrics,
the trace's ``info``, ``stop_condition``, errors). An episode that the env could not score
(no trace, or no reward computed because the run failed) is aborted with the env's error:
no sample is trained on a reward nobody computed.

Nothing here imports verifiers until an episode runs: install it where the env runs
(docs/environments.md; it cannot share swarmkit's own environment).
"""

from __future__ import annotations

import asyncio
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from swarmkit.envs.loop import json_safe

#: prefix of the per-episode environment variable holding the episode's key (it contains
#: ``API_KEY``, so verifiers' subprocess runtime keeps it out of the harness's environment)
KEY_VAR_PREFIX = "SWARMKIT_EPISODE_API_KEY_"


@dataclass
class VerifiersResult:
    """How one verifiers episode went, and what the server answered (a report or an abort)."""

    episode_id: str
    task_id: str
    #: the reported reward (None when the episode was aborted)
    reward: float | None
    #: each reward function's score (unweighted), by name
    rewards: dict[str, float]
    metrics: dict[str, float]
    ok: bool
    errors: list[str]
    report: dict[str, Any]
    #: the verifiers ``Episode`` (traces, messages, timings)
    episode: Any


def task_key(task: Any) -> str:
    """A task's name in swarm task ids: its ``data.id``, else its ``data.idx``, else its content key."""
    data = task.data
    if getattr(data, "id", None) is not None:
        return str(data.id)
    if getattr(data, "idx", None) is not None:
        return str(data.idx)
    return str(task.key)[:16]


def task_meta(task: Any) -> dict[str, Any]:
    """What identifies a task in the registration's metadata: ``id``, ``idx``, ``name``, ``key``."""
    data = task.data
    out = {k: getattr(data, k, None) for k in ("id", "idx", "name")}
    out["key"] = str(task.key)
    return {k: v for k, v in out.items() if v is not None}


def _scored(trace: Any) -> bool:
    """Whether the env's scoring ran on ``trace`` (a reward of ``None``: it did not)."""
    rewards = dict(trace.rewards or {})
    if rewards:
        return all(r is not None for r in rewards.values())
    return bool(trace.ok)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(float(x))


def episode_errors(episode: Any) -> list[str]:
    """The episode's and its traces' errors, ``"Type: message"`` each, oldest first."""
    errs = list(episode.errors or []) + [e for t in episode.traces for e in (t.errors or [])]
    return [f"{e.type}: {e.message}" for e in errs]


def episode_report(episode: Any) -> tuple[float, dict[str, Any]] | None:
    """The reward and report metadata of a finished verifiers ``Episode``; None when it was not scored.

    The reward is the mean of the traces' ``reward`` (one trace for a single-agent env).
    ``metrics`` has each reward's unweighted score and each metric under its own name (a name
    of several traces: their mean), ``vf_reward``, ``ok``, ``turns`` and ``truncated``.
    """
    traces = list(episode.traces or [])
    if not traces or not all(_scored(t) for t in traces):
        return None
    reward = sum(float(t.reward) for t in traces) / len(traces)
    sums: dict[str, list[float]] = {}
    for t in traces:
        for name, r in (t.rewards or {}).items():
            sums.setdefault(str(name), []).append(float(r.score))
        for name, v in (t.metrics or {}).items():
            if _finite(v):
                sums.setdefault(str(name), []).append(float(v))
    metrics = {k: sum(v) / len(v) for k, v in sums.items()}
    metrics.update({"vf_reward": reward, "ok": float(bool(episode.ok)),
                    "turns": float(sum(t.num_turns for t in traces)),
                    "truncated": float(any(t.is_truncated for t in traces))})
    detail = [{"agent": getattr(t.agent, "name", None),
               "rewards": {str(k): {"score": r.score, "weight": r.weight} for k, r in (t.rewards or {}).items()},
               "metrics": dict(t.metrics or {}), "info": dict(t.info or {}), "stop_condition": t.stop_condition}
              for t in traces]
    env_id = getattr(getattr(episode, "env", None), "id", None)
    meta = {"metrics": metrics, "verifiers": json_safe({"env": env_id, "traces": detail,
                                                         "errors": episode_errors(episode)})}
    return reward, meta


def _key_var(episode_id: str) -> str:
    return KEY_VAR_PREFIX + re.sub(r"[^A-Za-z0-9]", "_", episode_id)


async def run_verifiers_episode(client: Any, env: Any, task: Any, *, task_id: str, eval: bool = False,
                                meta: Mapping[str, Any] | None = None, model: str = "swarm",
                                sampling: Mapping[str, Any] | None = None,
                                timeout_s: float | None = None) -> VerifiersResult:
    """Play one verifiers ``task`` of ``env`` as a swarm episode of ``client``.

    Call it inside ``async with env.serving():`` (or use :func:`run_verifiers_episodes`, which
    does).

    :param client: a :class:`~swarmkit.client.AsyncSwarmClient` (verifiers runs on asyncio).
    :param env: a verifiers ``Env`` (e.g. ``verifiers.v1.load_environment(config)``).
    :param task: one of its tasks (``env.taskset`` yields them).
    :param task_id: the swarm task (episodes of one task are a GRPO group).
    :param eval: a held-out episode (scored, never trained on).
    :param meta: the registration's metadata, passed as it is.
    :param model: the ``model`` of the env's requests.
    :param sampling: the env's sampling settings (``temperature``, ``max_tokens``, ...).
    """
    cm = client.episode(task_id=task_id, eval=eval, timeout_s=timeout_s, meta=dict(meta or {}))
    if not hasattr(cm, "__aenter__"):
        raise TypeError("run_verifiers_episode needs an AsyncSwarmClient (verifiers runs on asyncio), "
                        f"got {type(client).__name__}")
    from verifiers.v1 import EvalClientConfig, ModelContext, SamplingConfig

    async with cm as ep:
        var = _key_var(ep.episode_id)
        os.environ[var] = ep.api_key  # read once, when the env's interception builds this episode's client
        try:
            ctx = ModelContext(model=model, client=EvalClientConfig(base_url=ep.base_url, api_key_var=var),
                               sampling=SamplingConfig(**dict(sampling or {})))
            episode = await env.run_episode(task, ctx)
        finally:
            os.environ.pop(var, None)
        errors = episode_errors(episode)
        scored = episode_report(episode)
        if scored is None:
            answer = await ep.abort("the verifiers env did not score the episode: "
                                    + ("; ".join(errors)[-500:] or "no trace"))
            return VerifiersResult(ep.episode_id, task_id, None, {}, {}, False, errors, dict(answer or {}), episode)
        reward, report_meta = scored
        answer = await ep.report(reward, meta=report_meta)
        rewards = {str(k): float(r.score) for t in episode.traces for k, r in (t.rewards or {}).items()}
        return VerifiersResult(ep.episode_id, task_id, reward, rewards, report_meta["metrics"], bool(episode.ok),
                               errors, dict(answer or {}), episode)


async def run_verifiers_episodes(client: Any, env: Any, tasks: Iterable[Any], *, name: str = "verifiers",
                                 eval: bool = False, repeats: int = 1, concurrency: int = 1,
                                 meta: Mapping[str, Any] | None = None, **kwargs: Any) -> list[VerifiersResult]:
    """Each task ``repeats`` times (one GRPO group of ``repeats`` episodes per task), ``concurrency``
    at a time, inside one ``env.serving()``; task ids are ``{name}-{task id}`` (see :func:`task_key`).

    A held-out split is the same call with ``eval=True`` on tasks of its own (e.g.
    ``env.taskset.take(n)`` to train, ``env.taskset.skip(n)`` to hold out). The env's
    interception keeps one HTTP client per episode key until ``serving()`` ends, so call this
    per batch rather than once for a whole run. ``kwargs`` go to :func:`run_verifiers_episode`.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Any) -> VerifiersResult:
        async with gate:
            return await run_verifiers_episode(
                client, env, task, task_id=f"{name}-{task_key(task)}", eval=eval,
                meta={"task_family": name, **(meta or {}), "task": json_safe(task_meta(task))}, **kwargs)

    plays = [t for t in tasks for _ in range(repeats)]
    async with env.serving():
        return list(await asyncio.gather(*(one(t) for t in plays)))
