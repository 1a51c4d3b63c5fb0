"""Does ``optim.lr=auto`` learn at least as well as a fixed learning rate? The main job per arm × seed.

Each arm is one set of overrides of ``python -m swarmkit`` (the main job: model, task, batching, ...
from ``--base``); each seed one whole job in its own process. Prints held-out reward before / after
per job and, per arm, the mean over seeds of after − before with a 95% t-interval over seeds; writes
JSON (``--out``) with every job's numbers and its resolved learning rate (the ``lr`` of its steps).

    python benchmarks/lr_auto.py --arm auto=optim.lr=auto --arm fixed=optim.lr=3e-4 --seeds 0,1 \\
        --base model=tiny task=token_rule task.max_tokens=8 trainer.total_steps=20
    python benchmarks/lr_auto.py --smoke          # tiny model, token_rule, 1 seed, 2 steps per arm, no JSON
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_robustness import ROOT, fmt, t_interval  # noqa: E402


def run_job(arm: str, overrides: list[str], seed: int, base: list[str], work: Path) -> dict[str, Any]:
    """One main job; its held-out rewards, learning rate and wall time."""
    run_dir = work / f"{arm}_seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = [sys.executable, "-m", "swarmkit", *base, *overrides, f"seed={seed}", "trainer.checkpoint_every=0",
           "logger=[]", "server.port=0", f"server.run_dir={run_dir}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    print(f"[{arm} seed {seed}] {' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(run_dir / "job.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, text=True)
    record: dict[str, Any] = {"arm": arm, "seed": seed, "command": " ".join(cmd), "wall_s": round(time.time() - t0, 1)}
    if proc.returncode != 0:
        return {**record, "error": (run_dir / "job.log").read_text()[-2000:]}
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    lrs = sorted({float(r["lr"]) for r in rows if r.get("kind", "train") == "train" and "lr" in r})
    curve = [round(float(r["reward_mean"]), 3) for r in rows if r.get("kind", "train") == "train" and "reward_mean" in r]
    return {**record, "lr": lrs, "before": s["eval_before"], "after": s["eval_after"], "train_reward": curve}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", action="append", default=[], help="NAME=OVERRIDE[,OVERRIDE...] (repeat per arm)")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--base", nargs="*", default=[], help="overrides of every job")
    p.add_argument("--parallel", type=int, default=1, help="jobs at once, each its own process")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default="benchmarks/results/lr_auto.json")
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.arm = ["auto=optim.lr=auto", "fixed=optim.lr=3e-4"]
        args.seeds, args.out = "0", None
        args.base = ["model=tiny", "task=token_rule", "task.eval_size=4", "task.train_size=8",
                     "batching.batch_size=2", "batching.rollouts_per_task=2", "trainer.total_steps=2"]
    if not args.arm:
        p.error("give at least one --arm NAME=OVERRIDES")
    arms = {}
    for spec in args.arm:
        name, _, rest = spec.partition("=")
        if not name or not rest:
            p.error(f"--arm {spec!r}: expected NAME=OVERRIDE[,OVERRIDE...]")
        arms[name] = [o for o in rest.split(",") if o]
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="swarmkit-lr-")).resolve()
    t0 = time.time()
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        jobs = list(pool.map(lambda job: run_job(job[0], job[1], job[2], args.base, work),
                             [(a, o, s) for a, o in arms.items() for s in seeds]))
    print("\n| arm | seed | lr | before | after | train reward per step | wall |")
    print("|---|---|---|---|---|---|---|")
    for j in jobs:
        if "error" in j:
            print(f"| {j['arm']} | {j['seed']} | failed | | | | {j['wall_s']:.0f} s |")
            continue
        print(f"| {j['arm']} | {j['seed']} | {', '.join(f'{x:g}' for x in j['lr'])} | "
              f"{fmt(j['before']['mean'], j['before']['ci95'])} | {fmt(j['after']['mean'], j['after']['ci95'])} | "
              f"{' '.join(f'{x:.2f}' for x in j['train_reward'])} | {j['wall_s']:.0f} s |")
    print("\n| arm | seeds | after (mean ± 95% t over seeds) | after − before |")
    print("|---|---|---|---|")
    summary = {}
    for arm in arms:
        ok = [j for j in jobs if j["arm"] == arm and "error" not in j]
        after = t_interval([j["after"]["mean"] for j in ok])
        gain = t_interval([j["after"]["mean"] - j["before"]["mean"] for j in ok])
        summary[arm] = {"seeds": len(ok), "after": after, "gain": gain}
        print(f"| {arm} | {len(ok)} | {fmt(*after)} | {fmt(*gain)} |")
    print(f"\n{len(jobs)} jobs in {time.time() - t0:.0f} s; run folders in {work}")
    failed = sum("error" in j for j in jobs)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "argv": sys.argv[1:],
                                              "summary": summary, "jobs": jobs}, indent=2))
        print(f"wrote {args.out}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
