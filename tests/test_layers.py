"""The import graph keeps the layers of docs/architecture.md.

Read from the source (AST), never by importing it: every ``import`` and
``from ... import`` of a project module, at any depth (inside functions and
``TYPE_CHECKING`` blocks too), is an edge. The test fails on an edge that runs
against the layer order, on any core module that imports a built-in plugin,
on a plugin that imports another plugin or the core's upper layers, and on
any import cycle, between modules or between packages.

The multirun launcher (``hydra_plugins/swarmkit_launcher``: Hydra only finds
launchers under ``hydra_plugins``) is scanned with the core and ranked like
one of its packages, just below ``swarmkit.apps``: the command line registers
it, and it uses only the bottom layer (processes, run files), so nothing under
``apps`` may import it and a loop through it is an upward edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"swarmkit": ROOT / "swarmkit", "swarmkit_plugins": ROOT / "plugins", "hydra_plugins": ROOT / "hydra_plugins"}
#: the top-level names of the core: the swarmkit package and its Hydra launcher
CORE_TOPS = ("swarmkit", "hydra_plugins")

#: the core's packages, bottom first: a module may import its own package and any lower rank
RANKS: dict[str, int] = {
    "swarmkit.errors": 0,
    "swarmkit.chat_templates": 0,
    "swarmkit.runfiles": 0,
    "swarmkit.procs": 0,
    "swarmkit.weights": 1,
    "swarmkit.models": 1,
    "swarmkit.contract": 1,
    "swarmkit.hookspecs": 1,
    "swarmkit.plugins": 2,
    "swarmkit.config": 3,
    "swarmkit.timelines": 3,
    "swarmkit.pool": 4,
    "swarmkit.training": 5,
    "swarmkit.swarm": 6,
    "swarmkit.server": 7,
    "swarmkit.research": 7,
    "swarmkit.skills": 0,
    "swarmkit.client": 4,
    "swarmkit.tasks": 4,
    "swarmkit.envs": 4,
    "hydra_plugins.swarmkit_launcher": 7,
    "swarmkit.apps": 8,
    "swarmkit.testing": 9,
}
#: re-export shims of old import paths (kept for one release); nothing in the tree may import them
SHIMS = {"swarmkit.interfaces", "swarmkit.trainer"}
#: all the light client SDK may import from the core (pure Python: a laptop with httpx runs it)
CLIENT_MAY_IMPORT = ("swarmkit.errors", "swarmkit.timelines", "swarmkit.runfiles")
#: what a built-in plugin may import from the core
PLUGIN_MAY_IMPORT = ("swarmkit.errors", "swarmkit.chat_templates", "swarmkit.models", "swarmkit.contract", "swarmkit.hookspecs", "swarmkit.config.schema",
                     "swarmkit.training", "swarmkit.timelines", "swarmkit.weights", "swarmkit.procs",
                     # the scripted test model, which the ``scripted`` backend serves from a script file
                     "swarmkit.testing.scripted")


def module_name(path: Path) -> str:
    for top, root in SOURCES.items():
        if root in path.parents:
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([top, *parts])
    raise ValueError(path)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for root in SOURCES.values() for p in root.rglob("*.py")}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (resolved to the longest existing module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            parts = t.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts:
                out.add(".".join(parts))
    out.discard(name)
    return out


def package_of(module: str) -> str | None:
    """The ranked package a core module belongs to (None for the package root and entry points)."""
    for pkg in sorted(RANKS, key=len, reverse=True):
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return None


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_every_core_module_has_a_layer(graph):
    loose = [m for m in graph if m.split(".")[0] in CORE_TOPS and "." in m and package_of(m) is None
             and m not in SHIMS and m != "swarmkit.__main__"]
    assert not loose, f"core modules outside every layer (add them to a package of RANKS): {loose}"


def test_core_never_imports_a_plugin(graph):
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.split(".")[0] in CORE_TOPS
                 for d in deps if d.startswith("swarmkit_plugins"))
    assert not bad, "the core imports built-in plugins:\n" + "\n".join(bad)


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """The edges of ``graph`` that import an old-path shim, or a package of the same or a higher rank."""
    bad = []
    for m, deps in graph.items():
        src = package_of(m)
        if src is None:
            continue
        for d in deps:
            if d in SHIMS:
                bad.append(f"{m} -> {d} (an old-path shim)")
                continue
            dst = package_of(d)
            if dst is None or dst == src:
                continue
            if RANKS[dst] >= RANKS[src]:
                bad.append(f"{m} ({src}, rank {RANKS[src]}) -> {d} ({dst}, rank {RANKS[dst]})")
    return sorted(bad)


def test_core_imports_run_down_the_layers(graph):
    bad = layer_violations(graph)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_plugins_import_only_the_plugin_facing_core_and_no_other_plugin(graph):
    bad = []
    for m, deps in graph.items():
        if not m.startswith("swarmkit_plugins."):
            continue
        own = ".".join(m.split(".")[:2])
        for d in deps:
            if d.startswith("swarmkit_plugins."):
                if not (d == own or d.startswith(own + ".")):
                    bad.append(f"{m} -> {d} (another plugin)")
            elif d != "swarmkit" and not d.startswith(PLUGIN_MAY_IMPORT):
                bad.append(f"{m} -> {d} (not plugin-facing)")
    assert not bad, "plugin imports out of bounds:\n" + "\n".join(sorted(bad))


def test_the_client_sdk_imports_only_pure_python_core_modules(graph):
    bad = sorted(f"{m} -> {d}" for m, deps in graph.items() if m.startswith(("swarmkit.client", "swarmkit.tasks", "swarmkit.envs"))
                 for d in deps if package_of(d) not in (None, "swarmkit.client", "swarmkit.tasks", "swarmkit.envs")
                 and not d.startswith(CLIENT_MAY_IMPORT))
    assert not bad, "the client SDK or the client-side tasks import server-side modules:\n" + "\n".join(bad)


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with every module replaced by its ranked package (a module of none stays itself)."""
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        src = package_of(m) or m
        out.setdefault(src, set()).update(package_of(d) or d for d in deps)
        out[src].discard(src)
    return out


