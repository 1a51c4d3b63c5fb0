"""The campaign: plan -> run -> analyse, stage after stage, then the report.

Everything lives in the campaign folder: ``campaign.json`` (the goal, the
constraints, the settings, every stage with its blueprints, job records and
analysis, and the trace of decisions), rewritten atomically after every
transition, and ``stage<K>/`` (``blueprints.yaml``, the jobs, their logs and
run folders). :meth:`Campaign.run` picks up where the record stops, so a
campaign whose research process was killed resumes with the same command plus
``resume=true``: an analysed stage is not run again, a stage under way
finishes only its unfinished jobs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from swarmkit.errors import SwarmkitError
from swarmkit.research.analysis import read_run, summarize
from swarmkit.research.blueprint import DEFAULT_COMMAND, Blueprint, BlueprintError, parse_blueprints
from swarmkit.research.executor import Budget, job_name, run_dir, run_stage
from swarmkit.research.planner import StagePlan, StudySpec, conclude, parse_spec
from swarmkit.runfiles import write_json


class Leader(Protocol):
    name: str

    def next_stage(self, goal: str, constraints: dict[str, Any], stages: list[dict[str, Any]],
                   max_stages: int) -> StagePlan | None: ...


@dataclass
class Settings:
    """How a campaign runs (kept in its record; resource settings may change on resume)."""

    planner: str = "offline"
    parallel: int = 2
    retries: int = 1
    timeout_s: float = 0.0
    gpus: str = ""
    threads_per_job: int = 1
    max_stages: int = 3
    #: STAGE:KEY@STEP: SIGKILL that job's first attempt after STEP steps (tests, the worked study)
    inject_crash: str = ""
    llm_url: str = ""
    llm_model: str = ""
    report_dir: str = ""


def _finite(obj: Any) -> Any:
    """NaN/inf as None, recursively (the record is strict JSON)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class CampaignError(SwarmkitError):
    """A campaign cannot start or resume as asked."""


