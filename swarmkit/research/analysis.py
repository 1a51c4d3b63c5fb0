"""What a stage found: each run's metric and curve, aggregated over seeds.

Reads each run folder's ``summary.json`` and ``metrics.jsonl`` (through
:func:`swarmkit.swarm.metrics.read_metrics`); the maths (:func:`mean_ci`,
:func:`mean_curve`, :func:`threshold_crossing`) are pure functions so that the
tests check them without runs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from swarmkit.swarm.metrics import read_metrics

#: two-sided 95% critical values of Student's t by degrees of freedom (1..30); beyond: the normal 1.96
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t95(dof: int) -> float:
    """The two-sided 95% critical value of Student's t with ``dof`` degrees of freedom."""
    if dof < 1:
        return math.nan
    return _T95[dof - 1] if dof <= len(_T95) else 1.96


def mean_ci(values: Sequence[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t over the values).

    One value has no interval from the values alone: its half-width is NaN.
    """
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, t95(len(xs) - 1) * math.sqrt(var / len(xs))


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float, float]]:
    """Per step: the mean over the curves that have that step, and its 95% half-width."""
    by_step: dict[int, list[float]] = {}
    for curve in curves:
        for step, value in curve:
            by_step.setdefault(int(step), []).append(float(value))
    return [(s, *mean_ci(by_step[s])) for s in sorted(by_step)]


def threshold_crossing(points: Sequence[tuple[float, float]], threshold: float) -> tuple[float | None, float | None]:
    """The bracket of the smallest factor value whose metric reaches ``threshold``.

    ``points`` are ``(factor value, mean metric)``. Returns ``(largest value below
    the first passing one that fails, first passing value)``; ``(None, None)`` if none
    passes, ``(None, v)`` if the smallest tried value passes already.
    """
    ordered = sorted(points)
    for i, (value, metric) in enumerate(ordered):
        if math.isfinite(metric) and metric >= threshold:
            return (ordered[i - 1][0] if i else None), value
    return None, None


def get_path(data: Any, path: str) -> Any:
    """``data``'s value at a dotted path (``eval_after.mean``), or None."""
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def read_metric(run_dir: str | Path, metric: str) -> float | None:
    """One run's metric: a path in ``summary.json`` (a mapping with ``mean`` gives its mean) or
    ``train.<key>`` (the mean of the last three training steps' ``<key>``); None if absent."""
    if metric.startswith("train."):
        key = metric[len("train."):]
        vals = [float(r[key]) for r in read_metrics(run_dir)
                if r.get("kind", "train") == "train" and isinstance(r.get(key), int | float)]
        return sum(vals[-3:]) / len(vals[-3:]) if vals else None
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None
    value = get_path(json.loads(path.read_text()), metric)
    if isinstance(value, dict):
        value = value.get("mean")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def reward_curve(run_dir: str | Path, key: str = "reward_mean") -> list[tuple[int, float]]:
    """The training reward per step of one run."""
    return [(int(r["step"]), float(r[key])) for r in read_metrics(run_dir)
            if r.get("kind", "train") == "train" and isinstance(r.get(key), int | float)]


@dataclass
class RunResult:
    """One run (a blueprint at one seed): its status from the executor, its metric and curve."""

    blueprint: str
    seed: int
    dir: str
    status: str
    attempts: int
    metric: float | None
    wall_time_s: float | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class ConfigResult:
    """One blueprint over its seeds: the metric's mean and 95% half-width (NaN when unknown)."""

    blueprint: str
    overrides: dict[str, Any]
    metric: str
    mean: float
    ci95: float
    n: int
    values: list[float]
    failed: int
    curve: list[tuple[int, float, float]]

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def summarize(blueprint: str, overrides: dict[str, Any], metric: str, runs: Sequence[RunResult]) -> ConfigResult:
    """Aggregate one blueprint's runs: failed runs are counted, not averaged in."""
    values = [r.metric for r in runs if r.metric is not None and r.status in ("ok", "retried")]
    m, ci = mean_ci(values)
    return ConfigResult(blueprint=blueprint, overrides=dict(overrides), metric=metric, mean=m, ci95=ci,
                        n=len(values), values=[float(v) for v in values],
                        failed=sum(1 for r in runs if r.status not in ("ok", "retried")),
                        curve=mean_curve([r.curve for r in runs if r.curve]))


def read_run(blueprint: str, seed: int, run_dir: str, record: dict[str, Any], metric: str) -> RunResult:
    """A run's result from its folder and the executor's record of it."""
    wall = None
    summary = Path(run_dir) / "summary.json"
    if summary.exists():
        wall = json.loads(summary.read_text()).get("wall_time_s")
    ok = record.get("status") in ("ok", "retried")
    return RunResult(blueprint=blueprint, seed=seed, dir=run_dir, status=str(record.get("status", "missing")),
                     attempts=len(record.get("attempts", [])), metric=read_metric(run_dir, metric) if ok else None,
                     wall_time_s=wall, curve=reward_curve(run_dir) if ok else [])
