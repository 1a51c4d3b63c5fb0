"""The learning-robustness benchmark's arithmetic: the t-interval over seeds and the collapse rule
(its ``--smoke`` runs in .ci/run with every benchmark's)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "learning_robustness", Path(__file__).resolve().parents[1] / "benchmarks" / "learning_robustness.py")
assert _spec is not None and _spec.loader is not None
lr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lr)


def test_the_t_interval_over_seeds():
    mean, ci = lr.t_interval([0.5, 0.7])
    assert mean == pytest.approx(0.6)
    assert ci == pytest.approx(12.706 * math.sqrt(0.02) / math.sqrt(2))  # t(0.975, 1 df) x sd / sqrt(n)
    mean, ci = lr.t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    assert ci == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert math.isnan(lr.t_interval([0.3])[1]) and math.isnan(lr.t_interval([])[0])


def _e(mean, ci=0.1):
    return {"mean": mean, "ci95": ci}


def test_the_collapse_rule():
    healthy = [{"step": 9, "collapse/identical_groups": 0.25, "collapse/alarm": 0.0}]
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.62), healthy, []) == []
    # a fall inside the two intervals' combined width is noise, beyond it a collapse
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.5), healthy, []) == []
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.4), healthy, [])[0].startswith("held-out fell")
    # without a warm start the reference is the reward before training
    assert lr.collapse_reasons(None, _e(0.6), _e(0.4), healthy, [])[0].startswith("held-out fell")
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.6), healthy, ["collapse/flat_groups"]) == [
        "alarm (flat_groups)"]
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.6), [{**healthy[0], "collapse/alarm": 1.0}], []) == ["alarm"]
    same = [{"step": 9, "collapse/identical_groups": 0.95}]
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.6), same, []) == ["identical_groups 0.95 at the end"]


def test_warm_start_steps_are_told_apart_from_rl_steps():
    assert lr.sft_step({"demonstrations": 8.0, "episodes": 8.0})
    assert not lr.sft_step({"demonstrations": 0.0, "episodes": 8.0})
    assert not lr.sft_step({"demonstrations": 2.0, "episodes": 8.0})


def test_how_rl_rollouts_ended_counts_each_steps_shares_over_its_sampled_episodes():
    rows = [{"step": 1, "episodes": 8.0, "demonstrations": 8.0, "task/outcome/right": 1.0},  # warm start: left out
            {"step": 2, "episodes": 8.0, "demonstrations": 0.0, "task/outcome/overshoot": 0.25,
             "task/outcome/partial": 0.75, "task/outcome/right": 0.0},
            {"step": 3, "episodes": 8.0, "task/outcome/right": 0.5, "task/outcome/partial": 0.5}]
    assert lr.rl_outcomes(rows) == {"partial": 10, "right": 4, "overshoot": 2}
    assert lr.rl_outcomes([{"step": 2, "episodes": 8.0, "reward_mean": 0.1}]) == {}


def test_alarm_rows_name_their_signals(tmp_path):
    rows = [{"kind": "train", "step": 8, "reward_mean": 0.0},
            {"kind": "alarm", "step": 8, "alarm": "collapse alarm at step 8: collapse/flat_groups 1.000 > 0.95 "
                                                  "for 3 steps (steps 6..8; trainer.collapse.action=warn)"}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    steps, alarms = lr.read_rows(tmp_path)
    assert [r["step"] for r in steps] == [8] and alarms == ["collapse/flat_groups"]


def test_the_framework_gap_against_the_seed_spread():
    """--agents: at each step all curves share, the gap of the frameworks' means against the pooled sd over
    seeds, checked against a direct computation; the claim holds only when the gap is within both bounds."""
    curves = {"raw": [{0: 0.0, 8: 0.60, 28: 0.90}, {0: 0.0, 8: 0.70, 28: 1.00}],
              "langgraph": [{0: 0.0, 8: 0.50, 28: 0.92}, {0: 0.0, 8: 0.80, 28: 0.96, 12: 0.5}]}
    rows = {r["step"]: r for r in lr.framework_gap(curves)}
    assert sorted(rows) == [0, 8, 28]  # step 12 is not on every curve
    r = rows[28]
    assert r["means"] == {"raw": pytest.approx(0.95), "langgraph": pytest.approx(0.94)}
    assert r["gap"] == pytest.approx(0.01)
    assert r["spread"] == pytest.approx(math.sqrt((0.005 + 0.0008) / 2))  # variances 0.1²/2 and 0.04²/2
    assert r["holds"]
    assert rows[8]["gap"] == pytest.approx(0.0) and rows[8]["holds"]
    far = lr.framework_gap({"a": [{1: 0.5}, {1: 0.5}], "b": [{1: 0.45}, {1: 0.45}]})[0]
    assert far["gap"] == pytest.approx(0.05) and not far["holds"]  # > 0.04 and > a spread of 0
    one = lr.framework_gap({"a": [{1: 0.5}], "b": [{1: 0.5}]})[0]
    assert math.isnan(one["spread"]) and not one["holds"]  # one seed: no spread to compare with
    assert lr.agent_file("raw") is None and lr.agent_file("langgraph").endswith("langgraph_agent.py")
    assert lr.agent_file("dspy_react") == "examples/frameworks/dspy_react.py"
    with pytest.raises(ValueError, match="neither"):
        lr.agent_file("no_such_agent")
    assert "task.options.agent=examples/frameworks/openai_sdk.py" in lr.main_job_command(
        "calc_agent", 0, Path("/tmp/x"), _args(), "openai_sdk")


def _args():
    import argparse

    return argparse.Namespace(demonstrations=None, warm_steps=1, batch_size=2, rollouts=2, model="tiny",
                              eval_size=4, steps=1, eval_every=0, sft_lr=2e-3, lr=1e-3, override=[])


def test_rl_outcomes_are_split_by_the_chain_length_of_their_problem(tmp_path):
    """multi_calc's overshoot (one call too many) and stopping early (one too few) depend on how many steps a
    problem has; the benchmark reads each trained rollout's outcome from the journal and its length from the
    task's own items."""
    import sqlite3

    from swarmkit.tasks import make_tasks

    items = make_tasks("multi_calc", 8, seed=0, split="train")
    two = next(t.task_id for t in items if len(t.meta["steps"]) == 2)
    three = next(t.task_id for t in items if len(t.meta["steps"]) == 3)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "task:\n  name: multi_calc\n  train_size: 8\n  seed: 0\n  options: {}\n")
    db = sqlite3.connect(tmp_path / "journal.sqlite")
    db.execute("CREATE TABLE episodes (task_id TEXT, meta TEXT, status TEXT)")
    rows = [(two, {"metrics": {"outcome/overshoot": 1.0, "outcome/right": 0.0}}, "trained"),
            (two, {"metrics": {"outcome/right": 1.0}}, "trained"),
            (two, {"metrics": {"outcome/right": 1.0}}, "untrained"),  # sampled, never trained on
            (three, {"metrics": {"outcome/stopped_early": 1.0}}, "trained"),
            (three, {"demonstration": True, "metrics": {"outcome/right": 1.0}}, "trained")]
    db.executemany("INSERT INTO episodes VALUES (?, ?, ?)", [(t, json.dumps(m), s) for t, m, s in rows])
    db.commit()
    db.close()
    assert lr.outcomes_by_length(tmp_path) == {"2": {"overshoot": 1, "right": 1}, "3": {"stopped_early": 1}}
    assert lr.outcomes_by_length(tmp_path / "nothing") == {}
