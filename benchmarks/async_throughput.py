"""Synchronous vs asynchronous training on a multi-turn workload with environment latency.

Each configuration runs a fresh server process (``python -m swarmkit mode=server``)
and the same workload from this process (the swarm client, ``AsyncSwarmClient``):

- ``--groups`` group workers; each takes the next training task of ``token_rule``
  and runs ``rollouts_per_task`` episodes of it at once (a GRPO group);
- an episode is ``--turns`` chat turns; after each answer the "environment" sleeps
  for a heavy-tailed delay: log-normal around ``--delay`` seconds, and one episode
  in ``--slow-every`` is ``--slow-factor`` times slower (the straggler that a
  synchronous step waits for);
- the reward is the mean score of the turns' answers (``--task``: token_rule, or
  arithmetic for a real model).

Every configuration trains the same number of steps on batches of the same size
(``batching=c2``, the same number of trained samples): ``sync`` (the default
cycle: drain, weight sync, resume) and ``async`` at each ``η`` of ``--etas``
(``trainer.mode=async trainer.max_staleness=η``, decoupled PPO). Reported per
configuration: optimizer steps per minute, trained episodes per minute (from the
first registration to the last step), the share of that time the inference
engine was idle (``status.engine.busy_s``), the staleness of trained tokens, and
held-out eval reward after training (``--eval`` episodes sampled at
``--eval-temperature``, 95% t-interval),
plus the ratios against sync from the same run.

    python benchmarks/async_throughput.py                       # tiny model, 16 steps each
    python benchmarks/async_throughput.py --model smollm2 --task arithmetic --max-tokens 16 --steps 10 --etas 2 \
        --json benchmarks/results/async_throughput_smollm2.json
    python benchmarks/async_throughput.py --smoke               # tiny model, sync vs async η=1, 1 small step each
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from swarmkit.client import AsyncSwarmClient, SwarmAPIError
from swarmkit.tasks import make_tasks, score

TOKEN = "bench-admin-token"
#: t quantiles (two-sided 95%) for small samples; 1.96 beyond
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04}


def ci95(xs: list[float]) -> float:
    """Half-width of the 95% t-interval of the mean of ``xs``."""
    n = len(xs)
    if n < 2:
        return 0.0
    df = n - 1
    t = next((T95[k] for k in sorted(T95) if k >= df), 1.96)
    return t * statistics.stdev(xs) / math.sqrt(n)


@dataclass
class Workload:
    turns: int
    delay: float
    sigma: float
    slow_every: int
    slow_factor: float
    max_tokens: int
    groups: int
    rollouts: int
    seed: int
    eval_temperature: float = 1.0
    task: str = "token_rule"
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def delays(self) -> list[float]:
        """The environment's delay after each turn of one episode."""
        slow = self.slow_every > 0 and self.rng.randrange(self.slow_every) == 0
        scale = self.slow_factor if slow else 1.0
        return [scale * self.delay * math.exp(self.rng.gauss(0.0, self.sigma)) for _ in range(self.turns)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _episode(client: AsyncSwarmClient, http: httpx.AsyncClient, task: Any, wl: Workload, *,
                   eval: bool = False) -> float:
    """One multi-turn episode; returns its reward (already reported)."""
    delays = [0.0] * wl.turns if eval else wl.delays()
    async with client.episode(task.task_id, eval=eval) as ep:
        messages = list(task.messages)
        scores = []
        for turn in range(wl.turns):
            body = {"model": "swarm", "messages": messages, "max_tokens": wl.max_tokens,
                    "temperature": wl.eval_temperature if eval else 1.0}
            resp = await http.post(f"{ep.base_url}/chat/completions", json=body,
                                   headers={"Authorization": f"Bearer {ep.api_key}"})
            resp.raise_for_status()
            reply = resp.json()["choices"][0]["message"]["content"] or ""
            scores.append(score(task, reply))
            messages = [*messages, {"role": "assistant", "content": reply},
                        {"role": "user", "content": f"Go on ({turn + 2})."}]
            await asyncio.sleep(delays[turn])  # the environment works (a tool, a game, another agent)
        reward = sum(scores) / len(scores)
        await ep.report(reward)
    return reward


async def _train_workload(url: str, wl: Workload, steps: int) -> dict[str, Any]:
    tasks = make_tasks(wl.task, 64, seed=wl.seed, split="train")
    queue = iter(tasks * 1000)
    done = asyncio.Event()
    episodes = 0
    waits: list[float] = []

    def on_retry(event: Any) -> None:
        waits.append(float(event.wait_s))

    async with AsyncSwarmClient(url, token=TOKEN, retry_for=600, on_retry=on_retry) as client, \
            httpx.AsyncClient(timeout=120) as http:
        t_start = time.time()
        status0 = await client.status()

        async def group_worker() -> None:
            nonlocal episodes
            while not done.is_set():
                task = next(queue)
                try:
                    await asyncio.gather(*(_episode(client, http, task, wl) for _ in range(wl.rollouts)))
                    episodes += wl.rollouts
                except SwarmAPIError as exc:
                    if exc.code == "training_finished":
                        return
                    raise

        async def watch() -> dict[str, Any]:
            while True:
                st = await client.status()
                if st["global_step"] >= steps:
                    done.set()
                    return st
                await asyncio.sleep(0.05)

        workers = [asyncio.create_task(group_worker()) for _ in range(wl.groups)]
        final = await watch()
        t_end = time.time()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    busy = final["engine"].get("busy_s", 0.0) - status0["engine"].get("busy_s", 0.0)
    wall = t_end - t_start
    return {"wall_s": wall, "episodes_finished": episodes, "engine_busy_s": busy,
            "engine_idle_share": max(0.0, 1.0 - busy / wall), "busy_retries": len(waits)}


async def _evaluate(url: str, wl: Workload, n: int) -> list[float]:
    tasks = make_tasks(wl.task, n, seed=wl.seed, split="eval")
    async with AsyncSwarmClient(url, token=TOKEN, retry_for=600) as client, httpx.AsyncClient(timeout=120) as http:
        sem = asyncio.Semaphore(8)

        async def one(task: Any) -> float:
            async with sem:
                return await _episode(client, http, task, wl, eval=True)
        return list(await asyncio.gather(*(one(t) for t in tasks)))


def _start_server(run_dir: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, HF_HUB_OFFLINE="1")
    return subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}",
         f"hydra.run.dir={run_dir}/hydra"], env=env, stdout=subprocess.DEVNULL, stderr=open(log, "ab"))


