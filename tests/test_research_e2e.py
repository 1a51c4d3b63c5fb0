"""Automated research end to end on the tiny model: the worked study's small sibling
(``study=min_batch_quick``) with the offline planner, two stages of parallel runs, an injected
crash that is retried, the research process SIGKILLed mid-campaign and resumed to completion
without running finished runs again, and the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

CRASH = "batch_size4-max_tokens4/seed0"


def _jobs(camp: Path) -> dict[tuple[int, str], dict[str, Any]]:
    out = {}
    for path in sorted(camp.glob("stage*/jobs_state.json")):
        k = int(path.parent.name[len("stage"):])
        try:
            jobs = json.loads(path.read_text())["jobs"]
        except (OSError, ValueError):
            continue
        out.update({(k, name): rec for name, rec in jobs.items()})
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "State:\tZ" not in state


FINAL = ("ok", "retried", "failed")


def test_campaign_runs_retries_a_crash_survives_a_kill_and_reports(tmp_path):
    camp = tmp_path / "campaign"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "swarmkit", "research", "study=min_batch_quick", f"dir={camp}", "parallel=2",
           "retries=1", f"inject_crash=1:{CRASH}@2"]
    log = open(tmp_path / "first.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    # kill the research process as soon as a stage has a finished run and a run still under way
    deadline = time.time() + 240
    while True:
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.time() < deadline, "no stage got half way"
        jobs = _jobs(camp)
        stages = {k for k, _ in jobs}
        if any(any(r["status"] in FINAL for (s, _), r in jobs.items() if s == k)
               and any(r["status"] not in FINAL for (s, _), r in jobs.items() if s == k) for k in stages):
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    log.close()
    # the runs die with it (no orphaned training processes)
    running = [a["pid"] for r in _jobs(camp).values() for a in r["attempts"] if a.get("rc") is None]
    for _ in range(100):
        if not any(_alive(p) for p in running):
            break
        time.sleep(0.1)
    assert not any(_alive(p) for p in running), running
    finished = {key: (len(r["attempts"]), (Path(r["dir"]) / "summary.json").stat().st_mtime)
                for key, r in _jobs(camp).items() if r["status"] in ("ok", "retried")}
    assert finished
    state = json.loads((camp / "campaign.json").read_text())
    assert state["status"] == "running" and state["stages"][-1]["status"] == "running"

    out = subprocess.run([*cmd[:5], f"dir={camp}", "resume=true"], capture_output=True, text=True, env=env,
                         timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "resuming the campaign" in out.stdout and "finding:" in out.stdout
    jobs = _jobs(camp)
    for key, (attempts, mtime) in finished.items():  # finished runs were not run again
        assert len(jobs[key]["attempts"]) == attempts, key
        assert (Path(jobs[key]["dir"]) / "summary.json").stat().st_mtime == mtime, key
    crashed = jobs[(1, CRASH)]
    assert crashed["status"] == "retried", crashed
    assert crashed["attempts"][0]["reason"] == "injected crash at step 2" and crashed["attempts"][0]["rc"] == -9
    assert all(r["status"] in ("ok", "retried") for r in jobs.values()), jobs
    state = json.loads((camp / "campaign.json").read_text())
    assert state["status"] == "done" and len(state["stages"]) == 2
    assert all(s["status"] == "analysed" and len(s["results"]) == len(s["blueprints"]) >= 1 for s in state["stages"])
    assert all(isinstance(r["mean"], float) for s in state["stages"] for r in s["results"])
    kinds = [t["kind"] for t in state["trace"]]
    assert kinds.count("plan") == 2 and kinds.count("analysis") == 2 and "retried" in kinds and kinds[-1] == "report"
    assert any("resumed" in t["text"] for t in state["trace"] if t["kind"] == "dispatch")
    report = (camp / "report" / "report.md").read_text()
    assert "## Findings" in report and "## Trace of stages and decisions" in report
    assert f"| 1 | {CRASH} | retried |" in report and "injected crash at step 2" in report
    assert (camp / "report" / "metric.png").stat().st_size > 1000 and (camp / "report" / "curves.png").exists()
    # the stage ran as a Hydra multirun through the subprocess launcher
    assert (camp / "stage1" / ".multirun" / "multirun.yaml").exists()
