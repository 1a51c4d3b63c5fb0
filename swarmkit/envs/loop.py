"""A gymnasium-style text environment played as one swarm episode.

The environment speaks the gymnasium API with text: ``reset(seed=, options=)`` returns
``(observation, info)``; ``step(action)`` returns ``(observation, reward, terminated,
truncated, info)``. :func:`run_env_episode` opens an episode on the swarm server, turns the
first observation into the chat's opening messages, and asks the swarm's model for each
action over the episode's OpenAI-compatible endpoint: the model's reply (a message, tool
calls, or both) is the :class:`Action` given to ``step``, and the observation that comes
back is the next message of the chat (a ``tool`` message answering each tool call, else a
``user`` message). The episode ends when the environment says ``terminated`` or
``truncated``, or after ``max_turns`` actions (then ``truncated``); the sum of the step
rewards is reported as the episode's reward.

What flows into the episode, unchanged: ``meta`` (the registration's metadata, e.g. a
dataset row's id or split; ``task_family`` groups metrics on the server), ``eval`` (a
held-out episode is scored, never trained on), and with the report ``meta["metrics"]``
(``env_return``, ``turns``, ``terminated``, ``truncated`` and every numeric entry of the last
``info``) and ``meta["env"]`` (the per-step rewards, the ``info`` of reset and of the last step,
as JSON). Needs only httpx.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx


@dataclass(frozen=True)
class ToolCall:
    """One tool call of the model: its id (answer it with a ``tool`` message), name and arguments
    (the parsed JSON object; the raw string when it is not valid JSON)."""

    id: str
    name: str
    arguments: Any


@dataclass(frozen=True)
class Action:
    """The model's reply at one turn: its text (``""`` when it only called tools) and tool calls."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    #: the assistant message as the server sent it
    message: Mapping[str, Any] = field(default_factory=dict)


class TextEnv(Protocol):
    """A gymnasium-style environment whose observations are text (or chat messages) and whose
    actions are :class:`Action`. It may also have ``tools`` (OpenAI tool specs offered to the model)
    and ``system_prompt``."""

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]: ...

    def step(self, action: Action) -> tuple[Any, float, bool, bool, dict[str, Any]]: ...


@dataclass
class EnvResult:
    """How one environment episode went, and what the server answered to its report."""

    episode_id: str
    task_id: str
    reward: float
    rewards: list[float]
    turns: int
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    messages: list[dict[str, Any]]
    report: dict[str, Any]


def action_of(message: Mapping[str, Any]) -> Action:
    """The :class:`Action` of an OpenAI assistant message."""
    calls = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        raw = fn.get("arguments", "")
        try:
            args = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            args = raw
        calls.append(ToolCall(id=str(c.get("id", "")), name=str(fn.get("name", "")), arguments=args))
    return Action(text=message.get("content") or "", tool_calls=tuple(calls), message=dict(message))


def _is_message(x: Any) -> bool:
    return isinstance(x, Mapping) and "role" in x


def opening_messages(observation: Any, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The chat's first messages: ``system_prompt``, then the reset observation (text: a user message;
    a message or a list of messages: as they are)."""
    out: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if isinstance(observation, str):
        return out + [{"role": "user", "content": observation}]
    if _is_message(observation):
        return out + [dict(observation)]
    if isinstance(observation, list) and observation and all(_is_message(m) for m in observation):
        return out + [dict(m) for m in observation]
    raise TypeError(f"reset() observation: expected text, a chat message or a list of messages, got "
                    f"{type(observation).__name__}")


def observation_messages(observation: Any, action: Action) -> list[dict[str, Any]]:
    """The messages a step's observation adds to the chat.

    After tool calls: text answers a single call; a list of texts answers the calls in order.
    After a plain message: text is the user's next message. A message or a list of messages is
    added as it is, whatever the action.
    """
    if _is_message(observation):
        return [dict(observation)]
    if isinstance(observation, list) and observation and all(_is_message(m) for m in observation):
        return [dict(m) for m in observation]
    calls = action.tool_calls
    if calls:
        texts = [observation] if isinstance(observation, str) else observation
        if not (isinstance(texts, list) and all(isinstance(t, str) for t in texts)) or len(texts) != len(calls):
            raise TypeError(f"step() observation after {len(calls)} tool call(s): expected one text per call "
                            f"(a string for one call, a list of strings for several) or messages, got "
                            f"{type(observation).__name__}")
        return [{"role": "tool", "tool_call_id": c.id, "content": t} for c, t in zip(calls, texts, strict=True)]
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    raise TypeError(f"step() observation: expected text, a chat message or a list of messages, got "
                    f"{type(observation).__name__}")


def json_safe(value: Any) -> Any:
    """``value`` as JSON (what cannot be written becomes its ``str``), for the report's meta."""
    return json.loads(json.dumps(value, default=str))


