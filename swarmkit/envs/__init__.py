"""Environments as swarm episodes (client side; httpx only, like :mod:`swarmkit.client`).

- :mod:`.loop`: a gymnasium-style text environment (``reset() -> (observation, info)``,
  ``step(action) -> (observation, reward, terminated, truncated, info)``) played by the
  swarm's model as a multi-turn chat whose actions are messages or tool calls; its rewards
  and metadata are reported into the episode (:func:`run_env_episode`, :func:`run_env_episodes`).
- :mod:`.openenv`: an OpenEnv ``Environment`` (``openenv-core``) as such a text environment.
- :mod:`.verifiers`: a verifiers ``Env`` (``verifiers`` 0.4.0), which runs its own agent, pointed at a
  swarm episode's endpoint; its rubric's reward is the episode's (:func:`run_verifiers_episodes`).

docs/environments.md shows each with one command.
"""

from swarmkit.envs.loop import Action, EnvResult, TextEnv, run_env_episode, run_env_episodes

__all__ = ["Action", "EnvResult", "TextEnv", "run_env_episode", "run_env_episodes"]
