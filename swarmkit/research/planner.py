"""The offline leader: built-in planners for the common study shapes.

A study's constraints (:class:`StudySpec`, a YAML mapping) name its shape:

- ``threshold``: the smallest value of ``factor`` (in ``range``) whose metric
  reaches ``threshold``, and whether the ``cross`` factor moves it. Stage 1 is a
  coarse geometric grid at the cross factor's first value; each later stage
  refines the bracket around the crossing and runs the other cross values at
  the same points, until every bracket is tight (adjacent values) or
  ``max_stages`` is reached.
- ``grid``: every combination of ``values`` and ``cross``, one stage.
- ``halving``: successive halving over ``values`` x ``cross``: every
  configuration at ``budgets[0]`` of ``budget_key``, the best ``1/eta`` at the
  next budget, and so on.
- ``ablation``: the ``baseline`` and one blueprint per single change of
  ``ablations`` (one factor at a time).

Every planner is a pure function of the spec and the results so far, so a
resumed campaign plans the same stage again.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmkit.research.analysis import threshold_crossing
from swarmkit.research.blueprint import Blueprint, BlueprintError, parse_blueprints

SHAPES = ("threshold", "grid", "halving", "ablation")


@dataclass
class StudySpec:
    """A study's constraints: its shape, the runs' common overrides and the factors."""

    shape: str = "grid"
    base: dict[str, Any] = field(default_factory=dict)
    factor: str = ""
    values: list[Any] = field(default_factory=list)
    range: list[int] = field(default_factory=list)
    cross: dict[str, list[Any]] = field(default_factory=dict)
    metric: str = "eval_after"
    threshold: float = 0.5
    seeds: list[int] = field(default_factory=lambda: [0])
    budget_s: float = 300.0
    max_stages: int = 3
    #: threshold: the coarse grid's ratio (1, 4, 16 for a range 1..16 and ratio 4)
    ratio: int = 4
    #: halving
    budget_key: str = "trainer.total_steps"
    budgets: list[int] = field(default_factory=list)
    eta: int = 2
    #: ablation
    baseline: dict[str, Any] = field(default_factory=dict)
    ablations: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class StagePlan:
    """The next stage: its blueprints and the leader's reason for them."""

    blueprints: list[Blueprint]
    rationale: str


def infer_shape(goal: str) -> str:
    """The study shape a goal's wording asks for, when the constraints do not name one."""
    text = goal.lower()
    if any(w in text for w in ("minimum", "minimal", "smallest", "threshold", "least")):
        return "threshold"
    if "ablation" in text or "ablate" in text:
        return "ablation"
    if any(w in text for w in ("best", "halving", "tune", "optimal")):
        return "halving"
    return "grid"


