"""An OpenEnv environment (``openenv-core``) as a :class:`~swarmkit.envs.loop.TextEnv`.

OpenEnv environments speak gymnasium with typed (pydantic) actions and observations:
``reset(seed=, episode_id=, **kw) -> Observation`` and ``step(action) -> Observation``, the
observation carrying ``done``, ``reward`` and ``metadata``. A remote one is reached through its
client (``SyncEnvClient``, or an ``EnvClient``'s ``.sync()``), whose ``reset``/``step`` return a
``StepResult`` (``observation``, ``reward``, ``done``). :class:`OpenEnvTextEnv` takes either, and
two functions that are the environment's own business: ``to_action`` (the model's
:class:`~swarmkit.envs.loop.Action` → the environment's Action class) and ``to_text`` (an
observation → what the model reads). The observation's ``metadata`` is the step's ``info``,
passed on unchanged. Nothing here imports OpenEnv: install ``openenv-core`` where the
environment runs (docs/environments.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from swarmkit.envs.loop import Action

#: fields every OpenEnv observation has; the rest is what the model reads by default
_BASE_FIELDS = ("done", "reward", "metadata")


def default_text(observation: Any) -> str:
    """An observation's own fields (not ``done``, ``reward``, ``metadata``): the value of a single
    text field as it is, else the fields as JSON."""
    data = observation.model_dump() if hasattr(observation, "model_dump") else dict(vars(observation))
    own = {k: v for k, v in data.items() if k not in _BASE_FIELDS}
    if len(own) == 1 and isinstance(next(iter(own.values())), str):
        return str(next(iter(own.values())))
    return json.dumps(own, default=str)


class OpenEnvTextEnv:
    """An OpenEnv ``Environment`` (in this process) or environment client as a text environment.

    :param env: the environment, or its synchronous client.
    :param to_action: the model's action → the environment's Action.
    :param to_text: an observation → the model's next message (text, or chat messages); default
        :func:`default_text`.
    :param tools: OpenAI tool specs offered to the model (actions as tool calls).
    :param system_prompt: a system message before the first observation.
    """

    def __init__(self, env: Any, to_action: Callable[[Action], Any], *,
                 to_text: Callable[[Any], Any] = default_text, tools: Sequence[Mapping[str, Any]] | None = None,
                 system_prompt: str | None = None):
        self.env = env
        self.to_action = to_action
        self.to_text = to_text
        self.tools = list(tools or [])
        self.system_prompt = system_prompt

    @staticmethod
    def _unpack(result: Any) -> tuple[Any, float, bool]:
        """(observation, reward, done) of an Observation or a client's StepResult."""
        if hasattr(result, "observation"):  # a client's StepResult
            obs = result.observation
            reward = result.reward if result.reward is not None else getattr(obs, "reward", None)
            return obs, float(reward or 0.0), bool(result.done or getattr(obs, "done", False))
        return result, float(getattr(result, "reward", None) or 0.0), bool(getattr(result, "done", False))

    def reset(self, *, seed: int | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        """``env.reset(seed=seed, **options)``: the observation's text and its metadata."""
        obs, _, _ = self._unpack(self.env.reset(seed=seed, **(options or {})))
        return self.to_text(obs), dict(getattr(obs, "metadata", None) or {})

    def step(self, action: Action) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """``env.step(to_action(action))``: text, reward, done as ``terminated``, never ``truncated``
        (OpenEnv has one ``done``; the loop's ``max_turns`` truncates), metadata."""
        obs, reward, done = self._unpack(self.env.step(self.to_action(action)))
        return self.to_text(obs), reward, done, False, dict(getattr(obs, "metadata", None) or {})

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()
