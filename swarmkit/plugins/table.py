"""The component table: ``python -m swarmkit.plugins [--json]``."""

from __future__ import annotations

import json
import sys
from typing import Any

from swarmkit.errors import PluginLoadError
from swarmkit.plugins.loader import get_hooks, get_registry
from swarmkit.plugins.registry import Registry


def component_rows(registry: Registry) -> list[dict[str, str]]:
    """One row per component: kind, name, plugin, distribution, availability."""
    rows = []
    for c in registry:
        missing = c.missing_requirements()
        rows.append(
            {
                "kind": c.kind,
                "name": c.name,
                "plugin": c.plugin,
                "distribution": c.distribution,
                "available": "yes" if not missing else f"no ({c.install_hint()})",
                "description": ("[experimental] " if c.experimental else "") + c.description,
            }
        )
    for info in sorted(get_hooks().loggers().values(), key=lambda i: i.name):
        why = info.missing()
        rows.append({"kind": "logger", "name": info.name, "plugin": info.plugin, "distribution": "",
                     "available": "yes" if why is None else f"no ({why.split(': ', 1)[-1]})",
                     "description": info.description})
    return rows


def print_table(registry: Registry, file: Any = None) -> None:
    """Print the component table with rich (plain text when not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="swarmkit components")
    for col in ("kind", "name", "plugin", "distribution", "available", "description"):
        table.add_column(col)
    from rich.markup import escape

    for row in component_rows(registry):
        table.add_row(*(escape(v) for v in row.values()))
    Console(file=file or sys.stdout, width=160).print(table)


def main(argv: list[str] | None = None) -> int:
    """``python -m swarmkit.plugins [--json]``."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        registry = get_registry()
    except PluginLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if "--json" in argv:
        print(json.dumps(component_rows(registry), indent=2))
    else:
        print_table(registry)
    return 0
