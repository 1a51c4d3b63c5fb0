"""Batching policies: when the sample pool is ready to train (C1-C5, ...)."""

from __future__ import annotations

from collections.abc import Callable

from swarmkit.hookspecs import hookspec


@hookspec
def register_batching_policies(register: Callable[..., None]) -> None:
    """Register batching policies (kind ``batching``).

    Called once, when the plugin manager first loads plugins.

    :param register: ``register(name, target, schema=None, description="")``;
        ``target`` names a class implementing
        :class:`swarmkit.contract.BatchingPolicy`, built with its config
        (``batch_size``, ``rollouts_per_task`` and its own keys).
    :returns: nothing; every implementation is called.
    """