def parse_spec(data: Any, goal: str = "") -> StudySpec:
    """A :class:`StudySpec` from the constraints mapping; :class:`BlueprintError` lists every problem."""
    if not isinstance(data, dict):
        raise BlueprintError(f"constraints: expected a mapping, got {type(data).__name__}")
    known = set(StudySpec.__dataclass_fields__)
    problems = [f"constraints.{k}: unknown key (known: {', '.join(sorted(known))})" for k in data if k not in known]
    spec = StudySpec(**{k: v for k, v in data.items() if k in known})
    if "shape" not in data:
        spec.shape = infer_shape(goal)
    if spec.shape not in SHAPES:
        problems.append(f"constraints.shape: expected one of {', '.join(SHAPES)}, got {spec.shape!r}")
    if not isinstance(spec.base, dict):
        problems.append("constraints.base: expected a mapping of config overrides")
    if not isinstance(spec.cross, dict) or not all(isinstance(v, list) and v for v in spec.cross.values()):
        problems.append("constraints.cross: expected a mapping of config keys to non-empty lists")
    if not isinstance(spec.seeds, list) or not spec.seeds or not all(isinstance(s, int) for s in spec.seeds):
        problems.append(f"constraints.seeds: expected a non-empty list of integers, got {spec.seeds!r}")
    if spec.shape == "threshold":
        if not spec.factor:
            problems.append("constraints.factor: required for a threshold study (the config key to minimise)")
        if not (isinstance(spec.range, list) and len(spec.range) == 2 and all(isinstance(v, int) for v in spec.range)
                and 0 < spec.range[0] <= spec.range[1]):
            problems.append(f"constraints.range: expected [low, high] positive integers, got {spec.range!r}")
        if spec.ratio < 2:
            problems.append("constraints.ratio: expected an integer >= 2")
    if spec.shape in ("grid", "halving") and (not spec.factor or not spec.values):
        problems.append(f"constraints.factor, constraints.values: required for a {spec.shape} study")
    if spec.shape == "halving" and (not spec.budgets or spec.eta < 2):
        problems.append("constraints.budgets: a non-empty list (of budget_key values), and eta >= 2")
    if spec.shape == "ablation" and not spec.ablations:
        problems.append("constraints.ablations: required for an ablation study (config key -> alternative values)")
    if problems:
        raise BlueprintError(f"{len(problems)} problem(s) in the constraints:\n  " + "\n  ".join(problems))
    return spec


# --------------------------------------------------------------------------- helpers
def short(key: str) -> str:
    """A config key's last part, for names (``batching.batch_size`` -> ``batch_size``)."""
    return key.rsplit(".", 1)[-1]


def config_name(point: dict[str, Any]) -> str:
    """A blueprint name from a configuration's factor values (``batch_size4-max_tokens8``)."""
    return "-".join(f"{short(k)}{v}" for k, v in point.items()).replace("/", "_")[:64] or "baseline"


def make_blueprint(spec: StudySpec, point: dict[str, Any], objective: str, hypothesis: str,
                   extra: dict[str, Any] | None = None) -> Blueprint:
    overrides = {**spec.base, **(extra or {}), **point}
    return Blueprint(name=config_name({**point, **(extra or {})}), objective=objective, hypothesis=hypothesis,
                     overrides=overrides, seeds=list(spec.seeds), metric=spec.metric, budget_s=float(spec.budget_s))


def geometric_points(low: int, high: int, ratio: int) -> list[int]:
    """``low, low*ratio, ...`` up to ``high``, and ``high`` itself."""
    out, v = [], low
    while v < high:
        out.append(v)
        v *= ratio
    return sorted({*out, high})


