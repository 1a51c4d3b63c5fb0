"""The learning-robustness benchmark's arithmetic: the t-interval over seeds and the collapse rule
(its ``--smoke`` runs in .ci/run with every benchmark's)."""

from __future__ import annotations

import importlib.util
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
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.62), healthy, 0) == []
    # a fall inside the two intervals' combined width is noise, beyond it a collapse
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.5), healthy, 0) == []
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.4), healthy, 0)[0].startswith("held-out fell")
    # without a warm start the reference is the reward before training
    assert lr.collapse_reasons(None, _e(0.6), _e(0.4), healthy, 0)[0].startswith("held-out fell")
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.6), healthy, 1) == ["alarm"]
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.6), [{**healthy[0], "collapse/alarm": 1.0}], 0) == ["alarm"]
    same = [{"step": 9, "collapse/identical_groups": 0.95}]
    assert lr.collapse_reasons(_e(0.6), _e(0.0), _e(0.6), same, 0) == ["identical_groups 0.95 at the end"]


def test_warm_start_steps_are_told_apart_from_rl_steps():
    assert lr.sft_step({"demonstrations": 8.0, "episodes": 8.0})
    assert not lr.sft_step({"demonstrations": 0.0, "episodes": 8.0})
    assert not lr.sft_step({"demonstrations": 2.0, "episodes": 8.0})
