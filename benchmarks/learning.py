"""Learning benchmark: train the default recipe for a fixed number of steps, eval before and after.

Runs the main job (``python -m swarmkit``: SmolLM2-135M-Instruct, LoRA, GRPO,
C2, the arithmetic task) as a subprocess, then prints held-out greedy eval
reward before/after with 95% intervals, the first step at which the training
reward's running mean clearly exceeded the pre-training eval, wall time and
the peak RSS of the job. Writes JSON (``--out``).

    python benchmarks/learning.py                       # the default recipe, 20 steps
    python benchmarks/learning.py --steps 30 -- model=tiny task=token_rule optim.lr=1e-2
    python benchmarks/learning.py --smoke               # tiny model, token_rule, 2 small steps, no JSON; seconds
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/learning.json")
    p.add_argument("--smoke", action="store_true", help="tiny model, token_rule, 2 steps of 2x2 episodes, "
                   "4 eval episodes, no JSON (seconds, on the CPU)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for the job")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.out = 2, None
        args.overrides = ["model=tiny", "task=token_rule", "task.max_tokens=4", "task.train_size=8",
                          "task.eval_size=4", "batching.batch_size=2", "batching.rollouts_per_task=2",
                          "trainer.checkpoint_every=0", *args.overrides]
    run_dir = Path(tempfile.mkdtemp(prefix="swarmkit-learning-"))
    cmd = [sys.executable, "-m", "swarmkit", f"trainer.total_steps={args.steps}", "server.port=0",
           f"hydra.run.dir={run_dir}", *args.overrides]
    print("running:", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, text=True, capture_output=True)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-4000:], sep="\n")
        return proc.returncode
    peak_rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 / 1024
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [row for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()
             for row in [json.loads(line)] if row.get("kind", "train") == "train"]
    before = summary["eval_before"]
    threshold = before["mean"] + before["ci95"]
    first_better = None
    window = 3
    for i in range(window - 1, len(steps)):
        mean = sum(s["reward_mean"] for s in steps[i - window + 1:i + 1]) / window
        if mean > threshold:
            first_better = {"step": int(steps[i]["step"]), "seconds": steps[i]["time"] - t0}
            break
    result = {
        "command": " ".join(cmd),
        "date": time.strftime("%Y-%m-%d"),
        "eval_before": before,
        "eval_after": summary["eval_after"],
        "improvement": summary["improvement"],
        "steps": summary["global_step"],
        "train_reward_per_step": [round(s["reward_mean"], 4) for s in steps],
        "first_improvement": first_better,
        "wall_time_s": wall,
        "peak_rss_gb": peak_rss_gb,
        "run_dir": str(run_dir),
    }
    print()
    print("| metric | value |")
    print("|---|---|")
    print(f"| eval reward before (greedy, held-out) | {before['mean']:.3f} ± {before['ci95']:.3f} (n={before['n']}) |")
    after = summary["eval_after"]
    print(f"| eval reward after | {after['mean']:.3f} ± {after['ci95']:.3f} (n={after['n']}) |")
    print(f"| optimizer steps | {summary['global_step']} |")
    if first_better:
        print(f"| first step whose 3-step train reward > eval-before + CI | {first_better['step']} "
              f"({first_better['seconds']:.0f} s) |")
    print(f"| wall time | {wall:.0f} s |")
    print(f"| peak RSS | {peak_rss_gb:.2f} GB |")
    if args.smoke:
        shutil.rmtree(run_dir, ignore_errors=True)
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
