"""Every config key a component reads is a field of its schema (one source per default).

Components build their typed config once (``self.cfg = Schema(**group)``,
``self.model = ModelConfig.of(model)``) and read attributes of it. This test
reads the source of every built-in component class (static: GPU- and
vLLM-only paths count too) and checks that each ``self.cfg.<key>`` /
``self.model.<key>`` it reads is a field of the schema, and that no component
reads a raw config dict with ``.get("key", default)`` (a second default).
The core's modules are held to the same: none reads a key of a component
group (``optim``, ``model``, ``algo``, ``backend``) with a default of its own.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from pathlib import Path

import pytest

from swarmkit.config.schema import ModelConfig
from swarmkit.plugins import get_registry

#: names a component keeps its raw config groups under (must never be read with .get/[...])
RAW = {"config", "cfg", "optim_cfg", "model_cfg", "algo_cfg", "options", "backend_cfg"}


def component_classes():
    for c in get_registry():
        if c.schema is None or c.kind == "match":
            continue
        module_name, _, attr = c.target.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except ImportError:  # an engine whose heavy module is missing: read its source anyway
            spec = importlib.util.find_spec(module_name)
            if spec is None or spec.origin is None:
                continue
            tree = ast.parse(open(spec.origin).read())
            yield c, None, tree
            continue
        yield c, cls, None


def class_trees(cls, tree):
    """The ASTs of ``cls`` and its swarmkit base classes (or every class of an unimportable module)."""
    if cls is None:
        return [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    out = []
    for k in cls.__mro__:
        if k.__module__.startswith(("swarmkit", "swarmkit_plugins")) and k.__module__ != "swarmkit.contract.backend":
            out.append(ast.parse(textwrap.dedent(inspect.getsource(k))))
    return out


def reads(trees, holder):
    """Attribute names read as ``self.<holder>.<name>``."""
    found = set()
    for t in trees:
        for n in ast.walk(t):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
                    and isinstance(n.value.value, ast.Name) and n.value.value.id == "self" and n.value.attr == holder):
                found.add(n.attr)
    return found


def raw_reads(trees):
    """``<raw>.get("key")`` and ``<raw>["key"]`` on a config-group dict."""
    bad = []
    for t in trees:
        for n in ast.walk(t):
            target = None
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args \
                    and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
                target, key = n.func.value, n.args[0].value
            elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
                target, key = n.value, n.slice.value
            if target is None:
                continue
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
            if name in RAW:
                bad.append(f"{name}[{key!r}]")
    return bad


@pytest.mark.parametrize("item", list(component_classes()), ids=lambda it: f"{it[0].kind}-{it[0].name}")
def test_a_component_reads_only_fields_of_its_schema(item):
    component, cls, tree = item
    trees = class_trees(cls, tree)
    fields = {f.name for f in dataclasses.fields(component.schema)}
    unknown = sorted(reads(trees, "cfg") - fields - {"__class__"})
    assert not unknown, f"{component.kind} '{component.name}' reads {unknown}, not fields of {component.schema.__name__}"
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    model_fields |= {n for n in vars(ModelConfig) if not n.startswith("_") and callable(getattr(ModelConfig, n))}
    unknown_model = sorted((reads(trees, "model") | reads(trees, "model_cfg")) - model_fields)
    assert not unknown_model, f"{component.kind} '{component.name}' reads model.{unknown_model}, not in ModelConfig"
    assert not raw_reads(trees), f"{component.kind} '{component.name}' reads raw config dicts: {raw_reads(trees)}"


# ---------------------------------------------------------------- the core reads component groups through their schemas
#: names the core keeps a component's config group under (``optim_cfg``, ``self.model_cfg``, ``cfg.optim``, ...)
CORE_GROUP_NAMES = {"optim", "optim_cfg", "model", "model_cfg", "algo", "algo_cfg", "backend", "backend_cfg"}
#: the key that picks the plugin: read before any schema is known
SELECTOR = "name"
CORE_ROOT = Path(__file__).resolve().parents[1] / "swarmkit"


def defaulted_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, text)`` of every read of a component group key with a default of its own:
    ``<group>.get("key", default)`` and ``<group>.get("key") or default``."""
    or_operands = {id(v) for n in ast.walk(tree) if isinstance(n, ast.BoolOp) and isinstance(n.op, ast.Or)
                   for v in n.values[:-1]}
    bad = []
    for n in ast.walk(tree):
        if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get" and n.args
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
            continue
        target = n.func.value
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        key = n.args[0].value
        if name not in CORE_GROUP_NAMES or key == SELECTOR:
            continue
        if len(n.args) > 1 or n.keywords or id(n) in or_operands:
            bad.append((n.lineno, ast.unparse(n)))
    return bad


def core_defaulted_reads(root: Path = CORE_ROOT) -> list[str]:
    """Every such read in the core's modules under ``root``, as ``path:line: text``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for line, text in defaulted_reads(ast.parse(path.read_text(), filename=str(path))):
            out.append(f"{path.relative_to(root.parent)}:{line}: {text}")
    return out


def test_the_core_reads_component_groups_without_second_defaults():
    """A key of ``optim`` / ``model`` / ``algo`` / ``backend`` that the core reads comes from the typed
    object (``launch_config(optim)``, ``ModelConfig.of(model)``, ``schema(**group)``), whose dataclass
    holds the only default: never ``group.get("key", default)`` or ``group.get("key") or default``."""
    bad = core_defaulted_reads()
    assert not bad, "the core reads component config keys with defaults of its own:\n" + "\n".join(bad)


def test_the_rule_sees_a_second_default():
    tree = ast.parse('n = int(self.optim_cfg.get("nnodes") or 1)\nh = optim.get("group_host", "127.0.0.1")\n'
                     'p = cfg.optim.get("nprocs", 1)\nok = optim_cfg.get("name") or ""\nseed = optim_cfg.get("seed")\n')
    assert sorted(line for line, _ in defaulted_reads(tree)) == [1, 2, 3]
