"""Automated research, the fast parts: blueprints, planners, analysis maths, the launcher's
watchdog (on stand-in jobs), the report, the CLI, and the LLM leader's protocol against a
scripted OpenAI-compatible endpoint on 127.0.0.1."""

from __future__ import annotations

import json
import math
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from hydra_plugins.swarmkit_launcher.subprocess_launcher import JobRunner, JobSpec
from swarmkit.research.analysis import (
    RunResult,
    mean_ci,
    mean_curve,
    read_metric,
    summarize,
    t95,
    threshold_crossing,
)
from swarmkit.research.blueprint import Blueprint, BlueprintError, parse_blueprints
from swarmkit.research.cli import main as research_main
from swarmkit.research.cli import parse_args
from swarmkit.research.leader import LeaderError, LLMLeader, parse_plan
from swarmkit.research.planner import (
    OfflineLeader,
    between,
    conclude,
    geometric_points,
    infer_shape,
    parse_spec,
)

GOOD = {"name": "bs4", "objective": "eval at bs 4", "hypothesis": "learns", "overrides": {"batching.batch_size": 4},
        "seeds": [0, 1]}


# --------------------------------------------------------------------------- blueprints
def test_a_valid_blueprint_gets_its_defaults():
    (bp,) = parse_blueprints([GOOD])
    assert bp.metric == "eval_after" and bp.output == "bs4" and bp.command == ["python", "-m", "swarmkit"]
    assert bp.override_args() == ["batching.batch_size=4"]
    assert Blueprint("x", "o", "h", {"a": True, "b": [1, 2], "c": None}).override_args() == ["a=true", "b=[1,2]",
                                                                                              "c=null"]


def test_every_problem_of_a_plan_is_named_by_its_field():
    bad = [{**GOOD, "seeds": "abc", "budget_s": -1, "colour": "red"},
           {"name": "bad name!", "objective": "", "overrides": {"seed": 3}},
           GOOD, GOOD]
    with pytest.raises(BlueprintError) as err:
        parse_blueprints(bad)
    text = str(err.value)
    for needle in ("blueprints[0].seeds: expected a non-empty list of integers", "blueprints[0].budget_s",
                   "blueprints[0].colour: unknown field", "blueprints[1].name: expected a folder name",
                   "blueprints[1].objective: expected a non-empty string", "blueprints[1].hypothesis: missing",
                   "blueprints[1].overrides: 'seed' is set by the executor", "names repeat: bs4"):
        assert needle in text, text
    with pytest.raises(BlueprintError, match="expected a non-empty list"):
        parse_blueprints({"name": "x"})


# --------------------------------------------------------------------------- analysis maths
def test_mean_ci_is_students_t():
    m, hw = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and hw == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci([0.5])[0] == 0.5 and math.isnan(mean_ci([0.5])[1])
    assert all(math.isnan(v) for v in mean_ci([]))
    assert mean_ci([1.0, None, float("nan"), 3.0])[0] == 2.0  # type: ignore[list-item]
    assert t95(1) == 12.706 and t95(100) == 1.96


def test_mean_curve_and_threshold_crossing():
    curve = mean_curve([[(1, 0.0), (2, 1.0)], [(1, 1.0)]])
    assert curve[0][:2] == (1, 0.5) and curve[1][:2] == (2, 1.0) and math.isnan(curve[1][2])
    assert threshold_crossing([(1, 0.1), (4, 0.6), (16, 0.9)], 0.5) == (1, 4)
    assert threshold_crossing([(4, 0.6), (1, 0.7)], 0.5) == (None, 1)
    assert threshold_crossing([(1, 0.1), (4, 0.2)], 0.5) == (None, None)