def test_no_import_cycles(graph):
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_cycles_between_packages(graph):
    """Importing ``a.b.x`` runs ``a.b``'s ``__init__`` too, so a loop of packages is one even when no module
    loop closes (config -> hydra_plugins -> research -> swarm -> config was one)."""
    cycles = find_cycles(package_graph(graph))
    assert not cycles, "import cycles between packages:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_launcher_plugin_is_in_the_graph(graph):
    launcher = "hydra_plugins.swarmkit_launcher.subprocess_launcher"
    assert package_of(launcher) == "hydra_plugins.swarmkit_launcher"
    assert {"swarmkit.procs", "swarmkit.runfiles"} <= graph[launcher]
    assert launcher in graph["swarmkit.apps.cli"]  # the command line registers it


def test_the_checker_sees_a_cycle_and_an_upward_edge(graph):
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert package_of("swarmkit.server.routes.chat") == "swarmkit.server"
    assert RANKS["swarmkit.server"] > RANKS["swarmkit.swarm"] > RANKS["swarmkit.training"]
    # the loop of issue 33: config -> the launcher -> research (its old home of the process helpers)
    old = {m: set(deps) for m, deps in graph.items()}
    old["swarmkit.config.compose"].add("hydra_plugins.swarmkit_launcher.subprocess_launcher")
    old["hydra_plugins.swarmkit_launcher.subprocess_launcher"].add("swarmkit.research.executor")
    assert any("swarmkit.config.compose (swarmkit.config, rank 3) -> hydra_plugins" in e for e in layer_violations(old))
    assert any({"swarmkit.config", "hydra_plugins.swarmkit_launcher", "swarmkit.research"} <= set(c)
               for c in find_cycles(package_graph(old)))
