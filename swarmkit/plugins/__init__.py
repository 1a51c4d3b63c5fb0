"""How plugins are found: entry points of the group ``swarmkit`` fill one registry.

- :mod:`.registry`: :class:`Component` (a named, lazily imported implementation)
  and the :class:`Registry` of them.
- :mod:`.loader`: the pluggy manager, entry-point loading and the typed facade
  over the lifecycle hooks.
- :mod:`.table`: ``python -m swarmkit.plugins`` prints every component.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported lazily below: a light install (no pluggy) can still run ``-m swarmkit.plugins``
    from swarmkit.plugins.loader import (
        ENTRY_POINT_GROUP,
        ENV_BLOCK,
        ENV_DISABLE_AUTOLOAD,
        PluginHooks,
        PluginState,
        build_state,
        get_hooks,
        get_registry,
        get_state,
        load_component,
        new_plugin_manager,
        reset,
    )
    from swarmkit.plugins.registry import KINDS, Component, Registry

_HOME = {name: "registry" for name in ("KINDS", "Component", "Registry")}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'swarmkit.plugins' has no attribute {name!r}")
    return getattr(importlib.import_module(f"swarmkit.plugins.{_HOME.get(name, 'loader')}"), name)


__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_BLOCK",
    "ENV_DISABLE_AUTOLOAD",
    "KINDS",
    "Component",
    "PluginHooks",
    "PluginState",
    "Registry",
    "build_state",
    "get_hooks",
    "get_registry",
    "get_state",
    "load_component",
    "new_plugin_manager",
    "reset",
]
