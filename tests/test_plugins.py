"""Plugin loading: entry points, laziness, blocking, duplicates, broken plugins."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib.metadata import EntryPoint, distributions

import pytest

from swarmkit import hookimpl
from swarmkit.errors import (
    DuplicateComponentError,
    MissingDependencyError,
    PluginLoadError,
    UnknownComponentError,
)
from swarmkit.plugins import build_state, get_registry
from swarmkit.plugins.registry import Component

EXPECTED = {
    "backend": {"hf", "vllm", "sglang"},
    "optim": {"fsdp", "deepspeed"},
    "algo": {"grpo", "ppo"},
    "match": {"token", "text"},
    "batching": {"c1", "c2", "c3", "c4", "c5"},
}


def test_builtin_plugins_register_every_component(fresh_plugins):
    registry = get_registry()
    for kind, names in EXPECTED.items():
        assert names <= set(registry.names(kind)), kind
    hf = registry.get("backend", "hf")
    assert hf.plugin == "backend_hf" and hf.distribution.startswith("swarmkit ")


def test_loading_is_idempotent(fresh_plugins):
    assert fresh_plugins.get_state() is fresh_plugins.get_state()


def test_listing_plugins_imports_no_heavy_engine():
    code = textwrap.dedent(
        """
        import sys, swarmkit
        assert "torch" not in sys.modules
        from swarmkit.plugins import get_registry
        from swarmkit.plugins.table import print_table
        import io
        print_table(get_registry(), file=io.StringIO())
        heavy = [m for m in ("vllm", "sglang", "deepspeed", "torch", "transformers") if m in sys.modules]
        print(heavy)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_plugins_table_command_lists_every_kind():
    out = subprocess.run(
        [sys.executable, "-m", "swarmkit.plugins", "--json"], capture_output=True, text=True, check=True
    )
    rows = json.loads(out.stdout)
    got = {(r["kind"], r["name"]) for r in rows}
    for kind, names in EXPECTED.items():
        assert {(kind, n) for n in names} <= got
    vllm = next(r for r in rows if r["name"] == "vllm")
    assert vllm["plugin"] == "backend_vllm"
    text = subprocess.run(
        [sys.executable, "-m", "swarmkit.plugins"], capture_output=True, text=True, check=True
    ).stdout
    assert "batching" in text and "c5" in text


def test_unknown_name_lists_installed_options(fresh_plugins):
    with pytest.raises(UnknownComponentError) as info:
        get_registry().get("backend", "nosuch")
    assert "hf" in str(info.value) and "vllm" in str(info.value) and "sglang" in str(info.value)


def test_missing_engine_names_the_extra(fresh_plugins):
    component = get_registry().get("backend", "sglang")
    assert component.extra == "sglang"
    fake = Component(kind="backend", name="x", target="nowhere:X", requires=("no_such_engine_mod",), extra="vllm")
    assert not fake.available
    with pytest.raises(MissingDependencyError, match=r"swarmkit\[vllm\]"):
        fake.load()


class _C9Plugin:
    @hookimpl
    def register_batching_policies(self, register):
        register("c9", "swarmkit_plugins.batching.policies:EpisodeCount")


def test_direct_plugin_registration():
    state = build_state(entry_points_=[], extra_plugins=[("mine", _C9Plugin())])
    assert state.registry.names("batching") == ["c9"]
    assert state.registry.get("batching", "c9").plugin == "mine"


def test_duplicate_names_are_rejected_naming_both_plugins():
    class Again(_C9Plugin):
        pass

    with pytest.raises(DuplicateComponentError) as info:
        build_state(entry_points_=[], extra_plugins=[("first", _C9Plugin()), ("second", Again())])
    assert "first" in str(info.value) and "second" in str(info.value)


def test_misspelled_hook_is_an_error():
    class Typo:
        @hookimpl
        def register_backend(self, register):  # missing "s"
            pass

    with pytest.raises(PluginLoadError, match="typo"):
        build_state(entry_points_=[], extra_plugins=[("typo", Typo())])


def _fake_distribution(tmp_path, name: str, module_source: str):
    """Write a module and a .dist-info with a swarmkit entry point; return its entry points."""
    mod = f"fake_{name.replace('-', '_')}"
    (tmp_path / f"{mod}.py").write_text(module_source)
    info = tmp_path / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[swarmkit]\n{name} = {mod}\n")
    sys.path.insert(0, str(tmp_path))
    (dist,) = [d for d in distributions(path=[str(tmp_path)])]
    return list(dist.entry_points)


def test_broken_plugin_is_reported_by_name(tmp_path):
    eps = _fake_distribution(tmp_path, "broken-plugin", "raise RuntimeError('boom')\n")
    try:
        with pytest.raises(PluginLoadError) as info:
            build_state(entry_points_=eps)
        msg = str(info.value)
        assert "broken-plugin" in msg and "boom" in msg and "SWARMKIT_BLOCK_PLUGINS" in msg
    finally:
        sys.path.remove(str(tmp_path))


def test_plugin_raising_while_registering_is_reported(tmp_path):
    src = (
        "from swarmkit import hookimpl\n"
        "@hookimpl\n"
        "def register_backends(register):\n"
        "    raise ValueError('bad schema')\n"
    )
    eps = _fake_distribution(tmp_path, "raising-plugin", src)
    try:
        with pytest.raises(PluginLoadError, match="raising-plugin.*bad schema"):
            build_state(entry_points_=eps)
    finally:
        sys.path.remove(str(tmp_path))


def test_blocking_a_plugin_by_name(tmp_path, monkeypatch):
    eps = _fake_distribution(tmp_path, "broken-two", "raise RuntimeError('boom')\n")
    try:
        monkeypatch.setenv("SWARMKIT_BLOCK_PLUGINS", "broken-two")
        state = build_state(entry_points_=eps)
        assert len(state.registry) == 0
    finally:
        sys.path.remove(str(tmp_path))


def test_block_builtin_plugin_removes_its_components(monkeypatch):
    monkeypatch.setenv("SWARMKIT_BLOCK_PLUGINS", "backend_vllm, optim_deepspeed")
    state = build_state()
    assert "vllm" not in state.registry.names("backend")
    assert "deepspeed" not in state.registry.names("optim")
    assert "hf" in state.registry.names("backend")


def test_disable_autoload_keeps_only_swarmkits_own(tmp_path, monkeypatch):
    good = (
        "from swarmkit import hookimpl\n"
        "@hookimpl\n"
        "def register_backends(register):\n"
        "    register('thirdparty', 'x:y')\n"
    )
    eps = _fake_distribution(tmp_path, "third-party", good)
    try:
        builtin = [ep for ep in __import__("importlib.metadata").metadata.entry_points(group="swarmkit")
                   if ep.dist is not None and ep.dist.metadata["Name"] == "swarmkit"]
        assert "thirdparty" in build_state(entry_points_=eps + builtin).registry.names("backend")
        monkeypatch.setenv("SWARMKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
        names = build_state(entry_points_=eps + builtin).registry.names("backend")
        assert "thirdparty" not in names and "hf" in names
    finally:
        sys.path.remove(str(tmp_path))


def test_component_load_imports_the_target():
    ep = EntryPoint(name="match", value="swarmkit_plugins.match", group="swarmkit")
    state = build_state(entry_points_=[ep])
    text = state.registry.get("match", "text").load()
    assert text.key(type("B", (), {"text": "hi"})()) == "hi"
