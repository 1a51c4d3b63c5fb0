"""The campaign's report: markdown with tables and matplotlib plots.

``report.md`` holds the goal, the findings, each stage's table (configuration,
metric mean ± 95% CI over seeds), the trace of stages and decisions (like
Table 4 of the AgentJet paper: who did what, when) and the failed and retried
runs; ``curves.png`` the training reward per configuration (mean over seeds)
and ``metric.png`` the final metric against the swept factor with its
intervals. Also copied there: ``campaign.json`` and each stage's
``blueprints.yaml`` (small files), so the folder stands on its own.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import shutil
from pathlib import Path
from typing import Any

import yaml

from swarmkit.errors import SwarmkitError


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise SwarmkitError("the research report's plots need matplotlib: pip install 'swarmkit[research]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def varying_keys(results: list[dict[str, Any]]) -> list[str]:
    """The override keys whose values differ between configurations (the factors), in first-seen order."""
    keys: list[str] = []
    for r in results:
        for k in r.get("overrides", {}):
            if k not in keys:
                keys.append(k)
    return [k for k in keys if len({json.dumps(r["overrides"].get(k), default=str) for r in results}) > 1]


def _num(v: Any) -> float:
    return float(v) if isinstance(v, int | float) and v is not None else math.nan


def _fmt(mean: Any, ci: Any) -> str:
    if not isinstance(mean, int | float):
        return "n/a"
    return f"{mean:.3f}" + (f" ± {ci:.3f}" if isinstance(ci, int | float) else "")


def _series(results: list[dict[str, Any]], factors: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Configurations grouped by every factor but the first (one line per group)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        label = ", ".join(f"{k.rsplit('.', 1)[-1]}={r['overrides'].get(k)}" for k in factors[1:]) or "all"
        out.setdefault(label, []).append(r)
    return out


def plot_metric(results: list[dict[str, Any]], factors: list[str], path: Path, threshold: float | None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    numeric = bool(factors) and all(isinstance(r["overrides"].get(factors[0]), int | float) for r in results)
    if numeric:
        for label, rs in sorted(_series(results, factors).items(), key=lambda kv: _order(kv[0])):
            rs = sorted(rs, key=lambda r: r["overrides"][factors[0]])
            xs = [r["overrides"][factors[0]] for r in rs]
            ys = [_num(r.get("mean")) for r in rs]
            es = [0.0 if r.get("ci95") is None else r["ci95"] for r in rs]
            bars = ax.errorbar(xs, ys, yerr=es, marker="o", capsize=4, label=label)
            seeds = [(r["overrides"][factors[0]], v) for r in rs for v in r.get("values") or []]
            if seeds:  # each seed's value, so a wide interval shows where it comes from
                ax.scatter([x for x, _ in seeds], [v for _, v in seeds], s=12, alpha=0.5,
                           color=bars[0].get_color(), zorder=3)
        ticks = sorted({r["overrides"][factors[0]] for r in results})
        if all(t > 0 for t in ticks):
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(factors[0])
    else:
        names = [r["blueprint"] for r in results]
        ax.bar(range(len(results)), [_num(r.get("mean")) for r in results],
               yerr=[0.0 if r.get("ci95") is None else r["ci95"] for r in results], capsize=4)
        ax.set_xticks(range(len(results)), names, rotation=30, ha="right")
    _clip_to_data(ax, [_num(r.get("mean")) for r in results]
                  + [float(v) for r in results for v in r.get("values") or []])
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
    metric = results[0].get("metric", "metric") if results else "metric"
    ax.set_ylabel(f"{metric} (mean ± 95% CI over seeds)")
    ax.grid(alpha=0.3)
    if numeric or threshold is not None:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clip_to_data(ax: Any, values: list[float]) -> None:
    """Y limits around the values themselves: a t interval of two seeds would dwarf them."""
    finite = [v for v in values if math.isfinite(v)]
    if finite:
        lo, hi = min(finite), max(finite)
        pad = max(0.1 * (hi - lo), 0.05)
        ax.set_ylim(lo - pad, hi + pad)


def _order(value: Any) -> tuple[int, float, str]:
    return (0, float(value), "") if isinstance(value, int | float) else (1, 0.0, str(value))


def plot_curves(results: list[dict[str, Any]], factors: list[str], path: Path) -> None:
    plt = _plt()
    groups = _series(results, factors)
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.6), sharey=True, squeeze=False)
    for ax, (label, rs) in zip(axes[0], sorted(groups.items()), strict=True):
        means: list[float] = []
        for r in sorted(rs, key=lambda r: _order(r["overrides"].get(factors[0])) if factors else _order(r["blueprint"])):
            curve = r.get("curve") or []
            if not curve:
                continue
            xs = [c[0] for c in curve]
            ys = [c[1] for c in curve]
            name = f"{factors[0].rsplit('.', 1)[-1]}={r['overrides'].get(factors[0])}" if factors else r["blueprint"]
            ax.plot(xs, ys, marker=".", label=name)  # no band: a t interval of 2-3 seeds would hide the lines
            means += ys
        _clip_to_data(ax, means)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("training reward (mean over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _when(t: float, t0: float) -> str:
    s = int(t - t0)
    return f"+{s // 60}:{s % 60:02d}"


def write_report(state: dict[str, Any], out: Path, campaign_dir: Path) -> Path:
    """Write ``report.md`` and its plots into ``out``; its path."""
    out.mkdir(parents=True, exist_ok=True)
    stages = [s for s in state["stages"] if s.get("status") == "analysed"]
    results = [r for s in stages for r in s.get("results", [])]
    factors = varying_keys(results)
    constraints = state.get("constraints") or {}
    if not isinstance(constraints, dict):
        constraints = {}
    spec_factor = constraints.get("factor")
    if spec_factor in factors:
        factors = [spec_factor, *[f for f in factors if f != spec_factor]]
    threshold = None
    if isinstance(constraints, dict) and constraints.get("shape", "threshold") == "threshold":
        value = constraints.get("threshold")
        threshold = float(value) if isinstance(value, int | float) else None
    # one point per configuration: a configuration run in two stages keeps its last result
    latest: dict[str, dict[str, Any]] = {}
    for r in results:
        latest[json.dumps(r["overrides"], sort_keys=True, default=str)] = r
    merged = list(latest.values())
    if merged:
        plot_metric(merged, factors, out / "metric.png", threshold)
        plot_curves(merged, factors, out / "curves.png")
    t0 = float(state.get("created", 0))
    lines = [f"# Research campaign: {state['goal']}", ""]
    created = dt.datetime.fromtimestamp(t0, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    wall = (state.get("finished") or t0) - t0
    settings = state["settings"]
    lines += [f"Started {created}; {len(stages)} stage(s), "
              f"{sum(len(s.get('jobs', {})) for s in stages)} runs, {wall / 60:.1f} min in all. "
              f"Leader: {settings['planner']}; {settings['parallel']} runs in parallel"
              + (f" on GPUs {settings['gpus']}" if settings.get("gpus") else " on CPU")
              + f", {settings['retries']} retr{'y' if settings['retries'] == 1 else 'ies'} per run. "
              f"Campaign folder: `{campaign_dir}`.", ""]
    lines += ["## Findings", ""] + [f"- {c}" for c in state.get("conclusion") or ["(not finished)"]] + [""]
    if merged:
        lines += ["![final metric against the factor](metric.png)", "",
                  "![training reward per configuration](curves.png)", ""]
    lines += ["## Constraints", "", "```yaml", yaml.safe_dump(constraints, sort_keys=False).rstrip(), "```", ""]
    for s in stages:
        k = s["index"]
        lines += [f"## Stage {k}", "", f"*{s.get('leader', '')} leader:* {s.get('rationale', '')}", ""]
        cols = factors or ["blueprint"]
        lines += ["| blueprint | " + " | ".join(c for c in cols) + " | metric | mean ± 95% CI | n | failed |",
                  "|---" * (len(cols) + 5) + "|"]
        for r in s.get("results", []):
            vals = " | ".join(str(r["overrides"].get(c, "")) if c != "blueprint" else r["blueprint"] for c in cols)
            lines.append(f"| {r['blueprint']} | {vals} | {r.get('metric')} | {_fmt(r.get('mean'), r.get('ci95'))} | "
                         f"{r.get('n')} | {r.get('failed')} |")
        lines += ["", f"Blueprints: `stage{k}/blueprints.yaml`.", ""]
    lines += ["## Trace of stages and decisions", "",
              "Every row is one artifact, by the leader (plans, analyses, the report) or the workers (runs), "
              "in order (time since the start).", "", "| # | time | stage | actor | what | detail |",
              "|---|---|---|---|---|---|"]
    for i, t in enumerate(state.get("trace", []), 1):
        text = str(t["text"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {i} | {_when(t['time'], t0)} | {t['stage'] or '-'} | {t['actor']} | {t['kind']} | {text} |")
    lines += ["", "## Failed and retried runs", ""]
    bad = [(s["index"], rec) for s in stages for rec in s.get("jobs", {}).values() if rec.get("status") != "ok"]
    if not bad:
        lines.append("None: every run succeeded at its first attempt.")
    else:
        lines += ["| stage | run | status | attempts | what happened |", "|---|---|---|---|---|"]
        for k, rec in bad:
            why = "; ".join(f"{a['n']}: {a.get('reason') or 'ok'} (rc {a.get('rc')})" for a in rec["attempts"])
            lines.append(f"| {k} | {rec['name']} | {rec['status']} | {len(rec['attempts'])} | {why} |")
    lines.append("")
    report = out / "report.md"
    report.write_text("\n".join(lines))
    if out.resolve() != campaign_dir.resolve():
        shutil.copy(campaign_dir / "campaign.json", out / "campaign.json")
        for s in state["stages"]:
            src = campaign_dir / f"stage{s['index']}" / "blueprints.yaml"
            if src.exists():
                (out / f"stage{s['index']}").mkdir(exist_ok=True)
                shutil.copy(src, out / f"stage{s['index']}" / "blueprints.yaml")
    return report