def between(low: int, high: int, most: int = 2) -> list[int]:
    """Up to ``most`` integers strictly between ``low`` and ``high``, spread geometrically."""
    inside = list(range(low + 1, high))
    if len(inside) <= most:
        return inside
    picks = {round(low * (high / low) ** (i / (most + 1))) for i in range(1, most + 1)} if low > 0 else set()
    picks = {p for p in picks if low < p < high} or {inside[len(inside) // 2]}
    return sorted(picks)


def tested(results: Sequence[dict[str, Any]], factor: str, cross_key: str | None) -> dict[Any, dict[Any, float]]:
    """cross value -> factor value -> mean metric, over every analysed configuration so far."""
    out: dict[Any, dict[Any, float]] = {}
    for r in results:
        ov = r.get("overrides", {})
        if factor not in ov:
            continue
        c = ov.get(cross_key) if cross_key else None
        mean = r.get("mean")
        out.setdefault(c, {})[ov[factor]] = float(mean) if isinstance(mean, int | float) else math.nan
    return out


def _all_results(stages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for s in stages for r in s.get("results", [])]


def crossing(seen: dict[Any, float], threshold: float) -> tuple[int | None, int | None]:
    """:func:`threshold_crossing` over integer factor values."""
    f, p = threshold_crossing(list(seen.items()), threshold)
    return (None if f is None else int(f)), (None if p is None else int(p))


# --------------------------------------------------------------------------- planners
def plan_threshold(spec: StudySpec, stages: Sequence[dict[str, Any]]) -> StagePlan | None:
    low, high = spec.range
    cross_key, cross_values = next(iter(spec.cross.items()), (None, [None]))
    base_c = cross_values[0]

    def point(v: int, c: Any) -> dict[str, Any]:
        return {spec.factor: v, **({cross_key: c} if cross_key else {})}

    if not stages:
        pts = geometric_points(low, high, spec.ratio)
        return StagePlan(
            [make_blueprint(spec, point(v, base_c), f"{spec.metric} at {spec.factor}={v}",
                            f"coarse grid: {spec.metric} >= {spec.threshold:g} from some {spec.factor} on")
             for v in pts],
            f"coarse geometric grid {pts} over {spec.factor} at {cross_key}={base_c}, "
            f"{len(spec.seeds)} seed(s) each, to bracket the smallest value reaching {spec.threshold:g}")
    table = tested(_all_results(stages), spec.factor, cross_key)
    base = table.get(base_c, {})
    lo_fail, first_pass = crossing(base, spec.threshold)
    proposals: list[tuple[int, Any, str]] = []
    notes: list[str] = []
    for c in cross_values:
        seen = table.get(c, {})
        if not seen:  # a cross value not run yet: the base's bracket and its refinement
            anchor = [v for v in (lo_fail, first_pass) if v is not None] or geometric_points(low, high, spec.ratio)
            pts = sorted({*anchor, *(between(lo_fail, first_pass) if lo_fail and first_pass else [])})
            proposals += [(v, c, f"does {cross_key}={c} move the crossing? same points as the baseline") for v in pts]
            notes.append(f"{cross_key}={c} at {pts}")
            continue
        f, p = crossing(seen, spec.threshold)
        tried = sorted(seen)
        if p is None:  # nothing reaches it yet: go up
            up = [v for v in geometric_points(low, high, 2) if v > tried[-1]][:1]
            proposals += [(v, c, f"nothing up to {tried[-1]} reaches {spec.threshold:g}: try larger") for v in up]
            notes.append(f"{cross_key}={c}: nothing reaches it up to {tried[-1]}" + (f", try {up}" if up else
                                                                                      ", range exhausted"))
        elif f is None and p > low:
            down = [v for v in between(low - 1, p, 2) if v not in seen]
            proposals += [(v, c, f"{p} already reaches it: try smaller") for v in down]
            notes.append(f"{cross_key}={c}: {p} is the smallest tried; try {down}")
        elif f is not None and p - f > 1:
            mids = [v for v in between(f, p) if v not in seen]
            proposals += [(v, c, f"refine the bracket ({f} fails, {p} reaches it)") for v in mids]
            notes.append(f"{cross_key}={c}: refine between {f} and {p}: {mids}")
        elif f is None:
            notes.append(f"{cross_key}={c}: the range's low end {p} already reaches it")
        else:
            notes.append(f"{cross_key}={c}: bracket tight ({f} fails, {p} reaches it)")
    proposals = [(v, c, h) for v, c, h in proposals if v not in table.get(c, {})]
    if not proposals:
        return None
    seen_names: set[str] = set()
    blueprints = []
    for v, c, hyp in proposals:
        bp = make_blueprint(spec, point(v, c), f"{spec.metric} at {spec.factor}={v}"
                            + (f", {cross_key}={c}" if cross_key else ""), hyp)
        if bp.name not in seen_names:
            seen_names.add(bp.name)
            blueprints.append(bp)
    return StagePlan(blueprints, "; ".join(notes))


def plan_grid(spec: StudySpec, stages: Sequence[dict[str, Any]]) -> StagePlan | None:
    if stages:
        return None
    keys = [spec.factor, *spec.cross]
    combos = list(itertools.product(spec.values, *spec.cross.values()))
    return StagePlan([make_blueprint(spec, dict(zip(keys, combo, strict=True)), f"{spec.metric} at {combo}",
                                     "grid point") for combo in combos],
                     f"full grid over {' x '.join(keys)}: {len(combos)} configurations")


def plan_halving(spec: StudySpec, stages: Sequence[dict[str, Any]]) -> StagePlan | None:
    keys = [spec.factor, *spec.cross]
    if not stages:
        points = [dict(zip(keys, c, strict=True)) for c in itertools.product(spec.values, *spec.cross.values())]
        why = f"successive halving: all {len(points)} configurations at {spec.budget_key}={spec.budgets[0]}"
    else:
        k = len(stages)
        if k >= len(spec.budgets):
            return None
        last = [r for r in stages[-1].get("results", [])]
        if len(last) <= 1:
            return None
        ranked = sorted(last, key=lambda r: -(r["mean"] if isinstance(r.get("mean"), int | float) else -math.inf))
        keep = ranked[: max(1, math.ceil(len(ranked) / spec.eta))]
        points = [{key: r["overrides"][key] for key in keys if key in r["overrides"]} for r in keep]
        why = (f"keep the best {len(keep)} of {len(ranked)} ({', '.join(r['blueprint'] for r in keep)}) "
               f"at {spec.budget_key}={spec.budgets[k]}")
    budget = spec.budgets[len(stages)]
    return StagePlan([make_blueprint(spec, p, f"{spec.metric} at {p}, {spec.budget_key}={budget}",
                                     "a better configuration stays better with more budget",
                                     extra={spec.budget_key: budget}) for p in points], why)


def plan_ablation(spec: StudySpec, stages: Sequence[dict[str, Any]]) -> StagePlan | None:
    if stages:
        return None
    bps = [make_blueprint(spec, dict(spec.baseline), "the baseline", "the reference for every change")]
    bps[0].name = "baseline"
    for key, alts in spec.ablations.items():
        for alt in alts:
            bps.append(make_blueprint(spec, {**spec.baseline, key: alt}, f"{spec.metric} with {key}={alt}",
                                      f"changing {key} alone moves {spec.metric}"))
            bps[-1].name = config_name({key: alt})
    return StagePlan(bps, f"one-factor ablation around the baseline: {sum(map(len, spec.ablations.values()))} "
                          f"single changes of {', '.join(spec.ablations)}")


PLANNERS = {"threshold": plan_threshold, "grid": plan_grid, "halving": plan_halving, "ablation": plan_ablation}


class OfflineLeader:
    """The built-in planner as a leader: the next stage from the spec and the results so far."""

    name = "offline"

    def __init__(self, spec: StudySpec):
        self.spec = spec

    def next_stage(self, goal: str, constraints: dict[str, Any], stages: Sequence[dict[str, Any]],
                   max_stages: int) -> StagePlan | None:
        if len(stages) >= max_stages:
            return None
        return PLANNERS[self.spec.shape](self.spec, stages)


class FileLeader:
    """A campaign of one stage: blueprints written by hand (``blueprints=PATH``)."""

    name = "file"

    def __init__(self, blueprints: list[dict[str, Any]]):
        self.blueprints = blueprints

    def next_stage(self, goal: str, constraints: dict[str, Any], stages: Sequence[dict[str, Any]],
                   max_stages: int) -> StagePlan | None:
        if stages:
            return None
        return StagePlan(parse_blueprints(self.blueprints), f"{len(self.blueprints)} blueprints from a file")


# --------------------------------------------------------------------------- conclusions
def fmt(mean: Any, ci: Any) -> str:
    """``0.62 ± 0.08`` (no interval when unknown)."""
    if not isinstance(mean, int | float) or not math.isfinite(mean):
        return "n/a"
    return f"{mean:.3f}" + (f" ± {ci:.3f}" if isinstance(ci, int | float) and math.isfinite(ci) else "")


def _above(r: dict[str, Any], threshold: float) -> bool:
    """The configuration's 95% interval lies at or above ``threshold``."""
    m, c = r.get("mean"), r.get("ci95")
    return isinstance(m, int | float) and isinstance(c, int | float) and m - c >= threshold


def _below(r: dict[str, Any], threshold: float) -> bool:
    m, c = r.get("mean"), r.get("ci95")
    return isinstance(m, int | float) and isinstance(c, int | float) and m + c < threshold


def conclude(spec: StudySpec, stages: Sequence[dict[str, Any]]) -> list[str]:
    """The findings, one line each, from every analysed configuration."""
    results = _all_results(stages)
    if not results:
        return ["no configuration was analysed"]
    if spec.shape == "threshold":
        cross_key, cross_values = next(iter(spec.cross.items()), (None, [None]))
        lines, mins, resolved = [], {}, 0
        by = {(r["overrides"].get(spec.factor), r["overrides"].get(cross_key) if cross_key else None): r
              for r in results if spec.factor in r.get("overrides", {})}
        for c, seen in tested(results, spec.factor, cross_key).items():
            f, p = threshold_crossing(list(seen.items()), spec.threshold)
            label = f"{cross_key}={c}" if cross_key else "all runs"
            mins[c] = p
            if p is None:
                lines.append(f"{label}: no {spec.factor} in {sorted(seen)} reaches {spec.metric} >= "
                             f"{spec.threshold:g} (best {max(seen.values()):.3f})")
                continue
            rp = by.get((p, c), {})
            text = (f"{label}: the smallest {spec.factor} whose mean {spec.metric} reaches {spec.threshold:g} is {p} "
                    f"({fmt(rp.get('mean'), rp.get('ci95'))}, n={rp.get('n')})")
            sure = _above(rp, spec.threshold)
            if f is not None:
                rf = by.get((f, c), {})
                text += f"; {f} does not ({fmt(rf.get('mean'), rf.get('ci95'))})"
                sure = sure and _below(rf, spec.threshold)
                if p - f > 1:
                    text += f"; values between {f} and {p} were not run"
            elif p > spec.range[0]:
                text += f"; nothing below {p} was run"
            resolved += int(sure)
            lines.append(text + ("; the 95% intervals separate them from the threshold" if sure else
                                 "; the 95% intervals include the threshold: more seeds would be needed to be sure"))
        if cross_key and len(mins) > 1:
            distinct = {v for v in mins.values()}
            lines.append(f"point estimates: {cross_key} {'does not change' if len(distinct) == 1 else 'changes'} "
                         f"the minimum {spec.factor} ("
                         + ", ".join(f"{cross_key}={c} -> {v if v is not None else 'none'}" for c, v in mins.items())
                         + f"); {resolved} of {len(mins)} brackets resolved at 95%")
        return lines
    ranked = sorted(results, key=lambda r: -(r["mean"] if isinstance(r.get("mean"), int | float)
                                              and math.isfinite(r["mean"]) else -math.inf))
    best = ranked[0]
    last = stages[-1].get("results", []) if spec.shape == "halving" else results
    best = max(last, key=lambda r: r["mean"] if isinstance(r.get("mean"), int | float) else -math.inf, default=best)
    lines = [f"best configuration: {best['blueprint']} ({fmt(best.get('mean'), best.get('ci95'))}, n={best.get('n')})"]
    if spec.shape == "ablation":
        base = next((r for r in results if r["blueprint"] == "baseline"), None)
        if base and isinstance(base.get("mean"), int | float):
            for r in results:
                if r is not base and isinstance(r.get("mean"), int | float):
                    lines.append(f"{r['blueprint']}: {r['mean'] - base['mean']:+.3f} vs the baseline "
                                 f"({fmt(r.get('mean'), r.get('ci95'))} vs {fmt(base['mean'], base.get('ci95'))})")
    return lines
