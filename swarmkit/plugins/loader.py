"""Plugin loading: entry points of the group ``swarmkit`` fill one registry.

Built-in plugins (``swarmkit_plugins.*``) are found through the very same entry
points as a third-party package. Loading is lazy (first call of
:func:`get_registry`), idempotent, runs ``check_pending()`` so a misspelled
hook implementation is an error, and never imports heavy engines: plugins
register import strings, not classes.

Environment switches:

``SWARMKIT_DISABLE_PLUGIN_AUTOLOAD=1``
    load only the plugins that the ``swarmkit`` distribution itself ships.
``SWARMKIT_BLOCK_PLUGINS=name1,name2``
    skip these entry points (by entry-point name) or distributions.

Run ``python -m swarmkit.plugins`` for the table of every component
(:mod:`swarmkit.plugins.table`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from swarmkit.errors import DuplicateComponentError, PluginLoadError
from swarmkit.hookspecs import PROJECT, SPEC_MODULES
from swarmkit.plugins.registry import Component, Registry

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "swarmkit"
CORE_DISTRIBUTION = "swarmkit"
ENV_DISABLE_AUTOLOAD = "SWARMKIT_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "SWARMKIT_BLOCK_PLUGINS"

_REGISTER_HOOKS = {
    "backend": "register_backends",
    "optim": "register_optims",
    "algo": "register_algos",
    "match": "register_match_strategies",
    "batching": "register_batching_policies",
}

_lock = threading.Lock()
_state: PluginState | None = None


def _blocked_names() -> set[str]:
    raw = os.environ.get(ENV_BLOCK, "")
    return {n.strip() for n in raw.split(",") if n.strip()}


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _distribution_label(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ""
    return f"{dist.metadata['Name']} {dist.version}"


def _distribution_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else ""


def new_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager with every swarmkit hookspec added and no plugin loaded."""
    pm = pluggy.PluginManager(PROJECT)
    for mod in SPEC_MODULES:
        pm.add_hookspecs(import_module(mod))
    return pm


class PluginState:
    """A loaded plugin manager and the registry its plugins filled."""

    def __init__(self, pm: pluggy.PluginManager, registry: Registry, sources: dict[str, str]):
        self.pm = pm
        self.registry = registry
        #: plugin name -> distribution label, for the table and error messages
        self.sources = sources
        self.hooks = PluginHooks(pm)


def build_state(
    entry_points_: Iterable[EntryPoint] | None = None,
    extra_plugins: Iterable[tuple[str, Any]] = (),
) -> PluginState:
    """Load plugins from entry points (plus ``extra_plugins``) into a fresh state.

    :param entry_points_: entry points to load; default: the installed group
        ``swarmkit``, filtered by the environment switches.
    :param extra_plugins: ``(name, module_or_object)`` pairs registered directly
        (tests, embedding applications).
    :raises PluginLoadError: a plugin failed to import, has an unknown hook, or
        raised while registering; the message names it.
    :raises DuplicateComponentError: two plugins registered the same kind/name.
    """
    pm = new_plugin_manager()
    sources: dict[str, str] = {}
    blocked = _blocked_names()
    only_core = _truthy(os.environ.get(ENV_DISABLE_AUTOLOAD))
    if entry_points_ is None:
        entry_points_ = entry_points(group=ENTRY_POINT_GROUP)
    seen: set[str] = set()
    for ep in sorted(entry_points_, key=lambda e: e.name):
        dist_name = _distribution_name(ep)
        if ep.name in blocked or (dist_name and dist_name in blocked):
            log.debug("plugin %s blocked by %s", ep.name, ENV_BLOCK)
            continue
        if only_core and dist_name != CORE_DISTRIBUTION:
            continue
        if ep.name in seen:  # the same distribution seen twice on sys.path
            continue
        seen.add(ep.name)
        label = _distribution_label(ep)
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - any failure is reported by name
            raise PluginLoadError(
                f"plugin '{ep.name}' ({label or ep.value}) failed to load: "
                f"{type(exc).__name__}: {exc}. Fix or uninstall it, or skip it with "
                f"{ENV_BLOCK}={ep.name}"
            ) from exc
        _register(pm, ep.name, plugin)
        sources[ep.name] = label
    for name, plugin in extra_plugins:
        _register(pm, name, plugin)
        sources[name] = "(registered directly)"
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin) or repr(exc.plugin)
        raise PluginLoadError(f"plugin '{name}' is invalid: {exc}") from exc
    registry = Registry()
    for kind, hook_name in _REGISTER_HOOKS.items():
        _collect(pm, registry, kind, hook_name, sources)
    return PluginState(pm, registry, sources)


