"""On-policy distillation benchmark: a warm-started tiny model teaches a fresh one, against RL alone.

1. The teacher: the main job trains the tiny model with GRPO on ``token_rule`` (``--teacher-steps``);
   its last checkpoint's ``model/`` folder is served by a swarm server in this process (hf engine, no
   training), which scores tokens through ``/v1/completions`` with ``echo``.
2. The students: fresh tiny models trained ``--steps`` steps by the main job, one run per arm and seed:

   - ``rl``: RL alone. ``algo=distill algo.rl_coef=1 algo.distill_coef=0`` trains exactly GRPO's
     advantages and only *measures* the KL to the teacher (the teacher is queried, not learned from);
   - ``distill``: distillation alone (``rl_coef=0``, ``distill_coef=1``);
   - ``distill+rl``: both (``rl_coef=1``, ``distill_coef=1``).

Per step: the student's sampled reward (``reward_mean``) and its reverse KL to the teacher on its own
samples (``distill_reverse_kl``, nats per token); the held-out greedy reward every ``--eval-every`` steps.
Prints a table (means over seeds with 95% intervals) and writes JSON (``--out``).

    python benchmarks/distill.py                   # 3 seeds x 3 arms, 12 steps each (31 min on 2 loaded cores)
    python benchmarks/distill.py --smoke           # 1 seed, 2 teacher + 2 student steps, small batches
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: the task and recipe every run shares (the CI learning test's: tiny model, token_rule, B = 4 x N = 8)
COMMON = ["model=tiny", "task=token_rule", "task.max_tokens=8", "batching.batch_size=4",
          "batching.rollouts_per_task=8", "optim.lr=1e-2", "logger=[]", "trainer.checkpoint_every=0"]
ARMS = {
    "rl": ["algo.rl_coef=1", "algo.distill_coef=0"],
    "distill": ["algo.rl_coef=0", "algo.distill_coef=1"],
    "distill+rl": ["algo.rl_coef=1", "algo.distill_coef=1"],
}
TOKEN = "distill-benchmark-teacher-" + "t" * 16


#: --smoke: smaller batches and evaluations (the recipe's shape, seconds per job)
SMOKE = ["batching.batch_size=2", "batching.rollouts_per_task=2", "task.eval_size=4", "task.train_size=8"]


def run_job(run_dir: Path, overrides: list[str], timeout: float) -> dict[str, Any]:
    """One main job; returns its summary and metric rows."""
    cmd = [sys.executable, "-m", "swarmkit", *COMMON, *overrides, "server.port=0", f"hydra.run.dir={run_dir}"]
    t0 = time.time()
    proc = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "rows": rows,
            "wall_s": time.time() - t0, "command": " ".join(cmd)}


def serve_teacher(model_dir: Path, run_dir: Path) -> Any:
    """A swarm server serving ``model_dir`` (hf engine on the CPU, no training), started and ROLLING."""
    from omegaconf import OmegaConf

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    cfg = validate_config(compose(["model=tiny", f"model.path={model_dir}"]), get_registry())
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.backend.device = "cpu"
    cfg.trainer.total_steps = 0
    cfg.logger = []
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(run_dir)}}, config=cfg)
    with SwarmClient(h.url, token=TOKEN) as c:
        c.start()
        c.wait_for_state("ROLLING", timeout=300)
    return h


def ci95(values: list[float]) -> float:
    return 1.96 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def per_step(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get("kind", "train") == "train" and key in r]


def evals(rows: list[dict[str, Any]]) -> dict[int, float]:
    return {int(r["step"]): float(r["eval_reward/token_rule"]) for r in rows
            if r.get("kind") == "eval" and "eval_reward/token_rule" in r}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--teacher-steps", type=int, default=30)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--eval-every", type=int, default=3)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="benchmarks/results/distill.json")
    p.add_argument("--smoke", action="store_true", help="1 seed, a 2-step teacher, 2 student steps per arm, "
                   "small batches (checks the pipeline, measures nothing)")
    args = p.parse_args()
    if args.smoke:
        args.teacher_steps, args.steps, args.seeds, args.eval_every = 2, 2, 1, 1
        COMMON.extend(SMOKE)
        args.out = str(Path(tempfile.mkdtemp(prefix="swarmkit-distill-smoke-")) / "distill.json")
    arms = [a for a in args.arms.split(",") if a]
    work = Path(tempfile.mkdtemp(prefix="swarmkit-distill-"))
    t0 = time.time()
    print(f"teacher: GRPO on token_rule for {args.teacher_steps} steps", flush=True)
    teacher = run_job(work / "teacher", [f"trainer.total_steps={args.teacher_steps}", "seed=1000"], 1800)
    model_dir = Path(teacher["summary"]["checkpoint"]) / "model"
    h = serve_teacher(model_dir, work / "teacher-server")
    results: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    try:
        for seed in range(args.seeds):
            for arm in arms:
                print(f"student: {arm}, seed {seed}", flush=True)
                job = run_job(work / f"{arm}-{seed}", [
                    "algo=distill", f"algo.teacher_url={h.url}", "algo.teacher_swarm=true",
                    f"algo.teacher_api_key={TOKEN}", *ARMS[arm], f"trainer.total_steps={args.steps}",
                    f"trainer.eval_every={args.eval_every}", f"seed={seed}"], 1800)
                results[arm].append({"seed": seed, "reward": per_step(job["rows"], "reward_mean"),
                                     "kl": per_step(job["rows"], "distill_reverse_kl"),
                                     "teacher_time_s": sum(per_step(job["rows"], "teacher_time_s")),
                                     "eval": evals(job["rows"]), "wall_s": job["wall_s"]})
    finally:
        h.stop()
        shutil.rmtree(work, ignore_errors=True)  # the jobs' rows are read; their run folders are not kept
    out = {"date": time.strftime("%Y-%m-%d"), "teacher_steps": args.teacher_steps, "steps": args.steps,
           "seeds": args.seeds, "common": COMMON, "arms": {a: ARMS[a] for a in arms},
           "teacher_eval": {"before": teacher["summary"]["eval_before"], "after": teacher["summary"]["eval_after"]},
           "runs": results, "wall_time_s": time.time() - t0}
    print(f"\nteacher: held-out greedy reward {teacher['summary']['eval_before']['mean']:.3f} -> "
          f"{teacher['summary']['eval_after']['mean']:.3f} after {args.teacher_steps} GRPO steps\n")
    print("| arm | step | sampled reward | KL(student ‖ teacher) | held-out reward |")
    print("|---|---|---|---|---|")
    for arm in arms:
        runs = results[arm]
        for step in range(1, args.steps + 1):
            rew = [r["reward"][step - 1] for r in runs if len(r["reward"]) >= step]
            kl = [r["kl"][step - 1] for r in runs if len(r["kl"]) >= step]
            ev = [r["eval"][step] for r in runs if step in r["eval"]]
            ev_s = f"{statistics.mean(ev):.3f} ± {ci95(ev):.3f}" if ev else ""
            print(f"| {arm} | {step} | {statistics.mean(rew):.3f} ± {ci95(rew):.3f} | "
                  f"{statistics.mean(kl):.3f} ± {ci95(kl):.3f} | {ev_s} |")
    summary = {}
    for arm in arms:
        last = [r["eval"].get(args.steps, math.nan) for r in results[arm]]
        tail = [statistics.mean(r["reward"][-3:]) for r in results[arm]]
        kl_last = [r["kl"][-1] for r in results[arm]]
        summary[arm] = {"heldout_final": [statistics.mean(last), ci95(last)],
                        "sampled_reward_last3": [statistics.mean(tail), ci95(tail)],
                        "kl_last": [statistics.mean(kl_last), ci95(kl_last)]}
    out["summary"] = summary
    print("\n| arm | held-out reward at the end | sampled reward (last 3 steps) | KL at the last step |")
    print("|---|---|---|---|")
    for arm, s in summary.items():
        print(f"| {arm} | {s['heldout_final'][0]:.3f} ± {s['heldout_final'][1]:.3f} | "
              f"{s['sampled_reward_last3'][0]:.3f} ± {s['sampled_reward_last3'][1]:.3f} | "
              f"{s['kl_last'][0]:.3f} ± {s['kl_last'][1]:.3f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
