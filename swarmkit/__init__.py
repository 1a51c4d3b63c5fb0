"""swarmkit: swarm reinforcement learning for LLM agents.

Importing this package is cheap and needs nothing but the standard library:
``swarmkit.client`` must run on a laptop with only httpx installed. Plugins
are loaded on first use of :func:`swarmkit.plugins.get_registry`.
"""

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "hookimpl"]


def __getattr__(name: str) -> Any:
    # ``from swarmkit import hookimpl`` for plugin authors, without importing
    # pluggy for clients that never need it.
    if name == "hookimpl":
        from swarmkit.hookspecs import hookimpl

        return hookimpl
    raise AttributeError(f"module 'swarmkit' has no attribute {name!r}")