def _register(pm: pluggy.PluginManager, name: str, plugin: Any) -> None:
    try:
        pm.register(plugin, name=name)
    except (ValueError, pluggy.PluginValidationError) as exc:
        raise PluginLoadError(f"plugin '{name}' could not be registered: {exc}") from exc


def _collect(
    pm: pluggy.PluginManager, registry: Registry, kind: str, hook_name: str, sources: dict[str, str]
) -> None:
    """Call ``hook_name`` on each plugin separately so components know their plugin."""
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():
        plugin_name = pm.get_name(impl.plugin) or "?"

        def register(
            name: str,
            target: str,
            schema: type | None = None,
            requires: Iterable[str] = (),
            extra: str | None = None,
            description: str = "",
            experimental: bool = False,
            _plugin: str = plugin_name,
        ) -> None:
            registry.add(
                Component(
                    kind=kind,
                    name=name,
                    target=target,
                    schema=schema,
                    requires=tuple(requires),
                    extra=extra,
                    description=description,
                    experimental=bool(experimental),
                    plugin=_plugin,
                    distribution=sources.get(_plugin, ""),
                )
            )

        try:
            impl.function(register=register)
        except DuplicateComponentError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise PluginLoadError(
                f"plugin '{plugin_name}' failed in {hook_name}: {type(exc).__name__}: {exc}"
            ) from exc


def get_state() -> PluginState:
    """The process-wide plugin state, loaded on first call (thread-safe, idempotent)."""
    global _state
    with _lock:
        if _state is None:
            _state = build_state()
        return _state


def get_registry() -> Registry:
    """The process-wide component registry (loads plugins on first call)."""
    return get_state().registry


def get_hooks() -> PluginHooks:
    """The typed facade over the lifecycle hooks."""
    return get_state().hooks


def reset() -> None:
    """Forget the loaded plugins; the next :func:`get_registry` loads again (tests)."""
    global _state
    with _lock:
        _state = None


@dataclass(frozen=True)
class LoggerInfo:
    """A logger a plugin declared (see :mod:`swarmkit.hookspecs.logger`)."""

    name: str
    description: str
    requires: str | None
    extra: str | None
    plugin: str

    def missing(self) -> str | None:
        """Why it cannot run here (its module is not importable), or None."""
        import importlib.util

        if self.requires and importlib.util.find_spec(self.requires) is None:
            hint = f"pip install 'swarmkit[{self.extra}]'" if self.extra else f"pip install {self.requires}"
            return f"logger '{self.name}' needs the {self.requires} package: {hint}"
        return None


class PluginHooks:
    """Typed facade over the notification hooks; a raising hook is logged and skipped."""

    def __init__(self, pm: pluggy.PluginManager):
        self._pm = pm

    def _notify(self, hook_name: str, **kwargs: Any) -> None:
        hook = getattr(self._pm.hook, hook_name)
        for impl in reversed(hook.get_hookimpls()):
            try:
                impl.function(**{k: kwargs[k] for k in impl.argnames})
            except Exception:  # noqa: BLE001 - a broken logger must not stop training
                log.exception("plugin %s raised in %s", impl.plugin_name, hook_name)

    def run_start(self, config: dict[str, Any], run_dir: str) -> None:
        self._notify("on_run_start", config=config, run_dir=run_dir)

    def run_end(self, summary: dict[str, Any], run_dir: str = "") -> None:
        self._notify("on_run_end", summary=summary, run_dir=run_dir)

    def step_end(self, step: int, metrics: dict[str, float], run_dir: str = "",
                 trajectories: list[dict[str, Any]] | None = None) -> None:
        self._notify("on_step_end", step=step, metrics=metrics, run_dir=run_dir, trajectories=trajectories or [])

    def loggers(self) -> dict[str, LoggerInfo]:
        """Every registered logger by name."""
        out: dict[str, LoggerInfo] = {}
        for impl in self._pm.hook.register_loggers.get_hookimpls():
            def register(name: str, description: str = "", requires: str | None = None,
                         extra: str | None = None, _plugin: str = impl.plugin_name) -> None:
                out[name] = LoggerInfo(name, description, requires, extra, _plugin)
            impl.function(register=register)
        return out

    def weights_synced(self, step: int, seconds: float) -> None:
        self._notify("on_weights_synced", step=step, seconds=seconds)

    def episode_finished(self, episode: dict[str, Any]) -> None:
        self._notify("on_episode_finished", episode=episode)

    def config_search_paths(self) -> list[str]:
        paths: list[str] = []
        for result in self._pm.hook.config_search_paths():
            paths.extend(result or [])
        return paths


def load_component(kind: str, name: str) -> Any:
    """Look up ``kind``/``name`` and import its implementation."""
    return get_registry().get(kind, name).load()
