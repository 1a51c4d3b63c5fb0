"""Every config key a component reads is a field of its schema (one source per default).

Components build their typed config once (``self.cfg = Schema(**group)``,
``self.model = ModelConfig(**model)``) and read attributes of it. This test
reads the source of every built-in component class (static: GPU- and
vLLM-only paths count too) and checks that each ``self.cfg.<key>`` /
``self.model.<key>`` it reads is a field of the schema, and that no component
reads a raw config dict with ``.get("key", default)`` (a second default).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap

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
    unknown_model = sorted((reads(trees, "model") | reads(trees, "model_cfg")) - model_fields)
    assert not unknown_model, f"{component.kind} '{component.name}' reads model.{unknown_model}, not in ModelConfig"
    assert not raw_reads(trees), f"{component.kind} '{component.name}' reads raw config dicts: {raw_reads(trees)}"