class Campaign:
    """One research campaign and its record in ``dir/campaign.json``."""

    def __init__(self, dir: Path, state: dict[str, Any]):
        self.dir = dir
        self.state = state
        self.settings = Settings(**state["settings"])

    @property
    def path(self) -> Path:
        return self.dir / "campaign.json"

    @classmethod
    def create(cls, dir: Path, goal: str, constraints: dict[str, Any], settings: Settings) -> Campaign:
        if (dir / "campaign.json").exists():
            raise CampaignError(f"{dir} already holds a campaign: resume it with resume=true, or choose another dir=")
        state = {"version": 1, "goal": goal, "constraints": constraints, "settings": asdict(settings),
                 "status": "running", "created": time.time(), "stages": [], "trace": [], "conclusion": []}
        campaign = cls(dir, state)
        campaign.save()
        return campaign

    @classmethod
    def load(cls, dir: Path, overrides: dict[str, Any] | None = None) -> Campaign:
        if not (dir / "campaign.json").exists():
            raise CampaignError(f"no campaign to resume in {dir} (no campaign.json)")
        state = json.loads((dir / "campaign.json").read_text())
        state["settings"].update(overrides or {})
        return cls(dir, state)

    def save(self) -> None:
        self.state["settings"] = asdict(self.settings)
        write_json(self.path, _finite(self.state), default=str, allow_nan=False)

    def trace(self, stage: int | None, actor: str, kind: str, text: str) -> None:
        """One row of the campaign's trace (the report's Table-4-like record)."""
        self.state["trace"].append({"time": time.time(), "stage": stage, "actor": actor, "kind": kind, "text": text})
        self.save()

    def spec(self) -> StudySpec | None:
        try:
            return parse_spec(self.state["constraints"], self.state["goal"])
        except BlueprintError:
            return None

    # ------------------------------------------------------------------ the loop
    def run(self, leader: Leader, check_overrides: Callable[[list[str]], list[str]] | None = None,
            say: Callable[[str], None] = print) -> Path:
        """Plan, run and analyse stages until the leader stops or the limit; then the report's path."""
        if self.state["status"] == "done":
            say(f"the campaign in {self.dir} is done; rewriting its report")
        while self.state["status"] != "done":
            stages = self.state["stages"]
            stage = stages[-1] if stages and stages[-1]["status"] != "analysed" else None
            if stage is None:
                analysed = [s for s in stages if s["status"] == "analysed"]
                plan = leader.next_stage(self.state["goal"], self.state["constraints"], analysed,
                                         self.settings.max_stages)
                if plan is None:
                    break
                stage = self._add_stage(plan, leader.name, check_overrides, say)
            if stage["status"] in ("planned", "running"):
                self._run_stage(stage, say)
            if stage["status"] == "ran":
                self._analyse(stage, say)
        return self.finish(leader, say)

    def _add_stage(self, plan: StagePlan, leader_name: str,
                   check_overrides: Callable[[list[str]], list[str]] | None, say: Callable[[str], None]) -> dict[str, Any]:
        k = len(self.state["stages"]) + 1
        if check_overrides is not None:
            problems = [f"{bp.name}: {p}" for bp in plan.blueprints if bp.command == DEFAULT_COMMAND
                        for p in check_overrides(bp.override_args())]
            if problems:
                raise BlueprintError(f"stage {k}'s blueprints do not configure a run:\n  " + "\n  ".join(problems))
        stage = {"index": k, "status": "planned", "leader": leader_name, "rationale": plan.rationale,
                 "blueprints": [bp.to_dict() for bp in plan.blueprints], "planned": time.time()}
        self.state["stages"].append(stage)
        folder = self.dir / f"stage{k}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "blueprints.yaml").write_text(yaml.safe_dump(stage["blueprints"], sort_keys=False))
        runs = sum(len(bp.seeds) for bp in plan.blueprints)
        self.trace(k, "leader", "plan", f"{len(plan.blueprints)} blueprints, {runs} runs: {plan.rationale}")
        say(f"stage {k} planned ({leader_name}): {len(plan.blueprints)} blueprints, {runs} runs: {plan.rationale}")
        return stage

    def _budget(self, k: int) -> Budget:
        crash = ""
        if self.settings.inject_crash:
            where, _, what = self.settings.inject_crash.partition(":")
            if what and where == str(k):
                crash = what
        s = self.settings
        return Budget(parallel=s.parallel, retries=s.retries, timeout_s=s.timeout_s, gpus=s.gpus,
                      threads_per_job=s.threads_per_job, inject_crash=crash)

    def _run_stage(self, stage: dict[str, Any], say: Callable[[str], None]) -> None:
        k = stage["index"]
        blueprints = parse_blueprints(stage["blueprints"], f"stage{k}.blueprints")
        budget = self._budget(k)
        resumed = stage["status"] == "running"
        stage["status"] = "running"
        stage.setdefault("started", time.time())
        self.trace(k, "worker", "dispatch",
                   f"{'resumed' if resumed else 'dispatched'} {sum(len(b.seeds) for b in blueprints)} runs as a "
                   f"Hydra multirun, {budget.parallel} in parallel"
                   + (f" on GPUs {budget.gpus}" if budget.gpus else " on CPU")
                   + f", {budget.retries} retr{'y' if budget.retries == 1 else 'ies'} per run")

        def on_job(rec: dict[str, Any]) -> None:
            att = rec.get("attempts", [])
            secs = (att[-1].get("ended") or 0) - (att[-1].get("started") or 0) if att else 0
            say(f"  stage {k} {rec['name']}: {rec['status']} ({len(att)} attempt(s), {secs:.0f} s)")
            if rec["status"] != "ok":
                why = "; ".join(f"attempt {a['n']}: {a.get('reason') or 'ok'}" for a in att)
                self.trace(k, "worker", rec["status"], f"{rec['name']}: {why}")

        records = run_stage(self.dir / f"stage{k}", blueprints, budget, on_job=on_job)
        stage["jobs"] = records
        stage["status"] = "ran"
        stage["ended"] = time.time()
        counts = {s: sum(1 for r in records.values() if r["status"] == s) for s in ("ok", "retried", "failed")}
        self.trace(k, "worker", "ran", f"{len(records)} runs in {stage['ended'] - stage['started']:.0f} s: "
                   + ", ".join(f"{n} {s}" for s, n in counts.items()))

    def _analyse(self, stage: dict[str, Any], say: Callable[[str], None]) -> None:
        k = stage["index"]
        folder = self.dir / f"stage{k}"
        results, runs = [], []
        for bp in parse_blueprints(stage["blueprints"], f"stage{k}.blueprints"):
            bp_runs = [read_run(bp.name, s, str(run_dir(folder, bp, s)), stage["jobs"].get(job_name(bp, s), {}),
                                bp.metric) for s in bp.seeds]
            runs += [{**asdict(r), "curve": None} for r in bp_runs]
            results.append(summarize(bp.name, bp.overrides, bp.metric, bp_runs).to_dict())
        stage["results"] = results
        stage["runs"] = runs
        stage["status"] = "analysed"
        spec = self.spec()
        lines = conclude(spec, [*[s for s in self.state["stages"] if s["status"] == "analysed"]]) if spec else []
        best = " | ".join(f"{r['blueprint']} {_fmt(r)}" for r in results)
        self.trace(k, "leader", "analysis", best + (" => " + "; ".join(lines) if lines else ""))
        say(f"stage {k} analysed: {best}")
        for line in lines:
            say(f"  {line}")

    def finish(self, leader: Leader, say: Callable[[str], None]) -> Path:
        from swarmkit.research.report import write_report

        spec = self.spec() or StudySpec(shape="grid")
        lines = conclude(spec, [s for s in self.state["stages"] if s["status"] == "analysed"])
        llm_conclusion = getattr(leader, "conclusion", "")
        if llm_conclusion:
            lines = [f"the leader's conclusion: {llm_conclusion}", *lines]
        if self.state["status"] != "done":
            self.state["conclusion"] = lines
            self.state["status"] = "done"
            self.state["finished"] = time.time()
            self.trace(None, "leader", "report", "; ".join(lines))
        out = Path(self.settings.report_dir) if self.settings.report_dir else self.dir / "report"
        report = write_report(self.state, out, self.dir)
        say(f"report: {report}")
        return report


def _fmt(r: dict[str, Any]) -> str:
    m, c = r.get("mean"), r.get("ci95")
    if m is None:
        return "n/a"
    return f"{m:.3f}" + (f"±{c:.3f}" if c is not None else "")


def load_blueprints_file(path: Path) -> list[Blueprint]:
    """Blueprints from a YAML file (a list, or a mapping with ``blueprints``)."""
    data = yaml.safe_load(path.read_text())
    if isinstance(data, dict) and "blueprints" in data:
        data = data["blueprints"]
    return parse_blueprints(data, str(path))
