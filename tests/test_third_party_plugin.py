"""The example third-party plugin (examples/plugins/swarmkit-c6) is found, selected, blocked, removed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugins" / "swarmkit-c6"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True, capture_output=True)


def _components(env=None) -> set[tuple[str, str]]:
    out = subprocess.run(
        [sys.executable, "-m", "swarmkit.plugins", "--json"],
        capture_output=True, text=True, check=True, env=env,
    )
    return {(r["kind"], r["name"]) for r in json.loads(out.stdout)}


@pytest.fixture(scope="module")
def installed_c6():
    _pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    try:
        yield
    finally:
        _pip("uninstall", "-y", "swarmkit-c6")


def test_third_party_policy_is_discovered_selected_and_blocked(installed_c6, tmp_path):
    assert ("batching", "c6") in _components()
    out = subprocess.run(
        [sys.executable, "-m", "swarmkit", "mode=plan", "batching=c6", "batching.max_wait_s=5",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["batching"]["name"] == "c6" and plan["batching"]["max_wait_s"] == 5.0

    code = (
        "from swarmkit.plugins import load_component\n"
        "from swarmkit.contract import PoolEpisode\n"
        "cls = load_component('batching', 'c6')\n"
        "p = cls(batch_size=1, rollouts_per_task=1, max_wait_s=5, min_episodes=1)\n"
        "eps = [PoolEpisode('e1', 't1', 1.0, accepted_at=0.0)]\n"
        "print(p.decide(eps, {}, now=2.0).fire, p.decide(eps, {}, now=6.0).fire)\n"
    )
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ran.stdout.split() == ["False", "True"]

    env = dict(os.environ, SWARMKIT_BLOCK_PLUGINS="c6")
    assert ("batching", "c6") not in _components(env)
    env = dict(os.environ, SWARMKIT_DISABLE_PLUGIN_AUTOLOAD="1")
    assert ("batching", "c6") not in _components(env)
    assert ("backend", "hf") in _components(env)


def test_uninstalled_plugin_is_gone():
    _pip("install", "--no-deps", "--no-build-isolation", str(EXAMPLE))
    _pip("uninstall", "-y", "swarmkit-c6")
    assert ("batching", "c6") not in _components()
