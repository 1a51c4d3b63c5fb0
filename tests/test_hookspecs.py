"""Every hookspec is documented and has its own test here."""

from __future__ import annotations

import inspect
from importlib import import_module

import pytest

from swarmkit import hookimpl
from swarmkit.hookspecs import SPEC_MODULES
from swarmkit.plugins import build_state


def _all_hookspecs():
    for mod_name in SPEC_MODULES:
        mod = import_module(mod_name)
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if hasattr(fn, "swarmkit_spec"):
                yield name, fn


HOOKS = dict(_all_hookspecs())


def test_there_are_hookspecs_for_every_kind_and_lifecycle_event():
    assert {
        "register_backends",
        "register_optims",
        "register_algos",
        "register_match_strategies",
        "register_batching_policies",
        "config_search_paths",
        "on_run_start",
        "on_run_end",
        "on_step_end",
        "on_weights_synced",
        "on_episode_finished",
        "register_loggers",
    } == set(HOOKS)


@pytest.mark.parametrize("name", sorted(HOOKS))
def test_hookspec_is_documented(name):
    doc = inspect.getdoc(HOOKS[name]) or ""
    assert doc.splitlines()[0].strip(), "summary line"
    assert "Called" in doc or "called" in doc, "when it is called / call semantics"
    assert ":returns:" in doc
    for param in inspect.signature(HOOKS[name]).parameters:
        assert f":param {param}:" in doc, param


REGISTER_HOOKS = {
    "register_backends": "backend",
    "register_optims": "optim",
    "register_algos": "algo",
    "register_match_strategies": "match",
    "register_batching_policies": "batching",
}


@pytest.mark.parametrize("hook_name,kind", sorted(REGISTER_HOOKS.items()))
def test_register_hook_adds_named_component(hook_name, kind):
    def impl(register):
        register("mine", "some.module:Thing", requires=("some",), extra="extra", description="d")

    plugin = type("P", (), {hook_name: staticmethod(hookimpl(impl))})()
    registry = build_state(entry_points_=[], extra_plugins=[("p", plugin)]).registry
    component = registry.get(kind, "mine")
    assert (component.target, component.plugin, component.extra) == ("some.module:Thing", "p", "extra")
    assert not component.available


def test_config_search_paths_are_concatenated():
    class A:
        @hookimpl
        def config_search_paths(self):
            return ["pkg://a.conf"]

    class B:
        @hookimpl
        def config_search_paths(self):
            return ["file:///b"]

    state = build_state(entry_points_=[], extra_plugins=[("a", A()), ("b", B())])
    assert sorted(state.hooks.config_search_paths()) == ["file:///b", "pkg://a.conf"]


class Recorder:
    def __init__(self):
        self.calls = []

    @hookimpl
    def on_run_start(self, config, run_dir):
        self.calls.append(("run_start", config, run_dir))

    @hookimpl
    def on_run_end(self, summary):
        self.calls.append(("run_end", summary))

    @hookimpl
    def on_step_end(self, step, metrics):
        self.calls.append(("step_end", step, metrics))

    @hookimpl
    def on_weights_synced(self, step, seconds):
        self.calls.append(("weights_synced", step, seconds))

    @hookimpl
    def on_episode_finished(self, episode):
        self.calls.append(("episode_finished", episode))


class Broken:
    @hookimpl
    def on_step_end(self, step, metrics):
        raise RuntimeError("logger bug")


def _hooks(*plugins):
    return build_state(entry_points_=[], extra_plugins=[(f"p{i}", p) for i, p in enumerate(plugins)]).hooks


def test_on_run_start():
    rec = Recorder()
    _hooks(rec).run_start(config={"a": 1}, run_dir="/tmp/r")
    assert rec.calls == [("run_start", {"a": 1}, "/tmp/r")]


def test_on_run_end():
    rec = Recorder()
    _hooks(rec).run_end(summary={"global_step": 3})
    assert rec.calls == [("run_end", {"global_step": 3})]


def test_on_step_end_survives_a_broken_logger():
    rec = Recorder()
    _hooks(Broken(), rec).step_end(step=1, metrics={"loss": 0.5})
    assert rec.calls == [("step_end", 1, {"loss": 0.5})]


def test_on_weights_synced():
    rec = Recorder()
    _hooks(rec).weights_synced(step=2, seconds=0.1)
    assert rec.calls == [("weights_synced", 2, 0.1)]


def test_on_episode_finished():
    rec = Recorder()
    _hooks(rec).episode_finished(episode={"id": "e1", "status": "finished"})
    assert rec.calls == [("episode_finished", {"id": "e1", "status": "finished"})]


def test_register_loggers_declares_names_and_what_they_need():
    class L:
        @hookimpl
        def register_loggers(self, register):
            register("mine", "writes somewhere", requires="json", extra="mine")
            register("needs_more", "", requires="no_such_module_here", extra="more")

    loggers = _hooks(L()).loggers()
    assert loggers["mine"].description == "writes somewhere" and loggers["mine"].missing() is None
    assert loggers["needs_more"].missing() == ("logger 'needs_more' needs the no_such_module_here package: "
                                               "pip install 'swarmkit[more]'")


def test_on_step_end_passes_run_dir_and_trajectories_to_who_asks():
    seen = []

    class Full:
        @hookimpl
        def on_step_end(self, step, metrics, run_dir, trajectories):
            seen.append((step, run_dir, trajectories))

    _hooks(Full(), Recorder()).step_end(step=4, metrics={}, run_dir="/r", trajectories=[{"episode_id": "e"}])
    assert seen == [(4, "/r", [{"episode_id": "e"}])]


def test_every_hookspec_has_a_test_here():
    src = open(__file__).read()
    for name in HOOKS:
        assert name in src.replace("test_" + name, "") or f"test_{name}" in src