def test_read_metric_from_a_run_folder(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"eval_after": {"mean": 0.75, "ci95": 0.1}, "improvement": 0.5}))
    rows = [{"kind": "train", "step": i, "reward_mean": r} for i, r in enumerate([0.1, 0.2, 0.3, 0.6], 1)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "tr')
    assert read_metric(tmp_path, "eval_after") == 0.75
    assert read_metric(tmp_path, "improvement") == 0.5
    assert read_metric(tmp_path, "train.reward_mean") == pytest.approx((0.2 + 0.3 + 0.6) / 3)
    assert read_metric(tmp_path, "nothing.here") is None
    runs = [RunResult("a", 0, "", "ok", 1, 0.5), RunResult("a", 1, "", "retried", 2, 0.7),
            RunResult("a", 2, "", "failed", 2, None)]
    agg = summarize("a", {"x": 1}, "eval_after", runs)
    assert agg.n == 2 and agg.failed == 1 and agg.mean == pytest.approx(0.6)


# --------------------------------------------------------------------------- planners
SPEC = {"shape": "threshold", "base": {"model": "tiny"}, "factor": "batching.batch_size", "range": [1, 16],
        "cross": {"task.max_tokens": [8, 4]}, "threshold": 0.5, "seeds": [0, 1]}


def _result(bs: int, mt: int, mean: float) -> dict[str, Any]:
    return {"blueprint": f"b{bs}m{mt}", "overrides": {"model": "tiny", "batching.batch_size": bs,
                                                      "task.max_tokens": mt}, "mean": mean, "ci95": 0.1, "n": 2}


def test_threshold_planner_coarse_then_refine_and_cross():
    spec = parse_spec(SPEC)
    leader = OfflineLeader(spec)
    first = leader.next_stage("g", SPEC, [], 3)
    assert first is not None
    assert [bp.overrides["batching.batch_size"] for bp in first.blueprints] == [1, 4, 16]
    assert {bp.overrides["task.max_tokens"] for bp in first.blueprints} == {8}
    assert all(bp.seeds == [0, 1] and bp.overrides["model"] == "tiny" for bp in first.blueprints)
    stage1 = {"results": [_result(1, 8, 0.1), _result(4, 8, 0.3), _result(16, 8, 0.8)]}
    second = leader.next_stage("g", SPEC, [stage1], 3)
    assert second is not None
    got = sorted((bp.overrides["task.max_tokens"], bp.overrides["batching.batch_size"]) for bp in second.blueprints)
    # refine 4..16 at max_tokens=8; max_tokens=4 at the bracket and the same refinement
    assert got == [(4, 4), (4, 6), (4, 10), (4, 16), (8, 6), (8, 10)], got
    stage2 = {"results": [_result(6, 8, 0.4), _result(10, 8, 0.6), _result(4, 4, 0.2), _result(6, 4, 0.3),
                          _result(10, 4, 0.45), _result(16, 4, 0.7)]}
    third = leader.next_stage("g", SPEC, [stage1, stage2], 3)
    assert third is not None
    assert sorted((bp.overrides["task.max_tokens"], bp.overrides["batching.batch_size"])
                  for bp in third.blueprints) == [(4, 12), (4, 14), (8, 7), (8, 8)]
    assert leader.next_stage("g", SPEC, [stage1, stage2, {"results": []}], 3) is None  # the stage limit
    lines = conclude(spec, [stage1, stage2])
    assert any(ln.startswith("task.max_tokens=8: the smallest batching.batch_size") and " is 10 " in ln
               and "6 does not" in ln and "intervals include the threshold" in ln for ln in lines), lines
    assert any(ln.startswith("task.max_tokens=4:") and " is 16 " in ln for ln in lines), lines
    assert "task.max_tokens changes the minimum" in lines[-1] and "0 of 2 brackets resolved" in lines[-1]
    sure = [_result(1, 8, 0.1), _result(4, 8, 0.9)]
    assert "intervals separate them" in conclude(spec, [{"results": sure}])[0]


def test_other_study_shapes():
    grid = {"shape": "grid", "factor": "optim.lr", "values": [0.1, 0.01], "cross": {"task.max_tokens": [4, 8]}}
    plan = OfflineLeader(parse_spec(grid)).next_stage("g", grid, [], 3)
    assert plan is not None and len(plan.blueprints) == 4
    assert OfflineLeader(parse_spec(grid)).next_stage("g", grid, [{"results": []}], 3) is None
    halving = {"shape": "halving", "factor": "optim.lr", "values": [1, 2, 3, 4], "budgets": [2, 4], "eta": 2}
    leader = OfflineLeader(parse_spec(halving))
    first = leader.next_stage("g", halving, [], 3)
    assert first is not None and {bp.overrides["trainer.total_steps"] for bp in first.blueprints} == {2}
    results = [{"blueprint": f"lr{v}", "overrides": {"optim.lr": v, "trainer.total_steps": 2}, "mean": v / 10}
               for v in (1, 2, 3, 4)]
    second = leader.next_stage("g", halving, [{"results": results}], 3)
    assert second is not None
    assert sorted(bp.overrides["optim.lr"] for bp in second.blueprints) == [3, 4]
    assert {bp.overrides["trainer.total_steps"] for bp in second.blueprints} == {4}
    ablation = {"shape": "ablation", "baseline": {"optim.lr": 0.01}, "ablations": {"optim.lr": [0.1], "match": ["none"]}}
    plan = OfflineLeader(parse_spec(ablation)).next_stage("g", ablation, [], 3)
    assert plan is not None and [bp.name for bp in plan.blueprints] == ["baseline", "lr0.1", "matchnone"]
    assert plan.blueprints[2].overrides == {"optim.lr": 0.01, "match": "none"}
    assert infer_shape("find the minimum batch size") == "threshold" and infer_shape("sweep lr") == "grid"
    assert geometric_points(1, 16, 4) == [1, 4, 16] and geometric_points(1, 12, 4) == [1, 4, 12]
    assert between(1, 4) == [2, 3] and between(4, 16) == [6, 10]


def test_bad_constraints_are_listed():
    with pytest.raises(BlueprintError) as err:
        parse_spec({"shape": "threshold", "range": [4], "colour": 1, "seeds": []})
    text = str(err.value)
    assert "constraints.colour: unknown key" in text and "constraints.factor: required" in text
    assert "constraints.range" in text and "constraints.seeds" in text


# --------------------------------------------------------------------------- the launcher's watchdog
JOB = """
import json, os, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = args["hydra.run.dir"].strip("'"); os.makedirs(run, exist_ok=True)
with open(os.path.join(run, "metrics.jsonl"), "a") as f:
    for step in range(1, int(args.get("steps", 3)) + 1):
        f.write(json.dumps({"kind": "train", "step": step}) + "\\n"); f.flush(); time.sleep(0.2)
time.sleep(float(args.get("sleep", 0)))
open(os.path.join(run, "done"), "w").write("1")
sys.exit(int(args.get("rc", 0)))
"""


def _jobs(tmp_path: Path, specs: dict[str, list[str]]) -> list[JobSpec]:
    return [JobSpec(name=name, overrides=ov, dir=str(tmp_path / "runs" / name), command=[sys.executable, "-c", JOB])
            for name, ov in specs.items()]


def test_launcher_runs_in_parallel_retries_crashes_kills_hung_jobs_and_resumes(tmp_path):
    state = tmp_path / "state.json"
    jobs = _jobs(tmp_path, {"ok": [], "crash": ["rc=3"], "hung": ["sleep=60"], "killed": ["steps=4"]})
    runner = JobRunner(max_parallel=4, timeout_s=4, retries=1, state=str(state), log_dir=str(tmp_path / "logs"),
                       inject_crash="killed@2", poll_s=0.1)
    records = runner.run(jobs)
    assert records["ok"]["status"] == "ok" and len(records["ok"]["attempts"]) == 1
    assert records["crash"]["status"] == "failed" and [a["rc"] for a in records["crash"]["attempts"]] == [3, 3]
    assert records["hung"]["status"] == "failed" and "timeout after 4 s" in records["hung"]["attempts"][0]["reason"]
    killed = records["killed"]
    assert killed["status"] == "retried" and killed["attempts"][0]["reason"] == "injected crash at step 2"
    assert Path(killed["attempts"][0]["moved_to"]).name == "killed.attempt1"  # the crashed run kept aside
    assert (tmp_path / "runs" / "killed" / "done").exists()
    assert Path(killed["attempts"][1]["log"]).exists()
    starts = sorted(r["attempts"][0]["started"] for r in records.values())
    assert starts[-1] - starts[0] < 2  # all four started together
    on_disk = json.loads(state.read_text())["jobs"]
    assert {k: v["status"] for k, v in on_disk.items()} == {k: v["status"] for k, v in records.items()}
    # a second launch with the same record runs nothing again
    again = JobRunner(max_parallel=4, state=str(state), poll_s=0.1).run(jobs)
    assert {k: len(v["attempts"]) for k, v in again.items()} == {k: len(v["attempts"]) for k, v in records.items()}


def test_launcher_resume_reruns_what_was_cut_short(tmp_path):
    state = tmp_path / "state.json"
    jobs = _jobs(tmp_path, {"a": [], "b": []})
    state.write_text(json.dumps({"jobs": {
        "a": {"name": "a", "status": "ok", "attempts": [{"n": 1, "rc": 0, "reason": None}], "dir": jobs[0].dir},
        "b": {"name": "b", "status": "running", "attempts": [{"n": 1, "rc": None, "reason": None}],
              "dir": jobs[1].dir}}}))
    records = JobRunner(state=str(state), retries=0, poll_s=0.1).run(jobs)
    assert len(records["a"]["attempts"]) == 1 and not Path(jobs[0].dir).exists()  # a: not run again
    assert records["b"]["status"] == "ok" and records["b"]["attempts"][0]["reason"] == "interrupted"
    assert JobRunner.counted_failures(records["b"]) == 0


def test_launcher_hands_out_gpus_one_per_job(tmp_path):
    script = "import os,sys; a=dict(x.split('=',1) for x in sys.argv[1:]); d=a['hydra.run.dir'].strip(\"'\");" \
             " os.makedirs(d); open(d+'/gpu','w').write(os.environ['CUDA_VISIBLE_DEVICES'])"
    jobs = [JobSpec(name=f"j{i}", overrides=[], dir=str(tmp_path / f"j{i}"), command=[sys.executable, "-c", script])
            for i in range(3)]
    runner = JobRunner(max_parallel=8, gpus="2,5", poll_s=0.05)
    assert runner.parallel == 2
    runner.run(jobs)
    assert {(tmp_path / f"j{i}" / "gpu").read_text() for i in range(3)} <= {"2", "5"}


# --------------------------------------------------------------------------- the LLM leader
PLAN = {"done": False, "rationale": "coarse grid first",
        "blueprints": [{"name": "bs1", "objective": "o", "hypothesis": "h", "overrides": {"batching.batch_size": 1},
                        "seeds": [0]},
                       {"name": "bs4", "objective": "o", "hypothesis": "h", "overrides": {"batching.batch_size": 4},
                        "seeds": [0, 1], "budget_s": 60}]}


class _Endpoint:
    """A scripted OpenAI-compatible chat endpoint: replies in order, requests kept."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                content = outer.replies.pop(0) if outer.replies else "{}"
                data = json.dumps({"id": "x", "object": "chat.completion", "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def endpoint():
    made: list[_Endpoint] = []

    def make(replies: list[str]) -> _Endpoint:
        made.append(_Endpoint(replies))
        return made[-1]

    yield make
    for e in made:
        e.close()


def test_llm_leader_plans_a_stage_from_a_fixed_reply(endpoint):
    ep = endpoint(["Here is the plan:\n```json\n" + json.dumps(PLAN) + "\n```",
                   json.dumps({"done": True, "conclusion": "bs 4 is enough"})])
    leader = LLMLeader(ep.url, "leader-model", "sk-test")
    stages = [{"index": 0, "rationale": "r", "results": [{"blueprint": "x", "mean": 0.3, "ci95": 0.1}]}]
    plan = leader.next_stage("find the minimum batch size", {"range": [1, 16]}, stages, 3)
    assert plan is not None and plan.rationale == "coarse grid first"
    assert [bp.name for bp in plan.blueprints] == ["bs1", "bs4"] and plan.blueprints[1].budget_s == 60.0
    req = ep.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["model"] == "leader-model"
    system, user = req["body"]["messages"]
    assert "overrides:" in system["content"] and "budget_s" in system["content"]  # the schema
    assert "find the minimum batch size" in user["content"] and '"mean": 0.3' in user["content"]
    assert leader.next_stage("g", {}, stages, 3) is None and leader.conclusion == "bs 4 is enough"


def test_llm_leader_retries_a_malformed_plan_then_rejects_it_clearly(endpoint):
    broken = json.dumps({"rationale": "x", "blueprints": [{"name": "bs1", "overrides": {"seed": 1}, "seeds": "0"}]})
    ep = endpoint([broken, json.dumps(PLAN)])
    plan = LLMLeader(ep.url, "m").next_stage("g", {}, [], 3)
    assert plan is not None and len(ep.requests) == 2
    retry = ep.requests[1]["body"]["messages"][-1]["content"]
    assert "plan.blueprints[0].seeds" in retry and "plan.blueprints[0].objective: missing" in retry

    ep = endpoint([broken, "not json at all: [", broken])
    with pytest.raises(LeaderError) as err:
        LLMLeader(ep.url, "m", max_attempts=3).next_stage("g", {}, [], 3)
    text = str(err.value)
    assert "malformed 3 time(s)" in text and "plan.blueprints[0].seeds: expected a non-empty list" in text
    assert "plan.blueprints[0].overrides: 'seed' is set by the executor" in text and len(ep.requests) == 3


def test_parse_plan_checks_overrides_and_fields():
    with pytest.raises(BlueprintError, match="plan.blueprints\\[0\\].overrides: optim.lrr: unknown key"):
        parse_plan(json.dumps(PLAN), check_overrides=lambda args: ["optim.lrr: unknown key"] if args else [])
    with pytest.raises(BlueprintError, match="plan.done: expected true or false"):
        parse_plan(json.dumps({**PLAN, "done": "no"}))
    with pytest.raises(BlueprintError, match="expected a JSON object"):
        parse_plan("[1, 2]")
    assert parse_plan("done: true\nconclusion: yes") is None


def test_llm_leader_unreachable_is_a_clear_error():
    with pytest.raises(LeaderError, match="could not be reached"):
        LLMLeader("http://127.0.0.1:9/v1", "m", timeout_s=2).next_stage("g", {}, [], 3)


# --------------------------------------------------------------------------- report and command line
def test_report_writes_markdown_plots_and_lists_retried_runs(tmp_path):
    pytest.importorskip("matplotlib")
    from swarmkit.research.report import write_report

    res = [{**_result(bs, 8, m), "metric": "eval_after", "failed": 0, "curve": [[1, 0.1, 0.05], [2, m, None]]}
           for bs, m in ((1, 0.2), (4, 0.7))]
    job = {"name": "b4m8/seed0", "status": "retried",
           "attempts": [{"n": 1, "rc": -9, "reason": "injected crash at step 2"}, {"n": 2, "rc": 0, "reason": None}]}
    state = {"goal": "the goal", "constraints": {**SPEC, "factor": "batching.batch_size"}, "created": 0.0,
             "finished": 60.0, "conclusion": ["bs 4 learns"], "settings": {"planner": "offline", "parallel": 2,
                                                                           "retries": 1, "gpus": ""},
             "stages": [{"index": 1, "status": "analysed", "leader": "offline", "rationale": "coarse",
                         "results": res, "jobs": {"b4m8/seed0": job}}],
             "trace": [{"time": 1.0, "stage": 1, "actor": "leader", "kind": "plan", "text": "2 blueprints"}]}
    (tmp_path / "campaign.json").write_text(json.dumps(state))
    report = write_report(state, tmp_path / "out", tmp_path)
    text = report.read_text()
    assert "## Findings" in text and "- bs 4 learns" in text and "| 1 | +0:01 | 1 | leader | plan |" in text
    assert "| 1 | b4m8/seed0 | retried | 2 | 1: injected crash at step 2 (rc -9); 2: ok (rc 0) |" in text
    assert "0.700 ± 0.100" in text
    assert (tmp_path / "out" / "metric.png").stat().st_size > 1000 and (tmp_path / "out" / "curves.png").exists()
    assert (tmp_path / "out" / "campaign.json").exists()


def test_cli_arguments(capsys, tmp_path):
    assert research_main(["--help"]) == 0 and "planner=offline|llm" in capsys.readouterr().out
    opts = parse_args(["goal=a b", "parallel=3", "resume", "constraints.seeds=[0,1]", "gpus=0,1"])
    assert opts["goal"] == "a b" and opts["parallel"] == 3 and opts["resume"] is True and opts["gpus"] == "0,1"
    assert opts["constraint_overrides"] == {"seeds": [0, 1]}
    assert research_main(["colour=red"]) == 2 and "colour: unknown argument" in capsys.readouterr().err
    assert research_main([f"dir={tmp_path}", "resume"]) == 2 and "no campaign to resume" in capsys.readouterr().err
    assert research_main(["goal=x", "constraints={shape: threshold}", f"dir={tmp_path}"]) == 2
    assert "constraints.factor: required" in capsys.readouterr().err
    assert research_main(["study=min_batch_quick", "plan_only"]) == 0
    out = capsys.readouterr().out
    assert "# stage 1: coarse geometric grid [1, 4]" in out and "batching.batch_size: 4" in out


def test_cli_plans_with_the_llm_leader(endpoint, capsys, monkeypatch):
    ep = endpoint([json.dumps(PLAN)])
    monkeypatch.setenv("SWARMKIT_LLM_KEY", "sk-env")
    assert research_main(["goal=find the minimum batch size", "planner=llm", f"llm.url={ep.url}", "llm.model=m",
                          "plan_only"]) == 0
    out = capsys.readouterr().out
    assert "# stage 1: coarse grid first" in out and "name: bs4" in out
    assert ep.requests[0]["auth"] == "Bearer sk-env"
    bad = endpoint(["{}", "{}"])
    assert research_main(["goal=g", "planner=llm", f"llm.url={bad.url}", "llm.model=m", "plan_only"]) == 2
    err = capsys.readouterr().err
    assert "malformed 2 time(s)" in err and "plan.rationale: missing" in err


def test_cli_plans_a_blueprint_file(tmp_path, capsys):
    import yaml

    path = tmp_path / "bp.yaml"
    path.write_text(yaml.safe_dump({"blueprints": [PLAN["blueprints"][0]]}))
    assert research_main(["goal=g", f"blueprints={path}", "plan_only"]) == 0
    assert "# stage 1: 1 blueprints from a file" in capsys.readouterr().out
    path.write_text(yaml.safe_dump([{"name": "x"}]))
    assert research_main(["goal=g", f"blueprints={path}", "plan_only"]) == 2
    assert "[0].objective: missing" in capsys.readouterr().err


STAND_IN = """
import json, os, sys
args = dict(a.split("=", 1) for a in sys.argv[1:])
run = args["hydra.run.dir"].strip("'"); os.makedirs(run, exist_ok=True)
x, seed = float(args["x"]), int(args["seed"])
with open(os.path.join(run, "metrics.jsonl"), "w") as f:
    for step in range(1, 4):
        f.write(json.dumps({"kind": "train", "step": step, "reward_mean": x * step / 30}) + "\\n")
json.dump({"eval_after": {"mean": x / 10 + seed / 100}}, open(os.path.join(run, "summary.json"), "w"))
"""


def test_an_llm_led_campaign_of_two_stages_with_stand_in_runs(endpoint, tmp_path, capsys):
    """The whole loop fast: the LLM plans, the stage runs as a Hydra multirun, its analysis goes into the
    next prompt, the leader's conclusion opens the report (the runs are a stand-in script, not training)."""
    pytest.importorskip("matplotlib")

    def bp(x: int) -> dict[str, Any]:
        return {"name": f"x{x}", "objective": "o", "hypothesis": "h", "overrides": {"x": x}, "seeds": [0, 1],
                "command": [sys.executable, "-c", STAND_IN], "budget_s": 60}

    ep = endpoint([json.dumps({"rationale": "two points", "blueprints": [bp(1), bp(5)]}),
                   json.dumps({"rationale": "go higher", "blueprints": [bp(8)]}),
                   json.dumps({"done": True, "conclusion": "x=8 is best"})])
    camp = tmp_path / "camp"
    assert research_main(["goal=find the best x", "planner=llm", f"llm.url={ep.url}", "llm.model=m",
                          f"dir={camp}", "parallel=2"]) == 0, capsys.readouterr().err
    assert len(ep.requests) == 3
    second = ep.requests[1]["body"]["messages"][1]["content"]
    assert '"blueprint": "x5"' in second and '"mean": 0.505' in second  # stage 1's analysis in the prompt
    state = json.loads((camp / "campaign.json").read_text())
    assert state["status"] == "done" and [len(s["results"]) for s in state["stages"]] == [2, 1]
    assert state["stages"][1]["results"][0]["mean"] == pytest.approx(0.805)
    report = (camp / "report" / "report.md").read_text()
    assert "- the leader's conclusion: x=8 is best" in report and "*llm leader:* go higher" in report
    assert (camp / "stage1" / "jobs_state.json").exists() and (camp / "report" / "curves.png").exists()
