"""swarmkit: swarm reinforcement learning for LLM agents.

Importing this package is cheap: it pulls in no torch, no inference engine and
loads no plugin. Plugins are loaded on first use of :func:`swarmkit.plugins.get_registry`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]

from swarmkit.hookspecs import hookimpl  # noqa: E402  (pluggy only; cheap)

__all__ += ["hookimpl"]