async def _run_config(name: str, overrides: list[str], wl: Workload, args: argparse.Namespace,
                      eval_before: bool) -> dict[str, Any]:
    slug = "".join(c if c.isalnum() else "-" for c in name.replace("η", "eta"))
    run_dir = Path(tempfile.mkdtemp(prefix=f"swarmkit-async-{slug}-"))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start_server(run_dir, port, run_dir / "server.err")
    try:
        async with AsyncSwarmClient(url, token=TOKEN, retry_for=120) as ctl:
            await ctl.wait_for_state("OFFLINE", timeout=120)
            await ctl.configure([*args.base, *overrides])
            await ctl.start()
            await ctl.wait_for_state("ROLLING", timeout=600)
        before = await _evaluate(url, wl, args.eval) if eval_before else None
        result = await _train_workload(url, wl, args.steps)
        after = await _evaluate(url, wl, args.eval)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("kind", "train") == "train" and "loss" in r][: args.steps]
    wall = result["wall_s"]
    out = {
        "config": name, "overrides": overrides, **result,
        "steps": len(rows), "steps_per_min": 60.0 * len(rows) / wall,
        "trained_episodes": sum(r["episodes"] for r in rows),
        "episodes_per_min": 60.0 * sum(r["episodes"] for r in rows) / wall,
        "staleness_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in rows) if rows else 0.0,
        "staleness_max": max((r.get("staleness_max", 0.0) for r in rows), default=0.0),
        "stale_tokens_dropped": sum(r.get("stale_tokens_dropped", 0.0) for r in rows),
        "partial_rollouts": sum(r.get("partial_rollouts", 0.0) for r in rows),
        "drain_s_mean": statistics.fmean(r.get("drain_s", 0.0) for r in rows) if rows else 0.0,
        "held_s_mean": statistics.fmean(r.get("held_s", 0.0) for r in rows) if rows else 0.0,
        "train_reward_last3": statistics.fmean(r["reward_mean"] for r in rows[-3:]) if rows else 0.0,
        "eval_after": {"mean": statistics.fmean(after), "ci95": ci95(after), "n": len(after)},
    }
    if before is not None:
        out["eval_before"] = {"mean": statistics.fmean(before), "ci95": ci95(before), "n": len(before)}
    if not args.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    else:
        out["run_dir"] = str(run_dir)
    return out


