"""RL algorithms: advantage estimation and policy/value losses."""

from __future__ import annotations

from collections.abc import Callable

from swarmkit.hookspecs import hookspec


@hookspec
def register_algos(register: Callable[..., None]) -> None:
    """Register RL algorithms (kind ``algo``), e.g. GRPO and PPO.

    Called once, when the plugin manager first loads plugins.

    :param register: ``register(name, target, schema=None, requires=(), extra=None,
        description="", experimental=False)``; ``target`` names a class implementing
        :class:`swarmkit.contract.Algorithm`. The maths behind it should be
        pure functions over tensors so they can be tested on their own.
    :returns: nothing; every implementation is called.
    """
