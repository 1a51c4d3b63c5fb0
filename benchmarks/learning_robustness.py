"""Learning-robustness benchmark (issue 34): does a warm start followed by RL hold, across seeds and tasks?

For each task × seed it runs one whole training job in its own process with its
own run folder, and reads back the held-out reward before training, after the
supervised warm start and after RL, the held-out curve (every
``--eval-every`` steps) and the per-step training curve with the collapse
signals (``metrics.jsonl``: ``reward_mean``, ``collapse/identical_groups``,
``collapse/flat_groups``, ``collapse/entropy``, ``collapse/alarm``).

Tasks:

- ``calc_agent``: the tool calculator (one call per problem), through the main
  job (``python -m swarmkit task=calc_agent seed=S ...``);
- ``multi_calc``: two or three chained calculator calls per problem, one
  operation per call (``swarmkit/tasks/multi_calc.py``), through the main job;
- ``who_is_spy``: the spy game (``examples/who_is_spy/run.py adversarial``: the
  civilians learn on server A, the spies play frozen on server B); its "reward"
  is the civilians' held-out win rate (Wilson interval) and its warm start
  is the example's scripted clue player. Two servers per seed: heavy on a CPU.

A seed **collapsed** when any of these holds:

1. the collapse alarm fired (a ``collapse/alarm`` step or an alarm row in ``metrics.jsonl``);
2. held-out reward after RL is below after the warm start (before training, without one) by more
   than the 95% interval of that difference, ``sqrt(ci_warm² + ci_after²)`` (the seed's own intervals);
3. ``collapse/identical_groups`` ≥ 0.9 on the last training step.

Per task it prints the mean over seeds with a 95% t-interval over seeds of before / after the warm
start / after RL, and "k of n" collapsed; per seed one line; where the task says how each episode ended
(multi_calc's ``outcome/<kind>`` metrics: right, overshoot, chain_wrong, stopped_early, partial, off_chain,
malformed, no_call) how the RL rollouts ended, per seed, and per chain length of their problem (the trained
rollouts in the run's ``journal.sqlite``); and writes JSON (``--out``) with every seed's numbers, held-out
curve, per-step curve, ``rl_outcomes``, ``rl_outcomes_by_length``, how the held-out episodes ended after
the warm start and after RL (``warm_outcomes``, ``after_outcomes``, from the evaluations' ``outcomes``) and
the held-out reward per group of items, multi_calc's problem lengths (``warm_groups``, ``after_groups``).

    python benchmarks/learning_robustness.py                                   # 3 tasks x 5 seeds, SmolLM2
    python benchmarks/learning_robustness.py --tasks calc_agent,multi_calc --seeds 0,1 --steps 6 --warm-steps 4
    python benchmarks/learning_robustness.py --parallel 4                      # 4 jobs at once (a GPU box)
    python benchmarks/learning_robustness.py --smoke                           # tiny model, 1 task, 2 seeds, 2 steps

``--agents raw,openai_sdk,langgraph,agentscope``: the paper's framework-agnostic claim with seeds. The same
task (default ``calc_agent``) with its agent written in each framework (``task.options.agent=examples/
frameworks/<file>.py``; ``raw`` is swarmkit's own loop), every agent × seed one job. Besides the tables
above (one row per ``task@agent``) it compares the frameworks' mean held-out curves (before, every
``--eval-every`` steps, after): at each point the gap between the highest and the lowest framework mean
against the seed-to-seed spread (the pooled standard deviation over seeds within a framework); the claim
holds at a point when the gap is at most the spread and at most 0.04.

    python benchmarks/learning_robustness.py --agents raw,openai_sdk,langgraph,agentscope --seeds 0,1,2,3,4 \
        --eval-every 4 --parallel 4                                            # on a GPU box
    python benchmarks/learning_robustness.py --agents raw,openai_sdk --smoke   # tiny model, 2 x 2 jobs

``--unstable``: the collapse alarm on a deliberately unstable run. Per seed it runs one task (default
``token_rule`` on the tiny model at ``optim.lr=0.1``, 10x the model's auto rate, a checkpoint every 4 steps)
twice: with ``trainer.collapse.action=warn`` (what the run does unattended: when the sampled answers
collapsed, when the alarm fired, the reward it is stuck at) and with ``action=rollback`` (back to the
last checkpoint before the weights that sampled the alarm's window, learning rate x
``--rollback-lr-factor``; the reward per step after it; a second alarm pauses training, which ends
the job: ``--max-rollbacks 1``). Onset of the collapse: the first RL step whose
``collapse/entropy`` is below the alarm's ``entropy_min`` (the policy samples one answer). Recovered: the mean sampled reward of the
rollback run's last 3 steps is above the warn run's (stuck) one and at least the reward at the step
it rolled back to.

    python benchmarks/learning_robustness.py --unstable --seeds 1,2            # tiny, token_rule, lr 0.1
    python benchmarks/learning_robustness.py --unstable --smoke                # 1 seed, 8 steps
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

from swarmkit.swarm.collapse import held_out_fall

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB_TASKS = ("calc_agent", "multi_calc")
SPY = "who_is_spy"
ALL_TASKS = (*MAIN_JOB_TASKS, SPY)
#: identical_groups at or above this on the last step counts as collapsed
IDENTICAL_MAX = 0.9
#: --agents: the calc_agent loop written in each framework (examples/frameworks/); "raw" is swarmkit's own loop
AGENT_FILES = {"raw": None, "openai_sdk": "examples/frameworks/openai_sdk.py",
               "langgraph": "examples/frameworks/langgraph_agent.py",
               "agentscope": "examples/frameworks/agentscope_agent.py"}
#: the paper's bound on the gap between frameworks' held-out curves
FRAMEWORK_GAP_MAX = 0.04

#: two-sided 95% quantiles of Student's t, by degrees of freedom (1..30); above 30 the normal 1.96
_T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042]


def t_interval(values: list[float]) -> tuple[float, float]:
    """Mean and 95% half-interval of the mean over ``values`` (Student's t; nan with fewer than two)."""
    vals = [v for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    mean = statistics.fmean(vals)
    if len(vals) < 2:
        return mean, math.nan
    df = len(vals) - 1
    t = _T95[df - 1] if df <= len(_T95) else 1.96
    return mean, t * statistics.stdev(vals) / math.sqrt(len(vals))


def collapse_reasons(warm: dict[str, float] | None, before: dict[str, float], after: dict[str, float],
                     steps: list[dict[str, Any]], alarms: list[str]) -> list[str]:
    """Why a seed counts as collapsed (empty: it did not); the rule is the module docstring's. ``alarms``:
    the signals the alarm rows named (``collapse/flat_groups``: every group scored alike, e.g. a warm start
    that never taught the tool format, so RL had no signal at all)."""
    reasons = []
    if alarms or any(float(r.get("collapse/alarm") or 0) > 0 for r in steps):
        named = sorted({a.split("/", 1)[-1] for a in alarms})
        reasons.append(f"alarm ({', '.join(named)})" if named else "alarm")
    ref = warm or before
    fall = held_out_fall((ref["mean"], ref["ci95"]), (after["mean"], after["ci95"]))
    if fall is not None:
        reasons.append(f"held-out fell {fall:.3f} > {math.hypot(ref['ci95'] or 0.0, after['ci95'] or 0.0):.3f}")
    rl = [r for r in steps if "collapse/identical_groups" in r]
    if rl and float(rl[-1]["collapse/identical_groups"]) >= IDENTICAL_MAX:
        reasons.append(f"identical_groups {float(rl[-1]['collapse/identical_groups']):.2f} at the end")
    return reasons


_CURVE_KEYS = ("reward_mean", "episodes", "loss", "entropy", "collapse/identical_groups", "collapse/flat_groups",
               "collapse/entropy", "collapse/alarm", "sft_nll", "demonstrations", "task/valid_tool_call", "task/correct",
               "task/chain")


def step_curve(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-step curve: step and the keys above that the row has."""
    return [{"step": int(r["step"]), **{k: r[k] for k in _CURVE_KEYS if r.get(k) is not None}} for r in rows]


#: the per-step shares of how rollouts ended, where the task reports them (multi_calc's ``outcome/<kind>``)
OUTCOME_PREFIX = "task/outcome/"


def rl_outcomes(rows: list[dict[str, Any]]) -> dict[str, int]:
    """How the RL steps' rollouts ended: per kind, the step share times the step's sampled episodes, summed
    (``{}`` where the task reports no outcomes)."""
    counts: dict[str, float] = {}
    for r in rows:
        if sft_step(r):
            continue
        sampled = float(r.get("episodes") or 0) - float(r.get("demonstrations") or 0)
        for key, share in r.items():
            if key.startswith(OUTCOME_PREFIX) and isinstance(share, int | float):
                kind = key[len(OUTCOME_PREFIX):]
                counts[kind] = counts.get(kind, 0.0) + float(share) * sampled
    return {k: round(v) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])}


def outcomes_by_length(run_dir: Path) -> dict[str, dict[str, int]]:
    """How the trained RL rollouts ended, per chain length of their problem (``{"2": {"right": 9, ...}}``), read
    from the run folder's ``journal.sqlite`` and the task's own items (the run's ``.hydra/config.yaml``); ``{}``
    for a task whose items have no chain (``meta["steps"]``) or whose episodes name no outcome."""
    journal, config = run_dir / "journal.sqlite", run_dir / ".hydra" / "config.yaml"
    if not journal.exists() or not config.exists():
        return {}
    import yaml

    from swarmkit.apps.task_client import episode_outcome
    from swarmkit.tasks import make_tasks

    task = yaml.safe_load(config.read_text())["task"]
    items = make_tasks(task["name"], int(task["train_size"]), seed=int(task["seed"]), split="train",
                       options=task.get("options") or {})
    steps = {t.task_id: len(t.meta["steps"]) for t in items if "steps" in t.meta}
    counts: dict[str, dict[str, int]] = {}
    with closing(sqlite3.connect(f"file:{journal}?mode=ro", uri=True)) as db:
        for task_id, meta in db.execute("SELECT task_id, meta FROM episodes WHERE status = 'trained'"):
            m = json.loads(meta)
            kind = episode_outcome(m.get("metrics") or {})
            if m.get("demonstration") or kind is None or task_id not in steps:
                continue
            per = counts.setdefault(str(steps[task_id]), {})
            per[kind] = per.get(kind, 0) + 1
    return {n: dict(sorted(c.items(), key=lambda kv: -kv[1])) for n, c in sorted(counts.items())}


def sft_step(row: dict[str, Any]) -> bool:
    """A warm-start step: every episode it trained on was a demonstration."""
    return float(row.get("demonstrations") or 0) >= float(row.get("episodes") or 0) > 0


def read_rows(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(training-step rows, the signals each alarm row names) of a run folder's ``metrics.jsonl``."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    alarms = [name for r in rows if r.get("kind") == "alarm"
              for name in re.findall(r"(?:collapse|task)/[\w.]+", str(r.get("alarm", ""))) or ["alarm"]]
    return [r for r in rows if r.get("kind", "train") == "train"], alarms


def model_overrides(model: str) -> list[str]:
    return [f"model={model}"] if model in ("tiny", "smollm2") else [f"model.path={model}"]


# ----------------------------------------------------------------------------- one seed
def agent_file(agent: str | None) -> str | None:
    """The agent file of ``--agents`` entry ``agent`` (None: the task's own loop): a name of
    :data:`AGENT_FILES`, another file of examples/frameworks/ by its stem, or a path."""
    if agent is None or agent in AGENT_FILES:
        return AGENT_FILES.get(agent or "raw")
    stem = ROOT / "examples" / "frameworks" / f"{agent}.py"
    if stem.exists():
        return str(stem.relative_to(ROOT))
    if Path(agent).exists():
        return agent
    raise ValueError(f"--agents: {agent!r} is neither one of {', '.join(AGENT_FILES)}, a file of "
                     "examples/frameworks/ nor a path")


def label(task: str, agent: str | None) -> str:
    """A job group's name: the task, or ``task@agent`` under ``--agents``."""
    return task if agent is None else f"{task}@{agent}"


def main_job_command(task: str, seed: int, run_dir: Path, args: argparse.Namespace,
                     agent: str | None = None) -> list[str]:
    file = agent_file(agent)
    demos = args.demonstrations if args.demonstrations is not None else \
        args.warm_steps * args.batch_size * args.rollouts
    warm = demos // (args.batch_size * args.rollouts)
    return [sys.executable, "-m", "swarmkit", f"task={task}", f"seed={seed}", *model_overrides(args.model),
            f"task.demonstrations={demos}", f"task.eval_size={args.eval_size}",
            f"batching.batch_size={args.batch_size}", f"batching.rollouts_per_task={args.rollouts}",
            f"trainer.total_steps={warm + args.steps}", f"trainer.eval_every={args.eval_every}",
            f"optim.sft_lr={args.sft_lr}", f"optim.lr={args.lr}", "trainer.checkpoint_every=0", "server.port=0",
            f"server.run_dir={run_dir}", f"hydra.run.dir={run_dir}",
            *([f"task.options.agent={file}"] if file else []), *args.override]


def spy_command(seed: int, run_dir: Path, args: argparse.Namespace) -> list[str]:
    model = {"builtin:smollm2": "smollm2", "builtin:tiny": "tiny"}.get(args.model, args.model)
    return [sys.executable, str(ROOT / "examples/who_is_spy/run.py"), "adversarial", "--train", "civilian",
            "--model", model, "--seed", str(seed), "--steps", str(args.steps), "--warm-start", str(args.warm_steps),
            "--eval-games", str(args.eval_size), "--batch-size", str(args.batch_size), "--rollouts",
            str(args.rollouts), "--lr", str(args.lr), "--sft-lr", str(args.sft_lr), "--work-dir", str(run_dir),
            "--out", str(run_dir / "spy_summary.json"), *[f"--override={o}" for o in args.override]]


def _wilson(d: dict[str, Any] | None) -> dict[str, float] | None:
    if not d:
        return None
    lo, hi = d["ci95"]
    return {"mean": float(d["civilian_win_rate"]), "ci95": (hi - lo) / 2, "n": int(d["games"])}


def run_seed(task: str, seed: int, work: Path, args: argparse.Namespace, agent: str | None = None) -> dict[str, Any]:
    """Run one (task, seed) job in its own process (``--collect``: read the one already in ``work``);
    its numbers, curves and collapse verdict. ``agent``: an ``--agents`` entry (None: the task's own loop)."""
    name = label(task, agent)
    run_dir = work / f"{name.replace('@', '_')}_seed{seed}"
    if args.collect:
        job = run_dir / "job.json"
        summary = run_dir / ("spy_summary.json" if task == SPY else "summary.json")
        cmd = spy_command(seed, run_dir, args) if task == SPY else main_job_command(task, seed, run_dir, args, agent)
        record = json.loads(job.read_text()) if job.exists() else {  # a job run before job.json was written
            "task": name, "seed": seed, "command": " ".join(cmd), "run_dir": str(run_dir), "returncode": 0,
            "wall_s": round(float(json.loads(summary.read_text()).get("wall_time_s" if task != SPY else "wall_s", 0))
                            if summary.exists() else 0.0, 1)}
        if not summary.exists():
            return {**record, "returncode": record["returncode"] or -1, "error": f"no {summary}"}
        return read_seed(task, run_dir, record)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = spy_command(seed, run_dir, args) if task == SPY else main_job_command(task, seed, run_dir, args, agent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"[{name} seed {seed}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(run_dir / "job.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)
    wall = time.time() - t0
    record: dict[str, Any] = {"task": name, "seed": seed, "command": " ".join(cmd), "run_dir": str(run_dir),
                              "wall_s": round(wall, 1), "returncode": proc.returncode}
    if proc.returncode != 0:
        tail = (run_dir / "job.log").read_text()[-3000:]
        print(f"[{name} seed {seed}] FAILED (exit {proc.returncode}):\n{tail}", flush=True)
        return {**record, "error": tail}
    (run_dir / "job.json").write_text(json.dumps(record))
    return read_seed(task, run_dir, record)


def read_seed(task: str, run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """A finished job's numbers (``summary.json`` or the spy run's summary, ``metrics.jsonl``) and verdict."""
    if task == SPY:
        s = json.loads((run_dir / "spy_summary.json").read_text())
        before, warm, after = _wilson(s["eval_before"]), _wilson(s["eval_after_warm_start"]), _wilson(s["eval_after"])
        rows, alarms = read_rows(run_dir / "server_a")
        held_out: dict[str, float] = {}
    else:
        s = json.loads((run_dir / "summary.json").read_text())
        before, after = s["eval_before"], s["eval_after"]
        midway = {int(k): v for k, v in s["eval_midway"].items()}
        warm = midway[min(midway)] if s["demonstrations"] and midway else None
        held_out = {str(k): round(v["mean"], 4) for k, v in sorted(midway.items())}
        held_out[str(s["global_step"])] = round(after["mean"], 4)
        rows, alarms = read_rows(run_dir)
    assert before is not None and after is not None
    rl_rows = [r for r in rows if not sft_step(r) and "collapse/identical_groups" in r]
    reasons = collapse_reasons(warm, before, after, rl_rows, alarms)
    pick = ("mean", "ci95", "n")
    return {**record, "before": {k: before[k] for k in pick}, "warm": {k: warm[k] for k in pick} if warm else None,
            "after": {k: after[k] for k in pick}, "held_out_curve": held_out, "steps": step_curve(rows),
            "alarms": alarms, "collapsed": bool(reasons), "reasons": reasons, "rl_outcomes": rl_outcomes(rows),
            "warm_outcomes": (warm or {}).get("outcomes") or {}, "after_outcomes": after.get("outcomes") or {},
            "warm_groups": (warm or {}).get("groups") or {}, "after_groups": after.get("groups") or {},
            "rl_outcomes_by_length": outcomes_by_length(run_dir) if task != SPY else {}}


# ----------------------------------------------------------------------------- the unstable run
#: the tasks --unstable takes (single-call ones need no warm start)
UNSTABLE_TASKS = ("token_rule", "arithmetic", *MAIN_JOB_TASKS)
#: --unstable's defaults (a flag given on the command line wins)
UNSTABLE_DEFAULTS = {"tasks": "token_rule", "seeds": "1,2", "model": "tiny", "lr": 0.1, "steps": 20, "warm_steps": 0,
                     "batch_size": 4, "rollouts": 8, "eval_size": 16,
                     "override": ["task.max_tokens=8"], "out": "benchmarks/results/learning_robustness_unstable.json"}
#: the steps whose mean reward tells where a run ended
TAIL = 3


def unstable_command(task: str, seed: int, run_dir: Path, action: str, args: argparse.Namespace) -> list[str]:
    """The main job of one unstable run: ``--lr`` (too high), ``--checkpoint-every``, the alarm's ``action``."""
    demos = args.warm_steps * args.batch_size * args.rollouts
    return [sys.executable, "-m", "swarmkit", f"task={task}", f"seed={seed}", *model_overrides(args.model),
            f"task.eval_size={args.eval_size}", *([f"task.demonstrations={demos}"] if demos else []),
            f"batching.batch_size={args.batch_size}", f"batching.rollouts_per_task={args.rollouts}",
            f"trainer.total_steps={args.warm_steps + args.steps}", f"optim.lr={args.lr}",
            *([f"optim.sft_lr={args.sft_lr}"] if demos else []), f"trainer.checkpoint_every={args.checkpoint_every}",
            f"trainer.collapse.action={action}", f"trainer.collapse.lr_factor={args.rollback_lr_factor}",
            f"trainer.collapse.max_rollbacks={args.max_rollbacks}",
            "logger=[]", "server.port=0", f"server.run_dir={run_dir}", f"hydra.run.dir={run_dir}", *args.override]


def _tail_reward(rows: list[dict[str, Any]]) -> float:
    vals = [float(r["reward_mean"]) for r in rows[-TAIL:] if r.get("reward_mean") is not None]
    return statistics.fmean(vals) if vals else math.nan


def read_unstable(run_dir: Path, entropy_min: float) -> dict[str, Any]:
    """One unstable run's curve (every training step in order: a rolled-back step shows again), the
    collapse onset, the alarms (step, window, action taken, where it rolled back to) and the rewards."""
    path = run_dir / "metrics.jsonl"
    every = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in every if r.get("kind", "train") == "train" and not sft_step(r)]
    alarms = [{k: r.get(k) for k in ("step", "taken", "rolled_back_to", "lr_factor", "retired_episodes", "alarm")
               if r.get(k) is not None} for r in every if r.get("kind") == "alarm"]
    onset = next((int(r["step"]) for r in rows if float(r.get("collapse/entropy", math.inf)) < entropy_min), None)
    s = json.loads((run_dir / "summary.json").read_text())
    back = next((a["rolled_back_to"] for a in alarms if a.get("rolled_back_to") is not None), None)
    at_back = [float(r["reward_mean"]) for r in rows if back is not None and int(r["step"]) == back]
    return {"curve": [{"step": int(r["step"]), "reward": round(float(r.get("reward_mean", math.nan)), 4),
                       "lr": r.get("lr"), "entropy": r.get("collapse/entropy"),
                       "identical": r.get("collapse/identical_groups"), "alarm": r.get("collapse/alarm")} for r in rows],
            "onset": onset, "alarms": alarms, "first_alarm": alarms[0]["step"] if alarms else None,
            "rolled_back_to": back, "reward_at_rollback_point": at_back[0] if at_back else None,
            "tail_reward": _tail_reward(rows), "eval_before": s["eval_before"]["mean"],
            "eval_after": s["eval_after"]["mean"], "eval_after_ci95": s["eval_after"]["ci95"],
            "optimizer_steps": len(rows)}


def run_unstable_seed(task: str, seed: int, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both runs of one seed (warn, then rollback) and the verdict."""
    out: dict[str, Any] = {"task": task, "seed": seed}
    for action in ("warn", "rollback"):
        run_dir = work / f"unstable_{task}_seed{seed}_{action}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = unstable_command(task, seed, run_dir, action, args)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        print(f"[{task} seed {seed} {action}] {' '.join(cmd)}", flush=True)
        t0 = time.time()
        with open(run_dir / "job.log", "w") as log:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)
        if proc.returncode != 0:
            tail = (run_dir / "job.log").read_text()[-3000:]
            print(f"[{task} seed {seed} {action}] FAILED (exit {proc.returncode}):\n{tail}", flush=True)
            return {**out, "error": tail, "returncode": proc.returncode}
        out[action] = {"command": " ".join(cmd), "wall_s": round(time.time() - t0, 1),
                       **read_unstable(run_dir, args.entropy_min)}
    warn, rb = out["warn"], out["rollback"]
    out["alarm_delay"] = (warn["first_alarm"] - warn["onset"]) if warn["first_alarm"] and warn["onset"] else None
    ref = rb["reward_at_rollback_point"]
    out["recovered"] = bool(rb["rolled_back_to"] is not None and rb["tail_reward"] > warn["tail_reward"]
                            and (ref is None or rb["tail_reward"] >= ref))
    return out


def print_unstable(results: list[dict[str, Any]]) -> None:
    print("\nunstable runs: sampled reward per training step (↩ marks a rollback), the alarm and the rewards")
    print("| task | seed | action | reward per step | collapse onset | alarm at | rolled back to | "
          f"last {TAIL} steps | held-out before -> after |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['task']} | {r['seed']} | failed (exit {r['returncode']}) | | | | | | |")
            continue
        for action in ("warn", "rollback"):
            x = r[action]
            parts, prev = [], 0
            for c in x["curve"]:
                parts.append(("↩ " if c["step"] <= prev else "") + f"{c['reward']:.2f}")
                prev = c["step"]
            alarms = ", ".join(f"{a['step']} ({a.get('taken', '?')})" for a in x["alarms"]) or "-"
            print(f"| {r['task']} | {r['seed']} | {action} | {' '.join(parts)} | {x['onset'] or '-'} | {alarms} | "
                  f"{x['rolled_back_to'] if x['rolled_back_to'] is not None else '-'} | {x['tail_reward']:.3f} | "
                  f"{x['eval_before']:.3f} -> {x['eval_after']:.3f} ± {x['eval_after_ci95']:.3f} |")
    ok = [r for r in results if "error" not in r]
    delays = [r["alarm_delay"] for r in ok if r["alarm_delay"] is not None]
    print(f"\nalarm fired {', '.join(str(d) for d in delays) or '-'} step(s) after the onset; recovered after "
          f"the rollback: {sum(r['recovered'] for r in ok)} of {len(ok)} seeds")


def run_unstable(args: argparse.Namespace, tasks: list[str], seeds: list[int], work: Path) -> int:
    t0 = time.time()
    results = [run_unstable_seed(t, s, work, args) for t in tasks for s in seeds]
    print_unstable(results)
    wall = time.time() - t0
    print(f"\n{2 * len(results)} jobs in {wall:.0f} s; run folders in {work}")
    failed = sum("error" in r for r in results)
    if args.smoke or not args.out:
        shutil.rmtree(work, ignore_errors=True)
        return 1 if failed else 0
    result = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "settings": vars(args), "wall_s": wall,
              "onset_rule": f"first RL step with collapse/entropy < {args.entropy_min}",
              "recovered_rule": f"rollback run's mean sampled reward over its last {TAIL} steps > the warn run's, "
                                "and >= the reward at the step it rolled back to",
              "seeds": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- the table
def fmt(mean: float, ci: float) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean:.3f}" if math.isnan(ci) else f"{mean:.3f} ± {ci:.3f}"


def summarize(task: str, seeds: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in seeds if "error" not in r]
    phase = {p: t_interval([r[p]["mean"] for r in ok if r.get(p)]) for p in ("before", "warm", "after")}
    gain = t_interval([r["after"]["mean"] - (r["warm"] or r["before"])["mean"] for r in ok])
    return {"task": task, "seeds": len(seeds), "failed": len(seeds) - len(ok),
            "collapsed": sum(r["collapsed"] for r in ok),
            **{p: {"mean": m, "ci95": c} for p, (m, c) in phase.items()}, "gain": {"mean": gain[0], "ci95": gain[1]}}


def framework_gap(curves: dict[str, list[dict[int, float]]]) -> list[dict[str, Any]]:
    """The frameworks' mean held-out curves against the seed-to-seed spread.

    ``curves``: per framework, one held-out curve per seed (step -> reward). At every step that all of them
    have: each framework's mean over its seeds, ``gap`` = highest − lowest mean, ``spread`` = the pooled
    standard deviation over seeds (root of the mean of the frameworks' variances; nan with one seed),
    ``holds``: gap ≤ spread and gap ≤ :data:`FRAMEWORK_GAP_MAX`."""
    runs = [c for seeds in curves.values() for c in seeds]
    if not runs:
        return []
    steps = sorted(set.intersection(*(set(c) for c in runs)))
    out = []
    for step in steps:
        means = {a: statistics.fmean(c[step] for c in seeds) for a, seeds in curves.items()}
        variances = [statistics.variance([c[step] for c in seeds]) for seeds in curves.values() if len(seeds) > 1]
        spread = math.sqrt(statistics.fmean(variances)) if len(variances) == len(curves) else math.nan
        gap = max(means.values()) - min(means.values())
        out.append({"step": step, "means": means, "gap": gap, "spread": spread,
                    "holds": bool(gap <= FRAMEWORK_GAP_MAX and not math.isnan(spread) and gap <= spread)})
    return out


def held_out_points(run: dict[str, Any]) -> dict[int, float]:
    """A finished seed's held-out curve with the reward before training at step 0."""
    return {0: float(run["before"]["mean"]), **{int(k): float(v) for k, v in run["held_out_curve"].items()}}


def print_gap(task: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    agents = list(rows[0]["means"])
    print(f"\n{task} across frameworks: mean held-out reward over seeds; gap = highest − lowest; spread = pooled "
          f"sd over seeds; holds: gap ≤ spread and ≤ {FRAMEWORK_GAP_MAX}")
    print("| step | " + " | ".join(agents) + " | gap | spread | holds |")
    print("|---|" + "---|" * (len(agents) + 3))
    for r in rows:
        print(f"| {r['step']} | " + " | ".join(f"{r['means'][a]:.3f}" for a in agents) +
              f" | {r['gap']:.3f} | {r['spread']:.3f} | {'yes' if r['holds'] else 'no'} |")


def print_tables(summaries: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> None:
    print("\nheld-out reward, mean over seeds ± 95% t-interval over seeds (who_is_spy: civilians' win rate)")
    print("| task | seeds | before | after warm start | after RL | RL − warm start | collapsed |")
    print("|---|---|---|---|---|---|---|")
    for s in summaries:
        n = s["seeds"] - s["failed"]
        failed = f" ({s['failed']} failed)" if s["failed"] else ""
        print(f"| {s['task']} | {n}{failed} | "
              f"{fmt(s['before']['mean'], s['before']['ci95'])} | {fmt(s['warm']['mean'], s['warm']['ci95'])} | "
              f"{fmt(s['after']['mean'], s['after']['ci95'])} | {fmt(s['gain']['mean'], s['gain']['ci95'])} | "
              f"{s['collapsed']} of {n} |")
    print("\nper seed (each seed's own 95% interval over its held-out items)")
    print("| task | seed | before | after warm start | after RL | train reward per step | collapsed | wall |")
    print("|---|---|---|---|---|---|---|---|")
    for task, seeds in runs.items():
        for r in seeds:
            if "error" in r:
                print(f"| {task} | {r['seed']} | failed (exit {r['returncode']}) | | | | | {r['wall_s']:.0f} s |")
                continue
            curve = " ".join(f"{x['reward_mean']:.2f}" for x in r["steps"] if "reward_mean" in x and not sft_step(x))
            warm = fmt(r["warm"]["mean"], r["warm"]["ci95"]) if r["warm"] else "-"
            print(f"| {task} | {r['seed']} | {fmt(r['before']['mean'], r['before']['ci95'])} | {warm} | "
                  f"{fmt(r['after']['mean'], r['after']['ci95'])} | {curve} | "
                  f"{'yes: ' + '; '.join(r['reasons']) if r['collapsed'] else 'no'} | {r['wall_s']:.0f} s |")
    print_outcomes(runs)


def print_outcomes(runs: dict[str, list[dict[str, Any]]]) -> None:
    """How the RL rollouts and the held-out episodes (after the warm start, after RL) ended, per task and
    seed, where the task reports it (multi_calc)."""
    for task, seeds in runs.items():
        for title, key in (("how the RL rollouts ended (rollouts over all RL steps)", "rl_outcomes"),
                           ("how the held-out episodes ended after the warm start", "warm_outcomes"),
                           ("how the held-out episodes ended after RL", "after_outcomes")):
            _outcome_table(f"{task}: {title}", [(r["seed"], r.get(key) or {}) for r in seeds])
        _group_table(task, seeds)
        by_length = [(r["seed"], r["rl_outcomes_by_length"]) for r in seeds if r.get("rl_outcomes_by_length")]
        for n in sorted({n for _, lengths in by_length for n in lengths}):
            _outcome_table(f"{task}: how the trained RL rollouts of {n}-step problems ended (journal.sqlite)",
                           [(seed, lengths.get(n, {})) for seed, lengths in by_length])


def _group_table(task: str, seeds: list[dict[str, Any]]) -> None:
    """Held-out reward per group of items (multi_calc: problem length) after the warm start and after RL,
    per seed and as the mean over seeds with its t-interval."""
    done = [r for r in seeds if r.get("after_groups")]
    names = sorted({g for r in done for g in r["after_groups"]})
    if not names:
        return
    print(f"\n{task}: held-out reward per group, after the warm start -> after RL")
    print("| seed | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))

    def cell(r: dict[str, Any], g: str) -> str:
        warm, after = (r.get("warm_groups") or {}).get(g), r["after_groups"].get(g)
        if after is None:
            return "-"
        return (f"{warm['mean']:.3f} -> " if warm else "") + f"{after['mean']:.3f} (n={after['n']})"
    for r in done:
        print(f"| {r['seed']} | " + " | ".join(cell(r, g) for g in names) + " |")
    means = []
    for g in names:
        after = [r["after_groups"][g]["mean"] for r in done if g in r["after_groups"]]
        warm = [r["warm_groups"][g]["mean"] for r in done if g in (r.get("warm_groups") or {})]
        means.append((f"{fmt(*t_interval(warm))} -> " if warm else "") + fmt(*t_interval(after)))
    print("| mean ± 95% t | " + " | ".join(means) + " |")


def _outcome_table(title: str, rows: list[tuple[Any, dict[str, int]]]) -> None:
    """One table of ``(seed, {kind: count})`` rows (seeds with no counts left out), kinds commonest first."""
    done = [(seed, counts) for seed, counts in rows if counts]
    if not done:
        return
    kinds = sorted({k for _, c in done for k in c}, key=lambda k: -sum(c.get(k, 0) for _, c in done))
    print(f"\n{title}")
    print("| seed | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for seed, counts in done:
        print(f"| {seed} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " |")
    print("| all | " + " | ".join(str(sum(c.get(k, 0) for _, c in done)) for k in kinds) + " |")


# ----------------------------------------------------------------------------- main
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(ALL_TASKS), help=f"comma-separated, of {', '.join(ALL_TASKS)}")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated run seeds (the held-out items stay fixed)")
    p.add_argument("--steps", type=int, default=20, help="RL steps after the warm start")
    p.add_argument("--warm-steps", type=int, default=8, help="supervised warm-start steps (0: none)")
    p.add_argument("--demonstrations", type=int, default=None,
                   help="demonstration episodes (default: warm steps x batch size x rollouts)")
    p.add_argument("--model", default="builtin:smollm2", help="model.path, or tiny / smollm2 (the model option)")
    p.add_argument("--eval-size", type=int, default=48, help="held-out items (spy: held-out games)")
    p.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: only the three)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--rollouts", type=int, default=4, help="batching.rollouts_per_task")
    p.add_argument("--lr", type=float, default=1e-3, help="optim.lr (RL)")
    p.add_argument("--sft-lr", type=float, default=2e-3, help="optim.sft_lr (the warm start)")
    p.add_argument("--parallel", type=int, default=1, help="jobs at once, each its own process")
    p.add_argument("--work-dir", default=None, help="run folders (default: a temp folder)")
    p.add_argument("--out", default="benchmarks/results/learning_robustness.json")
    p.add_argument("--collect", action="store_true",
                   help="run nothing: read the jobs already in --work-dir (e.g. to apply a changed collapse rule)")
    p.add_argument("--override", action="append", default=[], help="extra config override for every job")
    p.add_argument("--agents", default=None,
                   help="comma-separated agents of the task (default task then calc_agent): raw (swarmkit's own "
                        f"loop), {', '.join(a for a in AGENT_FILES if a != 'raw')}, another file of "
                        "examples/frameworks/ or a path; compares the frameworks' held-out curves (module docstring)")
    p.add_argument("--smoke", action="store_true", help="tiny model, multi_calc, seeds 0,1, 1 warm + 2 RL steps "
                   "of 2x2 episodes, 4 held-out items, no JSON (about a minute on the CPU); with --unstable: "
                   "seed 1, 8 steps, no JSON")
    p.add_argument("--unstable", action="store_true",
                   help="the collapse alarm on a deliberately unstable run, warn vs rollback (module docstring); "
                        f"defaults then: {', '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in UNSTABLE_DEFAULTS.items())}")
    p.add_argument("--rollback-lr-factor", type=float, default=0.1,
                   help="--unstable: trainer.collapse.lr_factor of the rollback run")
    p.add_argument("--checkpoint-every", type=int, default=4,
                   help="--unstable: trainer.checkpoint_every (the points a rollback can go back to)")
    p.add_argument("--max-rollbacks", type=int, default=1,
                   help="--unstable: trainer.collapse.max_rollbacks (then the alarm pauses, which ends the job)")
    p.add_argument("--entropy-min", type=float, default=0.05,
                   help="--unstable: the collapse onset is the first step below this entropy (the alarm's default)")
    args = p.parse_args()
    if args.unstable:
        given = {a.split("=")[0] for a in sys.argv[1:] if a.startswith("--")}
        for key, value in UNSTABLE_DEFAULTS.items():
            if f"--{key.replace('_', '-')}" not in given:
                setattr(args, key, value)
        if args.smoke:
            args.seeds, args.steps, args.out = "1", 8, None
        tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
        unknown = [t for t in tasks if t not in UNSTABLE_TASKS]
        if unknown:
            p.error(f"--unstable: unknown task(s) {', '.join(unknown)}; known: {', '.join(UNSTABLE_TASKS)}")
        work = Path(args.work_dir or tempfile.mkdtemp(prefix="swarmkit-unstable-")).resolve()
        return run_unstable(args, tasks, [int(s) for s in args.seeds.split(",") if s.strip()], work)
    if args.smoke:
        args.tasks, args.seeds, args.model, args.steps, args.warm_steps = "multi_calc", "0,1", "tiny", 2, 1
        args.eval_size, args.batch_size, args.rollouts, args.out = 4, 2, 2, None
        args.override = ["task.max_tokens=8", "task.train_size=8", "task.concurrency=4", *args.override]
    agents: list[str | None] = [None]
    if args.agents:
        agents = [a.strip() for a in args.agents.split(",") if a.strip()]
        if "--tasks" not in " ".join(sys.argv[1:]):
            args.tasks = "calc_agent"
        try:
            for a in agents:
                agent_file(a)
        except ValueError as exc:
            p.error(str(exc))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.agents and any(t not in MAIN_JOB_TASKS for t in tasks):
        p.error(f"--agents: the tasks run through the main job only ({', '.join(MAIN_JOB_TASKS)})")
    unknown = [t for t in tasks if t not in ALL_TASKS]
    if unknown:
        p.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(ALL_TASKS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.collect and not args.work_dir:
        p.error("--collect reads --work-dir")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="swarmkit-robustness-")).resolve()
    t0 = time.time()
    jobs = [(t, a, s) for t in tasks for a in agents for s in seeds]
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        results = list(pool.map(lambda job: run_seed(job[0], job[2], work, args, job[1]), jobs))
    groups = [label(t, a) for t in tasks for a in agents]
    runs = {g: [r for r in results if r["task"] == g] for g in groups}
    summaries = [summarize(g, runs[g]) for g in groups]
    print_tables(summaries, runs)
    gaps: dict[str, list[dict[str, Any]]] = {}
    if args.agents:
        for t in tasks:
            curves = {str(a): [held_out_points(r) for r in runs[label(t, a)] if "error" not in r] for a in agents}
            gaps[t] = framework_gap(curves) if all(curves.values()) else []
            print_gap(t, gaps[t])
    wall = sum(r["wall_s"] for r in results) if args.collect else time.time() - t0
    print(f"\n{len(jobs)} jobs {'took' if args.collect else 'in'} {wall:.0f} s; run folders in {work}")
    failed = sum(s["failed"] for s in summaries)
    if args.smoke:
        shutil.rmtree(work, ignore_errors=True)
        return 1 if failed else 0
    result = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:], "settings": vars(args), "wall_s": wall,
              "collapse_rule": "alarm fired; or held-out after RL < after warm start by more than "
                               "sqrt(ci_warm^2 + ci_after^2); or identical_groups >= 0.9 on the last step",
              "tasks": {s["task"]: {"summary": s, "seeds": runs[s["task"]]} for s in summaries},
              **({"frameworks": {t: {"agents": agents, "gap_max": FRAMEWORK_GAP_MAX, "curve": rows}
                                 for t, rows in gaps.items()}} if args.agents else {})}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
