"""pluggy hookspecs of swarmkit, one module per concern.

Component hooks are ``register_*(register)`` callbacks: the core owns the one
:class:`~swarmkit.plugins.registry.Registry`; a plugin calls ``register(...)`` with a
name, an import string for the heavy class and a config schema. Lifecycle hooks
(:mod:`.lifecycle`) are notifications for loggers and third parties.

Hooks are always called with keyword arguments. pluggy calls implementations
last-registered-first; no hook here gives that order any meaning.
"""

from __future__ import annotations

import pluggy

PROJECT = "swarmkit"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

#: Modules that hold hookspecs, in the order they are added to the manager.
SPEC_MODULES = (
    "swarmkit.hookspecs.backend",
    "swarmkit.hookspecs.optim",
    "swarmkit.hookspecs.algo",
    "swarmkit.hookspecs.match",
    "swarmkit.hookspecs.batching",
    "swarmkit.hookspecs.config",
    "swarmkit.hookspecs.lifecycle",
    "swarmkit.hookspecs.logger",
)

__all__ = ["PROJECT", "SPEC_MODULES", "hookimpl", "hookspec"]
