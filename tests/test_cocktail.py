"""Cocktail training (examples/cocktail): the tool-agent client and the game client feed one real server at
once; every trained batch keeps the pool's mix caps (read back from the journal) and every step logs its
metrics per task family in metrics.jsonl and TensorBoard."""

from __future__ import annotations

import collections
import importlib.util
import json
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cocktail" / "run.py"


def _load():
    spec = importlib.util.spec_from_file_location("cocktail_run", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_caps_are_checked_per_batch_in_tasks():
    cocktail = _load()
    batches = {1: collections.Counter(calc_agent=1, who_is_spy=1), 2: collections.Counter(calc_agent=2)}
    assert cocktail.check_caps(batches, {"calc_agent": 0.5, "who_is_spy": 0.5}, 2) == [
        "step 2: 2 calc_agent tasks > 0.5 x 2"]
    assert cocktail.check_caps(batches, {"calc_agent": 1.0}, 2) == []


def test_two_clients_two_tasks_one_server(tmp_path):
    cocktail = _load()
    out = tmp_path / "out.json"
    rc = cocktail.main(["--model", "tiny", "--steps", "3", "--max-tokens", "8", "--batch-size", "2", "--rollouts", "2",
                        "--demonstrations", "4", "--eval-every", "2", "--timeout", "300", "--work-dir", str(tmp_path),
                        "--out", str(out)])
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["broken"] == []
    assert len(summary["batches"]) == 3
    assert all(sum(c.values()) == 2 and max(c.values()) == 1 for c in summary["batches"].values())
    every = [json.loads(line) for line in (tmp_path / "server" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in every if r.get("kind") == "train"]  # not the collapse alarm's row: with 2 rollouts a
    assert len(rows) == 3  # group, 3 steps whose every group scored alike can raise it (seen in a suite run)
    for m in rows:
        assert m["episodes/who_is_spy"] == 2 and m["tokens/who_is_spy"] > 0
        assert {"reward_mean/who_is_spy/civilian", "reward_mean/who_is_spy/spy"} <= set(m)
        assert m.get("episodes/calc_agent", 0) + m.get("demonstrations/calc_agent", 0) == 2
    assert any(k.startswith("eval_reward/") for m in rows for k in m)
    assert list((tmp_path / "server" / "tensorboard").glob("events.out.tfevents.*"))


def test_the_cocktail_as_three_adapters_of_one_base(tmp_path):
    """--adapters: the tool agent trains ``tools``, the game's roles ``civilians`` and ``spies``; a step trains one
    adapter on its own family's episodes only."""
    cocktail = _load()
    out = tmp_path / "out.json"
    rc = cocktail.main(["--model", "tiny", "--adapters", "--steps", "4", "--max-tokens", "8", "--batch-size", "2",
                        "--rollouts", "2", "--demonstrations", "4", "--eval-every", "2", "--timeout", "300",
                        "--work-dir", str(tmp_path), "--out", str(out)])
    summary = json.loads(out.read_text())
    assert rc == 0 and summary["broken"] == []
    every = [json.loads(line) for line in (tmp_path / "server" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in every if r.get("kind") == "train"]
    assert len(rows) >= 4
    for m in rows:
        (adapter,) = [k.split("/")[1] for k in m if k.startswith("adapter/") and k.endswith("/step")]
        families = {k.split("/")[1] for k in m if k.startswith(("episodes/", "demonstrations/"))}
        assert families == ({"calc_agent"} if adapter == "tools" else {"who_is_spy"}), (adapter, families)
    assert {k.split("/")[1] for m in rows for k in m if k.startswith("adapter/")} <= {"tools", "civilians", "spies"}
