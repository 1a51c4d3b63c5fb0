"""Match strategies: when two timeline blocks count as the same for merging."""

from __future__ import annotations

from collections.abc import Callable

from swarmkit.hookspecs import hookspec


@hookspec
def register_match_strategies(register: Callable[..., None]) -> None:
    """Register block match strategies (kind ``match``) used by timeline merging.

    Called once, when the plugin manager first loads plugins.

    :param register: ``register(name, target, schema=None, description="")``;
        ``target`` names an object implementing
        :class:`swarmkit.contract.MatchStrategy`: ``key(block)`` returns a
        hashable key, and two blocks match exactly when their keys are equal
        (this is what lets merging run near-linearly with hashing).
    :returns: nothing; every implementation is called.
    """
