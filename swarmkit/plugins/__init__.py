"""How plugins are found: entry points of the group ``swarmkit`` fill one registry.

- :mod:`.registry`: :class:`Component` (a named, lazily imported implementation)
  and the :class:`Registry` of them.
- :mod:`.loader`: the pluggy manager, entry-point loading and the typed facade
  over the lifecycle hooks.
- :mod:`.table`: ``python -m swarmkit.plugins`` prints every component.
"""

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
