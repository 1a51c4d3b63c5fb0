"""Per-turn credit vs one episode reward on a task where only turn 2 of 4 decides success.

Each run starts a real server in this process (tiny model, hf backend, CPU), trains it for
``--steps`` steps of ``--tasks`` x ``--rollouts`` episodes of ``key_turn`` (swarmkit/tasks/key_turn.py),
then runs held-out eval episodes (greedy) and scores turn 2. Two arms, the same samples:

- ``episode``: ``algo=grpo``, ``ep.report(score)``: every token of the four turns gets the
  episode's advantage (the three unscored turns add noise to the gradient);
- ``turn``: ``algo=turn_grpo`` (``--gamma``), ``ep.report(0.0, turn_rewards=[0, score, 0, 0])``.

Prints a table (mean held-out score per arm, 95% interval over seeds, the per-seed paired
difference) and writes JSON (``--out``).

    python benchmarks/turn_credit.py                     # 3 seeds x 2 arms, 15 steps each
    python benchmarks/turn_credit.py --smoke             # 1 seed, 2 steps: seconds; prints the table, writes JSON
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _repo  # noqa: E402,F401  (the checkout importable without an install)
import httpx  # noqa: E402

from swarmkit.tasks.key_turn import make_key_turn_tasks, run_key_turn  # noqa: E402


def _config(arm: str, seed: int, run_dir: Path, args: argparse.Namespace):
    from omegaconf import OmegaConf

    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    algo = ["algo=grpo"] if arm == "episode" else ["algo=turn_grpo", f"algo.gamma={args.gamma}"]
    cfg = validate_config(compose(["model=tiny", *algo, "batching=c2", f"batching.batch_size={args.tasks}",
                                   f"batching.rollouts_per_task={args.rollouts}", f"optim.lr={args.lr}",
                                   f"trainer.total_steps={args.steps}", "trainer.checkpoint_every=0", f"seed={seed}"]),
                          get_registry())
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    cfg.backend.device = "cpu"
    cfg.logger = []
    cfg.server.run_dir = str(run_dir)
    return cfg


def _episode(client, task, arm: str, args: argparse.Namespace, eval_: bool, seed: int) -> float:
    with client.episode(task_id=task.task_id, eval=eval_) as ep, httpx.Client(timeout=120) as http:
        outcome, per_turn = run_key_turn(http, ep.base_url, ep.api_key, task, max_tokens=args.max_tokens,
                                         temperature=0.0 if eval_ else 1.0, seed=None if eval_ else seed)
        if arm == "turn" and not eval_:
            ep.report(0.0, turn_rewards=per_turn)
        else:
            ep.report(outcome.reward)
    return outcome.reward


def run_arm(arm: str, seed: int, args: argparse.Namespace) -> dict:
    """One training run and its held-out eval."""
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient

    token = "bench-admin-token"
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmkit-turn-{arm}-{seed}-"))
    cfg = _config(arm, seed, run_dir, args)
    handle = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": token,
                                             "run_dir": str(run_dir)}}, config=cfg)
    t0 = time.time()
    try:
        with SwarmClient(handle.url, token=token, retry_for=300) as client:
            client.start()
            client.wait_for_state("ROLLING", timeout=300)
            train = make_key_turn_tasks(args.train_size, seed, "train", {})
            held_out = make_key_turn_tasks(args.eval_size, seed, "eval", {})
            rewards = []
            with ThreadPoolExecutor(args.concurrency) as pool:
                for step in range(args.steps):
                    batch = [train[(step * args.tasks + i) % len(train)] for i in range(args.tasks)]
                    jobs = [(t, r) for t in batch for r in range(args.rollouts)]
                    rewards.append(statistics.fmean(pool.map(
                        lambda j, step=step: _episode(client, j[0], arm, args, False, 1000 * seed + 17 * step + j[1]), jobs)))
                    deadline = time.time() + 300
                    while client.status()["global_step"] < step + 1 and time.time() < deadline:
                        time.sleep(0.1)
                scores = list(pool.map(lambda t: _episode(client, t, arm, args, True, 0), held_out))
            return {"arm": arm, "seed": seed, "held_out": statistics.fmean(scores), "train_reward": rewards,
                    "steps": client.status()["global_step"], "wall_s": time.time() - t0}
    finally:
        handle.stop()
        shutil.rmtree(run_dir, ignore_errors=True)  # the numbers are returned; the run folder is not kept


def _ci95(xs: list[float]) -> float:
    return 1.96 * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--tasks", type=int, default=4, help="tasks per step (B)")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts per task (N)")
    p.add_argument("--train-size", type=int, default=32)
    p.add_argument("--eval-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--gamma", type=float, default=1.0, help="turn_grpo's discount per turn")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/turn_credit.json")
    p.add_argument("--smoke", action="store_true", help="1 seed, 2 steps of 2x2 episodes, 4 eval episodes")
    args = p.parse_args()
    if args.smoke:
        args.seeds, args.steps, args.tasks, args.rollouts, args.eval_size = 1, 2, 2, 2, 4
        if args.out == p.get_default("out"):
            args.out = os.path.join(tempfile.gettempdir(), "turn_credit_smoke.json")
    os.environ.setdefault("SWARMKIT_TORCH_THREADS", "1")
    runs = [run_arm(arm, seed, args) for seed in range(args.seeds) for arm in ("episode", "turn")]
    table = {}
    print(f"key_turn: held-out turn-2 score after {args.steps} steps x {args.tasks * args.rollouts} episodes "
          f"(tiny model, CPU, gamma={args.gamma})")
    print(f"{'arm':<10}{'mean':>8}{'ci95':>8}  per seed        (train: mean turn-2 score of the last 5 steps)")
    for arm in ("episode", "turn"):
        xs = [r["held_out"] for r in runs if r["arm"] == arm]
        last = [statistics.fmean(r["train_reward"][-5:]) for r in runs if r["arm"] == arm]
        table[arm] = {"mean": statistics.fmean(xs), "ci95": _ci95(xs), "per_seed": xs,
                      "train_last5": {"mean": statistics.fmean(last), "ci95": _ci95(last), "per_seed": last}}
        print(f"{arm:<10}{table[arm]['mean']:>8.3f}{table[arm]['ci95']:>8.3f}  " + " ".join(f"{x:.3f}" for x in xs)
              + f"   train {statistics.fmean(last):.3f} ± {_ci95(last):.3f}")
    diffs = [t - e for t, e in zip(table["turn"]["per_seed"], table["episode"]["per_seed"], strict=True)]
    table["turn_minus_episode"] = {"mean": statistics.fmean(diffs), "ci95": _ci95(diffs), "per_seed": diffs}
    print(f"{'turn-ep':<10}{statistics.fmean(diffs):>8.3f}{_ci95(diffs):>8.3f}  " + " ".join(f"{x:+.3f}" for x in diffs))
    out = {"args": vars(args), "table": table, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