def _table(results: list[dict[str, Any]]) -> str:
    sync = next((r for r in results if r["config"] == "sync"), results[0])
    head = ("| config | steps/min | × sync | episodes/min | × sync | engine idle | drain / hold s per step | "
            "staleness mean / max | stale tokens dropped | eval reward after (95% CI) |")
    lines = [head, "|" + "---|" * 10]
    for r in results:
        ev = r["eval_after"]
        lines.append(
            f"| {r['config']} | {r['steps_per_min']:.1f} | {r['steps_per_min'] / sync['steps_per_min']:.2f}× | "
            f"{r['episodes_per_min']:.0f} | {r['episodes_per_min'] / sync['episodes_per_min']:.2f}× | "
            f"{100 * r['engine_idle_share']:.0f}% | {r['drain_s_mean']:.2f} / {r['held_s_mean']:.2f} | "
            f"{r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | {r['stale_tokens_dropped']:.0f} | "
            f"{ev['mean']:.3f} ± {ev['ci95']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (the built-in random model), smollm2, or a local HF "
                   "model folder (trained with full weights, as tiny)")
    p.add_argument("--override", action="append", default=[],
                   help="extra config override for every server, e.g. backend.device=cuda (repeat)")
    p.add_argument("--task", default="token_rule", help="token_rule or arithmetic (scored on every turn)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--etas", default="1,2,4", help="staleness bounds of the async runs")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--delay", type=float, default=0.15, help="median environment delay per turn (s)")
    p.add_argument("--sigma", type=float, default=0.5, help="log-normal spread of the delays")
    p.add_argument("--slow-every", type=int, default=8, help="one episode in this many is slow")
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4, help="tasks per step (batching=c2)")
    p.add_argument("--rollouts", type=int, default=4, help="episodes per task (the GRPO group)")
    p.add_argument("--groups", type=int, default=8, help="group workers (concurrent tasks)")
    p.add_argument("--eval", type=int, default=64, help="held-out eval episodes after training")
    p.add_argument("--eval-temperature", type=float, default=1.0,
                   help="sampling temperature of the eval episodes (the tiny model's greedy answer hardly "
                        "depends on the prompt, so greedy evals of it have no spread)")
    p.add_argument("--lr", type=float, default=None, help="optim.lr (default: 1e-2 for tiny, the config's otherwise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    p.add_argument("--json", default="benchmarks/results/async_throughput.json")
    p.add_argument("--smoke", action="store_true", help="tiny model, sync and async η=1, 1 step of 2x2 two-turn "
                   "episodes, 2 eval episodes, no JSON (seconds, on the CPU)")
    args = p.parse_args()
    if args.smoke:
        args.model, args.task, args.steps, args.etas, args.turns, args.delay = "tiny", "token_rule", 1, "1", 2, 0.01
        args.slow_every, args.max_tokens, args.batch_size, args.rollouts, args.groups, args.eval = 2, 4, 2, 2, 2, 2
        args.keep, args.json = False, None
    lr = args.lr if args.lr is not None else (1e-2 if args.model == "tiny" else None)
    model = [f"model={args.model}"] if args.model in ("tiny", "smollm2") else ["model=tiny", f"model.path={args.model}"]
    args.base = [*model, f"task={args.task}", "batching=c2", f"batching.batch_size={args.batch_size}",
                 f"batching.rollouts_per_task={args.rollouts}", *([f"optim.lr={lr}"] if lr is not None else []),
                 f"trainer.total_steps={args.steps}", "trainer.checkpoint_every=0", f"seed={args.seed}",
                 *args.override]
    configs = [("sync", ["trainer.mode=sync"])]
    configs += [(f"async η={eta}", ["trainer.mode=async", f"trainer.max_staleness={eta}"])
                for eta in (int(x) for x in args.etas.split(",") if x.strip())]
    results = []
    for i, (name, overrides) in enumerate(configs):
        wl = Workload(args.turns, args.delay, args.sigma, args.slow_every, args.slow_factor, args.max_tokens,
                      args.groups, args.rollouts, args.seed, args.eval_temperature, args.task)
        print(f"running {name} ...", flush=True)
        r = asyncio.run(_run_config(name, overrides, wl, args, eval_before=i == 0))
        print(f"  {r['steps']} steps in {r['wall_s']:.1f} s: {r['steps_per_min']:.1f} steps/min, engine idle "
              f"{100 * r['engine_idle_share']:.0f}%, eval {r['eval_after']['mean']:.3f} ± "
              f"{r['eval_after']['ci95']:.3f}", flush=True)
        results.append(r)
    print()
    if "eval_before" in results[0]:
        ev = results[0]["eval_before"]
        print(f"eval reward before training: {ev['mean']:.3f} ± {ev['ci95']:.3f} (n={ev['n']})")
    print(_table(results))
    payload = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "args": {
        k: v for k, v in vars(args).items() if k != "base"}, "base_overrides": args.base, "results": results}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
