"""Running a stage: its blueprints as one Hydra multirun through swarmkit's subprocess launcher.

Each blueprint runs once per seed; the stage's jobs (name ``<blueprint>/seed<S>``,
overrides, folder, time limit) go to the launcher as a jobs file, and the
launcher runs them in parallel within the budget, kills hung runs, retries
crashed ones and records every job in ``<stage>/jobs_state.json``. Run again
after the research process was killed, the same command skips the jobs that
record says are finished.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmkit.errors import SwarmkitError
from swarmkit.procs import die_with_parent
from swarmkit.research.blueprint import Blueprint

#: the job statuses that end a job (``retried``: it succeeded after a failed attempt)
FINAL = ("ok", "retried", "failed")


class ExecutorError(SwarmkitError):
    """A stage could not be run (the multirun itself failed, not one of its jobs)."""


@dataclass
class Budget:
    """What one stage may use at once: parallel jobs, GPUs by index, threads per job."""

    parallel: int = 2
    retries: int = 1
    timeout_s: float = 0.0
    gpus: str = ""
    gpus_per_job: int = 1
    threads_per_job: int = 1
    inject_crash: str = ""


def job_name(bp: Blueprint, seed: int) -> str:
    return f"{bp.name}/seed{seed}"


def run_dir(stage_dir: Path, bp: Blueprint, seed: int) -> Path:
    return stage_dir / bp.output / f"seed{seed}"


def stage_jobs(stage_dir: Path, blueprints: Sequence[Blueprint], timeout_s: float = 0.0) -> list[dict[str, Any]]:
    """The launcher's jobs of a stage: every blueprint at every seed, a free port each; the time
    limit ``timeout_s`` if given, else the blueprint's budget."""
    return [{"name": job_name(bp, s), "overrides": [*bp.override_args(), f"seed={s}", "server.port=0"],
             "dir": str(run_dir(stage_dir, bp, s)), "timeout_s": timeout_s or bp.budget_s, "command": list(bp.command)}
            for bp in blueprints for s in bp.seeds]


def _quoted(value: object) -> str:
    """A value as a quoted string of Hydra's override grammar (a path may hold ',' or '=')."""
    return "'" + str(value).replace("'", "\\'") + "'"


def multirun_command(stage_dir: Path, budget: Budget) -> list[str]:
    """``python -m swarmkit --multirun`` with the launcher settings of this stage."""
    cmd = [sys.executable, "-m", "swarmkit", "--multirun", "hydra/launcher=swarmkit_subprocess",
           f"hydra.sweep.dir={_quoted(stage_dir / '.multirun')}",
           f"hydra.launcher.jobs_file={_quoted(stage_dir / 'jobs.json')}",
           f"hydra.launcher.state={_quoted(stage_dir / 'jobs_state.json')}",
           f"hydra.launcher.log_dir={_quoted(stage_dir / 'logs')}",
           f"hydra.launcher.max_parallel={budget.parallel}",
           f"hydra.launcher.retries={budget.retries}",
           f"hydra.launcher.timeout_s={budget.timeout_s}",
           f"hydra.launcher.threads_per_job={budget.threads_per_job}",
           f"hydra.launcher.gpus_per_job={budget.gpus_per_job}"]
    if budget.gpus:
        cmd.append(f"hydra.launcher.gpus={_quoted(budget.gpus)}")
    if budget.inject_crash:
        cmd.append(f"hydra.launcher.inject_crash={_quoted(budget.inject_crash)}")
    return cmd


def read_state(stage_dir: Path) -> dict[str, dict[str, Any]]:
    path = stage_dir / "jobs_state.json"
    if not path.exists():
        return {}
    jobs: dict[str, dict[str, Any]] = json.loads(path.read_text()).get("jobs", {})
    return jobs


def run_stage(stage_dir: Path, blueprints: Sequence[Blueprint], budget: Budget,
              on_job: Callable[[dict[str, Any]], None] | None = None) -> dict[str, dict[str, Any]]:
    """Run (or finish running) a stage; the launcher's record of every job, by name.

    ``on_job`` is called once per job that reaches a final status while this call watches.
    """
    stage_dir.mkdir(parents=True, exist_ok=True)
    jobs = stage_jobs(stage_dir, blueprints, budget.timeout_s)
    (stage_dir / "jobs.json").write_text(json.dumps(jobs, indent=1))
    before = {n for n, r in read_state(stage_dir).items() if r.get("status") in FINAL}
    if len(before) < len(jobs) or any(j["name"] not in before for j in jobs):
        log_path = stage_dir / "multirun.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(multirun_command(stage_dir, budget), stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "HYDRA_FULL_ERROR": "1"}, preexec_fn=die_with_parent)
            reported = set(before)
            while True:
                rc = proc.poll()
                for name, rec in read_state(stage_dir).items():
                    if rec.get("status") in FINAL and name not in reported:
                        reported.add(name)
                        if on_job:
                            on_job(rec)
                if rc is not None:
                    break
                time.sleep(0.5)
    state = read_state(stage_dir)
    unfinished = [j["name"] for j in jobs if state.get(j["name"], {}).get("status") not in FINAL]
    if unfinished:
        raise ExecutorError(f"the stage's multirun ended with {len(unfinished)} job(s) not run "
                            f"({', '.join(unfinished[:5])}); see {stage_dir / 'multirun.log'}")
    return {j["name"]: state[j["name"]] for j in jobs}