def numeric_metrics(info: Mapping[str, Any]) -> dict[str, float]:
    """The numeric (and boolean) entries of ``info``, as floats."""
    return {str(k): float(v) for k, v in info.items() if isinstance(v, int | float) and not isinstance(v, str)}


def chat_turn(http: httpx.Client, base_url: str, api_key: str, body: dict[str, Any]) -> dict[str, Any]:
    """One ``POST {base_url}/chat/completions``: the first choice's message (raises on an HTTP error)."""
    resp = http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {api_key}"},
                     json={"model": "swarm", **body})
    resp.raise_for_status()
    return dict(resp.json()["choices"][0]["message"])


def run_env_episode(client: Any, env: TextEnv, *, task_id: str, seed: int | None = None,
                    options: dict[str, Any] | None = None, eval: bool = False,
                    meta: Mapping[str, Any] | None = None, max_turns: int = 8,
                    tools: Sequence[Mapping[str, Any]] | None = None, system_prompt: str | None = None,
                    sampling: Mapping[str, Any] | None = None, http: httpx.Client | None = None,
                    timeout_s: float | None = None) -> EnvResult:
    """Play ``env`` once as a swarm episode of ``client`` (a :class:`~swarmkit.client.SwarmClient`).

    :param task_id: the episode's task (episodes of one task are a GRPO group: give each seed its own).
    :param seed: and ``options``: given to ``env.reset``.
    :param eval: a held-out episode (scored, never trained on).
    :param meta: the registration's metadata, passed as it is.
    :param max_turns: actions at most; an episode cut there is ``truncated``.
    :param tools: OpenAI tool specs offered at every turn (default: ``env.tools``, if any).
    :param system_prompt: a system message before the first observation (default: ``env.system_prompt``).
    :param sampling: more fields of each chat request (``max_tokens``, ``temperature``...).
    :raises TypeError: an observation the chat cannot carry (the episode is aborted).
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    tools = list(tools if tools is not None else getattr(env, "tools", None) or [])
    system_prompt = system_prompt if system_prompt is not None else getattr(env, "system_prompt", None)
    own_http = http is None
    http = http or httpx.Client(timeout=300.0)
    try:
        observation, reset_info = env.reset(seed=seed, options=options)
        messages = opening_messages(observation, system_prompt)
        with client.episode(task_id=task_id, eval=eval, timeout_s=timeout_s, meta=dict(meta or {})) as ep:
            rewards: list[float] = []
            terminated = truncated = False
            info: dict[str, Any] = dict(reset_info or {})
            turns = 0
            while turns < max_turns and not (terminated or truncated):
                body: dict[str, Any] = {"messages": messages, **(sampling or {})}
                if tools:
                    body["tools"] = tools
                reply = chat_turn(http, ep.base_url, ep.api_key, body)
                turns += 1
                action = action_of(reply)
                messages.append({k: v for k, v in reply.items() if v is not None})
                observation, reward, terminated, truncated, step_info = env.step(action)
                rewards.append(float(reward))
                info = dict(step_info or {})
                if not (terminated or truncated):
                    messages += observation_messages(observation, action)
            if not (terminated or truncated):
                truncated = True
            total = float(sum(rewards))
            metrics = {**numeric_metrics(info), "env_return": total, "turns": float(turns),
                       "terminated": float(terminated), "truncated": float(truncated)}
            answer = ep.report(total, meta={"metrics": metrics, "env": json_safe(
                {"rewards": rewards, "reset_info": reset_info or {}, "info": info})})
            return EnvResult(episode_id=ep.episode_id, task_id=task_id, reward=total, rewards=rewards, turns=turns,
                             terminated=bool(terminated), truncated=bool(truncated), info=info, messages=messages,
                             report=dict(answer or {}))
    finally:
        if own_http:
            http.close()


def run_env_episodes(client: Any, make_env: Callable[[], TextEnv], seeds: Iterable[int], *, name: str = "env",
                     eval: bool = False, concurrency: int = 1, meta: Mapping[str, Any] | None = None,
                     **kwargs: Any) -> list[EnvResult]:
    """One episode per seed, ``concurrency`` at a time, each on a fresh ``make_env()``; task ids are
    ``{name}-{seed}``. A held-out split is the same call with ``eval=True`` and seeds of its own.
    ``kwargs`` go to :func:`run_env_episode`."""
    def one(seed: int) -> EnvResult:
        return run_env_episode(client, make_env(), task_id=f"{name}-{seed}", seed=seed, eval=eval,
                               meta={"task_family": name, **(meta or {}), "seed": seed}, **kwargs)

    seeds = list(seeds)
    if concurrency <= 1:
        return [one(s) for s in seeds]
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, seeds))
