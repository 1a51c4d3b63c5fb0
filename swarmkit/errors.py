"""Exceptions shared by the core and the plugins.

Every error a user can trigger says what went wrong and what to do instead.
"""

from __future__ import annotations


class SwarmkitError(Exception):
    """Base class of swarmkit's own errors."""


class PluginLoadError(SwarmkitError):
    """A plugin (entry point) failed to import or to register its components."""


class DuplicateComponentError(SwarmkitError):
    """Two plugins registered a component of the same kind under the same name."""


class UnknownComponentError(SwarmkitError, KeyError):
    """A component name that no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class MissingDependencyError(SwarmkitError, ImportError):
    """A component was selected whose heavy dependency is not installed."""


class ConfigError(SwarmkitError, ValueError):
    """A configuration failed validation; the message lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")
