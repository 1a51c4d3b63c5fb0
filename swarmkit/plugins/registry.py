"""The one registry of named components that plugins fill.

A component is registered by *import string* (``"package.module:Attr"``), so a
plugin that offers a vLLM backend can be loaded, listed and validated without
importing vLLM. The heavy object is imported only by :meth:`Component.load`.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from swarmkit.contract import CONTRACTS, check_implementation
from swarmkit.errors import DuplicateComponentError, MissingDependencyError, UnknownComponentError

#: The five kinds of pluggable component. Each is also a Hydra config group.
KINDS: tuple[str, ...] = tuple(CONTRACTS)


@dataclass(frozen=True)
class Component:
    """A named, lazily imported implementation of one kind.

    :param kind: one of :data:`KINDS`.
    :param name: the name users select it by (``backend=vllm``).
    :param target: import string ``"module:attr"`` of the implementation.
    :param schema: dataclass type that types and validates its config group.
    :param requires: top-level modules the implementation needs (``("vllm",)``);
        used to report availability without importing them.
    :param extra: the pip extra that installs ``requires`` (``"vllm"``).
    :param description: one line for the plugin table.
    :param experimental: shown as such in the table and warned about when it starts
        (e.g. it has only run against a stand-in of its engine).
    :param plugin: name of the providing plugin; filled in by the registry.
    :param distribution: ``name version`` of the providing distribution.
    """

    kind: str
    name: str
    target: str
    schema: type | None = None
    requires: tuple[str, ...] = ()
    extra: str | None = None
    description: str = ""
    experimental: bool = False
    plugin: str = ""
    distribution: str = ""

    def missing_requirements(self) -> list[str]:
        """Modules in ``requires`` that cannot be found (checked without importing them)."""
        missing = []
        for mod in self.requires:
            try:
                if importlib.util.find_spec(mod) is None:
                    missing.append(mod)
            except (ImportError, ValueError):
                missing.append(mod)
        return missing

    @property
    def available(self) -> bool:
        return not self.missing_requirements()

    def install_hint(self) -> str:
        if self.extra:
            return f"pip install 'swarmkit[{self.extra}]'"
        return "pip install " + " ".join(self.requires)

    def load(self) -> Any:
        """Import and return the implementation object named by ``target``, checked against its contract.

        :raises MissingDependencyError: a module in ``requires`` is missing; the
            message names the extra to install.
        :raises TypeError: the object misses part of its kind's contract
            (:func:`swarmkit.contract.check_implementation`); the message names it.
        """
        missing = self.missing_requirements()
        if missing:
            raise MissingDependencyError(
                f"{self.kind} '{self.name}' needs {', '.join(missing)}, which is not installed: "
                f"{self.install_hint()}"
            )
        module_name, _, attr = self.target.partition(":")
        module = importlib.import_module(module_name)
        obj: Any = module
        for part in filter(None, attr.split(".")):
            obj = getattr(obj, part)
        check_implementation(self.kind, obj, self.name)
        return obj


@dataclass
class Registry:
    """Components by kind and name. Built once by the plugin manager."""

    _components: dict[tuple[str, str], Component] = field(default_factory=dict)

    def add(self, component: Component) -> None:
        if component.kind not in KINDS:
            raise ValueError(
                f"plugin '{component.plugin}' registered unknown kind '{component.kind}'; "
                f"kinds are {', '.join(KINDS)}"
            )
        key = (component.kind, component.name)
        if key in self._components:
            other = self._components[key]
            raise DuplicateComponentError(
                f"{component.kind} '{component.name}' is registered twice: by plugin "
                f"'{other.plugin}' ({other.distribution or 'unknown distribution'}) and by plugin "
                f"'{component.plugin}' ({component.distribution or 'unknown distribution'}); "
                "uninstall one or block it with SWARMKIT_BLOCK_PLUGINS"
            )
        self._components[key] = component

    def get(self, kind: str, name: str) -> Component:
        try:
            return self._components[(kind, name)]
        except KeyError:
            options = self.names(kind)
            raise UnknownComponentError(
                f"unknown {kind} '{name}'; installed {kind} options: "
                f"{', '.join(options) if options else '(none)'}"
            ) from None

    def names(self, kind: str) -> list[str]:
        return sorted(n for (k, n) in self._components if k == kind)

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self._components

    def __iter__(self) -> Iterator[Component]:
        return iter(sorted(self._components.values(), key=lambda c: (KINDS.index(c.kind), c.name)))

    def __len__(self) -> int:
        return len(self._components)
