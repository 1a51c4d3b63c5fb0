"""N LoRA adapters on one server vs N servers with one LoRA model each (issue 39).

For every N of ``--ns`` and both set-ups:

- **adapters**: one server process (``python -m swarmkit mode=server``) with
  ``model.adapters=[rule_e, rule_o, ...]``: one frozen base, N adapters;
- **servers**: N server processes, each training one LoRA model of the same shape.

Policy ``k`` (adapter ``k``, or server ``k``) learns its own ``token_rule``: its reward is the share of
the reply's characters that are its letter (``e``, ``o``, ``a``, ``t``, ...), so each policy is pulled
somewhere else and isolation shows: a policy that trained on another's samples would not learn its rule.
Measured, with every policy busy at once (the clients run in this process, over HTTP):

- **memory**: the peak resident set (``VmHWM``) of the server processes, summed; on CUDA also
  ``torch.cuda.max_memory_allocated`` of each server process (``status.engine.cuda_max_allocated_bytes``), summed;
- **rollout tokens/s**: ``--tp-episodes`` concurrent (eval) episodes per policy, one chat call of
  ``--tp-tokens`` tokens each, all policies at once, over ``--tp-rounds`` rounds (no training meanwhile);
- **seconds per step**: the trainer's ``step_time_s`` (metrics.jsonl), mean over every step of the set-up,
  and the wall time of the training phase;
- **learning**: each policy's held-out reward (``--eval`` eval episodes at ``--eval-temperature``) before and
  after ``--steps`` steps of its own (GRPO, ``batching=c2``), with 95% t-intervals; the table also gives
  the difference adapters - servers per policy with its interval.

    python benchmarks/multi_lora.py                                   # tiny model on the CPU, N = 1, 2, 4
    python benchmarks/multi_lora.py --ns 1,2,4,8 --steps 20 --json benchmarks/results/multi_lora.json
    python benchmarks/multi_lora.py --device cuda --model 0.5b --lr 1e-3 --max-tokens 32
    python benchmarks/multi_lora.py --ns 2,4 --seeds 0,1,2,3,4        # each set-up over 5 seeds, compared over seeds
    python benchmarks/multi_lora.py --smoke                           # N = 2, one step each, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from swarmkit.client import AsyncSwarmClient, SwarmAPIError
from swarmkit.procs import peak_rss_bytes
from swarmkit.tasks import make_tasks, score

TOKEN = "bench-admin-token"
#: one letter per policy: policy k is rewarded for letter LETTERS[k]
LETTERS = "eoatnisr"
#: two-sided 95% t quantiles by degrees of freedom (1.96 beyond)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 15: 2.13,
       20: 2.09, 30: 2.04, 60: 2.00}


def ci95(xs: list[float]) -> float:
    """Half-width of the 95% t-interval of the mean of ``xs`` (0 for fewer than two values)."""
    if len(xs) < 2:
        return 0.0
    t = next((T95[k] for k in sorted(T95) if k >= len(xs) - 1), 1.96)
    return t * statistics.stdev(xs) / math.sqrt(len(xs))


def summary(xs: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(xs) if xs else 0.0, "ci95": ci95(xs), "n": len(xs)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Policy:
    """One trained policy: an adapter of a shared server, or the one model of its own server."""

    def __init__(self, index: int, url: str, adapter: str | None):
        self.index, self.url, self.adapter = index, url, adapter
        self.letter = LETTERS[index % len(LETTERS)]
        self.name = adapter or f"server_{self.letter}"

    def tasks(self, n: int, split: str, seed: int) -> list[Any]:
        return make_tasks("token_rule", n, seed=seed, split=split, options={"target": self.letter})

    async def step(self, client: AsyncSwarmClient) -> int:
        st = await client.status()
        if self.adapter is None:
            return int(st["global_step"])
        return int((st["pool"].get("adapters") or {}).get(self.adapter, {}).get("step") or 0)


async def _chat(http: httpx.AsyncClient, ep: Any, policy: Policy, messages: list[dict[str, str]],
                max_tokens: int, temperature: float) -> tuple[str, int]:
    body = {"model": policy.adapter or "swarm", "messages": messages, "max_tokens": max_tokens,
            "temperature": temperature}
    resp = await http.post(f"{ep.base_url}/chat/completions", json=body,
                           headers={"Authorization": f"Bearer {ep.api_key}"})
    resp.raise_for_status()
    out = resp.json()
    return out["choices"][0]["message"]["content"] or "", int(out["usage"]["completion_tokens"])


async def _episode(client: AsyncSwarmClient, http: httpx.AsyncClient, policy: Policy, task: Any, max_tokens: int,
                   temperature: float, eval: bool) -> tuple[float, int]:
    """One single-call episode of ``task`` for ``policy``: (reward, completion tokens); reported."""
    async with client.episode(task.task_id, eval=eval, adapter=policy.adapter) as ep:
        reply, tokens = await _chat(http, ep, policy, list(task.messages), max_tokens, temperature)
        reward = score(task, reply)
        await ep.report(reward)
    return reward, tokens


async def evaluate(policies: list[Policy], args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each policy's held-out reward (eval episodes: never trained), all policies at once."""
    async def one_policy(p: Policy) -> tuple[str, dict[str, float]]:
        sem = asyncio.Semaphore(8)
        async with AsyncSwarmClient(p.url, token=TOKEN, retry_for=600) as client, \
                httpx.AsyncClient(timeout=600) as http:
            async def one(task: Any) -> float:
                async with sem:
                    return (await _episode(client, http, p, task, args.max_tokens, args.eval_temperature, True))[0]
            rewards = await asyncio.gather(*(one(t) for t in p.tasks(args.eval, "eval", args.seed)))
        return p.name, summary(list(rewards))
    return dict(await asyncio.gather(*(one_policy(p) for p in policies)))


async def throughput(policies: list[Policy], args: argparse.Namespace) -> dict[str, float]:
    """Completion tokens/s with ``--tp-episodes`` concurrent episodes per policy, every policy at once."""
    clients = [AsyncSwarmClient(p.url, token=TOKEN, retry_for=600) for p in policies]
    # one HTTP client per concurrent episode, as independent agents have (benchmarks/rollout_throughput.py)
    https = [[httpx.AsyncClient(timeout=600) for _ in range(args.tp_episodes)] for _ in policies]
    tokens, wall = 0, 0.0
    try:
        for r in range(args.tp_rounds + 1):  # round 0 warms up
            tasks = [p.tasks(args.tp_episodes, "train", args.seed + 1000 + r) for p in policies]
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(
                _episode(clients[i], https[i][j], p, tasks[i][j], args.tp_tokens, 1.0, True)
                for i, p in enumerate(policies) for j in range(args.tp_episodes)))
            if r:
                wall += time.perf_counter() - t0
                tokens += sum(t for _, t in outs)
    finally:
        await asyncio.gather(*(h.aclose() for row in https for h in row), *(c.aclose() for c in clients))
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall if wall else 0.0}


async def train(policies: list[Policy], args: argparse.Namespace) -> dict[str, Any]:
    """Every policy trains ``--steps`` steps of its own at once; ``--groups`` GRPO groups in flight per policy."""
    t0 = time.perf_counter()
    deadline = time.monotonic() + args.train_timeout

    async def one_policy(p: Policy) -> tuple[str, dict[str, Any]]:
        done = asyncio.Event()
        queue = iter(p.tasks(64, "train", args.seed) * 10_000)
        episodes = 0
        async with AsyncSwarmClient(p.url, token=TOKEN, retry_for=600) as client, \
                httpx.AsyncClient(timeout=600) as http:
            async def group() -> None:
                nonlocal episodes
                while not done.is_set():
                    task = next(queue)
                    try:
                        await asyncio.gather(*(_episode(client, http, p, task, args.max_tokens, 1.0, False)
                                               for _ in range(args.rollouts)))
                        episodes += args.rollouts
                    except SwarmAPIError as exc:
                        if exc.code == "training_finished":
                            return
                        raise

            workers = [asyncio.create_task(group()) for _ in range(args.groups)]
            try:
                while (step := await p.step(client)) < args.steps:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{p.name}: {step} of {args.steps} steps after {args.train_timeout} s")
                    if failed := [w for w in workers if w.done() and w.exception() is not None]:
                        raise failed[0].exception()  # type: ignore[misc]
                    await asyncio.sleep(0.2)
                done.set()
                t_done = time.perf_counter() - t0
            finally:
                done.set()
                await asyncio.gather(*workers, return_exceptions=True)
            return p.name, {"wall_s": t_done, "episodes": episodes, "steps": await p.step(client)}
    per = dict(await asyncio.gather(*(one_policy(p) for p in policies)))
    return {"wall_s": time.perf_counter() - t0, "per_policy": per}


def _start_server(run_dir: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS=str(threads))
    return subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}",
         f"hydra.run.dir={run_dir}/hydra"], env=env, stdout=subprocess.DEVNULL, stderr=open(run_dir / "server.err", "ab"))


def _model(name: str) -> list[str]:
    """The model overrides: ``tiny`` is the built-in tiny model with larger random weights (std 0.1,
    ``swarmkit.testing.build_test_model``): at the default std 0.02 its tied embeddings keep every logit near
    0, so a LoRA adapter (which leaves them frozen) cannot move the sampled distribution within a short run
    (measured: entropy 6.04 of ln 512 = 6.24 and a flat reward after 30 steps at lr 0.2)."""
    if name == "tiny":
        from swarmkit.testing import build_test_model

        return ["model=tiny", f"model.path={build_test_model(Path(tempfile.gettempdir()) / 'swarmkit-bench-tiny')}"]
    if name == "0.5b":  # a random Qwen2.5-0.5B trunk (tiny tokenizer), weights std 0.05 (gpu_rollout.py)
        import torch
        from gpu_rollout import build_trunk

        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return ["model=tiny", f"model.path={build_trunk('0.5b', dtype)}"]
    return [f"model={name}"] if name == "smollm2" else ["model=tiny", f"model.path={name}"]


def _base(args: argparse.Namespace) -> list[str]:
    model = _model(args.model)
    device = [f"backend.device={args.device}", f"++optim.device={args.device}"] if args.device != "cpu" else []
    return [*model, f"model.lora_rank={args.lora_rank}", f"model.lora_alpha={4 * args.lora_rank}",
            "model.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
            "optim=fsdp", f"optim.lr={args.lr}", "batching=c2", f"batching.batch_size={args.batch_size}",
            f"batching.rollouts_per_task={args.rollouts}", "trainer.total_steps=0", "trainer.checkpoint_every=0",
            f"seed={args.seed}", *device, *args.override]


async def run_setup(setup: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start the set-up's servers, measure, stop them; the row of the table."""
    n_proc = 1 if setup == "adapters" else n
    threads = args.threads or max(1, (os.cpu_count() or 1) // n_proc)
    root = Path(tempfile.mkdtemp(prefix=f"swarmkit-multilora-{setup}{n}-"))
    names = [f"rule_{LETTERS[k % len(LETTERS)]}{'' if k < len(LETTERS) else k}" for k in range(n)]
    servers: list[tuple[subprocess.Popen[bytes], str, Path]] = []
    try:
        for i in range(n_proc):
            run_dir = root / f"server_{i}"
            run_dir.mkdir()
            port = _free_port()
            servers.append((_start_server(run_dir, port, threads), f"http://127.0.0.1:{port}", run_dir))
        overrides = [*_base(args), *([f"model.adapters=[{','.join(names)}]"] if setup == "adapters" else [])]
        t_boot = time.perf_counter()

        async def boot(url: str) -> None:
            async with AsyncSwarmClient(url, token=TOKEN, retry_for=120) as ctl:
                await ctl.wait_for_state("OFFLINE", timeout=180)
                await ctl.configure(overrides)
                await ctl.start()
                await ctl.wait_for_state("ROLLING", timeout=900)
        await asyncio.gather(*(boot(url) for _, url, _ in servers))
        boot_s = time.perf_counter() - t_boot
        rss_boot = sum(peak_rss_bytes(proc.pid) for proc, _, _ in servers)
        if setup == "adapters":
            policies = [Policy(k, servers[0][1], names[k]) for k in range(n)]
        else:
            policies = [Policy(k, servers[k][1], None) for k in range(n)]
        print(f"  {setup} N={n}: {n_proc} process(es) ROLLING in {boot_s:.1f} s", flush=True)
        before = await evaluate(policies, args)
        tp = await throughput(policies, args)
        print(f"  {setup} N={n}: {tp['tokens_per_s']:.1f} tok/s", flush=True)
        tr = await train(policies, args)
        after = await evaluate(policies, args)
        rss_peak = sum(peak_rss_bytes(proc.pid) for proc, _, _ in servers)
        cuda = 0.0
        for _, url, _ in servers:
            async with AsyncSwarmClient(url, token=TOKEN) as ctl:
                cuda += float((await ctl.status())["engine"].get("cuda_max_allocated_bytes", 0.0))
    finally:
        for proc, _, _ in servers:
            proc.terminate()
        for proc, _, _ in servers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    step_times: list[float] = []
    train_rewards: dict[str, list[float]] = {p.name: [] for p in policies}
    for k, (_, _, run_dir) in enumerate(servers):
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        rows = [r for r in rows if r.get("kind", "train") == "train" and "step_time_s" in r]
        step_times += [float(r["step_time_s"]) for r in rows]
        for p in policies:  # each policy's training reward, step by step
            key = f"adapter/{p.adapter}/reward_mean" if p.adapter else "reward_mean"
            if p.adapter or p.url == servers[k][1]:
                train_rewards[p.name] += [float(r[key]) for r in rows if key in r]
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    row = {"setup": setup, "n": n, "seed": args.seed, "processes": n_proc, "torch_threads": threads, "boot_s": boot_s,
           "rss_after_boot_bytes": rss_boot, "rss_peak_bytes": rss_peak, "cuda_max_allocated_bytes": cuda,
           "rollout": tp, "train": tr, "step_time_s": summary(step_times), "steps_total": len(step_times),
           "policies": {p.name: {"letter": p.letter, "before": before[p.name], "after": after[p.name],
                                 "train_reward": train_rewards[p.name], **tr["per_policy"][p.name]} for p in policies}}
    if args.keep:
        row["run_dir"] = str(root)
    learned = ", ".join(f"{p.letter} {before[p.name]['mean']:.2f}->{after[p.name]['mean']:.2f} (train "
                        f"{_ends(train_rewards[p.name])})" for p in policies)
    print(f"  {setup} N={n} seed {args.seed}: peak RSS {rss_peak / 2**20:.0f} MiB, step {summary(step_times)['mean']:.2f} s, "
          f"train {tr['wall_s']:.0f} s; {learned}", flush=True)
    return row


def _ends(xs: list[float], k: int = 3) -> str:
    """The mean of the first and of the last ``k`` values: a training curve in one glance."""
    return f"{statistics.fmean(xs[:k]):.2f}->{statistics.fmean(xs[-k:]):.2f}" if xs else "-"


def _mib(b: float) -> str:
    return f"{b / 2**20:,.0f}"


def one_server_rss(rows: list[dict[str, Any]]) -> float:
    """Peak RSS of one server of one model: the N = 1 servers row, else the smallest servers row's per process."""
    one = [r["rss_peak_bytes"] for r in rows if r["n"] == 1 and r["setup"] == "servers"]
    per = [r["rss_peak_bytes"] / r["processes"] for r in rows if r["setup"] == "servers"]
    if one:
        return float(one[0])
    return float(min(per)) if per else float(rows[0]["rss_peak_bytes"])


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table: one line per (N, set-up), memory ratio against one server of one model."""
    one = one_server_rss(rows)
    cuda = any(r["cuda_max_allocated_bytes"] for r in rows)
    head = ["N", "set-up", "seed", "processes", "peak RSS MiB", "× one server"] + (["CUDA max alloc MiB"] if cuda else []) + [
        "rollout tok/s", "s / step (trainer)", "training wall s", "held-out reward before → after (95% CI) per rule"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        pol = "; ".join(f"{v['letter']}: {v['before']['mean']:.2f} → {v['after']['mean']:.2f} ± {v['after']['ci95']:.2f}"
                        for v in r["policies"].values())
        cells = [str(r["n"]), r["setup"], str(r.get("seed", 0)), str(r["processes"]), _mib(r["rss_peak_bytes"]),
                 f"{r['rss_peak_bytes'] / one:.2f}×"]
        if cuda:
            cells.append(_mib(r["cuda_max_allocated_bytes"]))
        cells += [f"{r['rollout']['tokens_per_s']:.0f}",
                  f"{r['step_time_s']['mean']:.3f} ± {r['step_time_s']['ci95']:.3f}",
                  f"{r['train']['wall_s']:.0f}", pol]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N, seed and rule: held-out reward after training, adapters - servers, with the interval of the
    difference (over the eval episodes of the one run: run-to-run noise is not in it; see :func:`over_seeds`)."""
    out = []
    for n, seed in sorted({(r["n"], r.get("seed", 0)) for r in rows}):
        a = next((r for r in rows if (r["n"], r.get("seed", 0), r["setup"]) == (n, seed, "adapters")), None)
        s = next((r for r in rows if (r["n"], r.get("seed", 0), r["setup"]) == (n, seed, "servers")), None)
        if a is None or s is None:
            continue
        for va, vs in zip(a["policies"].values(), s["policies"].values(), strict=True):
            diff = va["after"]["mean"] - vs["after"]["mean"]
            half = math.hypot(va["after"]["ci95"], vs["after"]["ci95"])
            out.append({"n": n, "seed": seed, "letter": va["letter"], "adapters": va["after"]["mean"],
                        "servers": vs["after"]["mean"], "diff": diff, "diff_ci95": half, "within": abs(diff) <= half})
        out.append({"n": n, "seed": seed, "memory_ratio": a["rss_peak_bytes"] / s["rss_peak_bytes"],
                    "memory_vs_one_server": a["rss_peak_bytes"] / one_server_rss(rows)})
    return out


def over_seeds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N and rule, over seeds: each set-up's held-out reward after training (mean ± 95% t-interval over
    seeds) and the difference adapters - servers with its Welch interval (t at the smaller degrees of freedom).
    This is the comparison the issue asks for: a seed is one whole run, so the interval holds run-to-run noise."""
    out = []
    for n in sorted({r["n"] for r in rows}):
        by_setup: dict[str, dict[str, list[float]]] = {"adapters": {}, "servers": {}}
        for r in rows:
            if r["n"] == n and r["setup"] in by_setup:
                for v in r["policies"].values():
                    by_setup[r["setup"]].setdefault(v["letter"], []).append(v["after"]["mean"])
        for letter in by_setup["adapters"]:
            xa, xs = by_setup["adapters"][letter], by_setup["servers"].get(letter, [])
            if len(xa) < 2 or len(xs) < 2:
                continue
            se = math.sqrt(statistics.variance(xa) / len(xa) + statistics.variance(xs) / len(xs))
            t = next((T95[k] for k in sorted(T95) if k >= min(len(xa), len(xs)) - 1), 1.96)
            diff = statistics.fmean(xa) - statistics.fmean(xs)
            out.append({"n": n, "letter": letter, "seeds": len(xa), "adapters": summary(xa), "servers": summary(xs),
                        "diff": diff, "diff_ci95": t * se, "within": abs(diff) <= t * se})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (the built-in one, weights std 0.1), 0.5b (a random "
                   "Qwen2.5-0.5B trunk, std 0.05), smollm2, or a local HF model folder")
    p.add_argument("--device", default="cpu", help="the servers' device: cpu or cuda (engine and trainer)")
    p.add_argument("--ns", default="1,2,4", help="numbers of policies")
    p.add_argument("--setups", default="adapters,servers")
    p.add_argument("--steps", type=int, default=20, help="training steps per policy")
    p.add_argument("--lr", type=float, default=5e-2)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2, help="tasks per step (batching=c2)")
    p.add_argument("--rollouts", type=int, default=8, help="episodes per task (the GRPO group)")
    p.add_argument("--groups", type=int, default=2, help="GRPO groups in flight per policy")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per reply (training and eval)")
    p.add_argument("--eval", type=int, default=64, help="held-out eval episodes per policy, before and after")
    p.add_argument("--eval-temperature", type=float, default=1.0)
    p.add_argument("--tp-episodes", type=int, default=8, help="concurrent episodes per policy, rollout measurement")
    p.add_argument("--tp-tokens", type=int, default=32, help="max_tokens of the rollout measurement")
    p.add_argument("--tp-rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads per server (0: CPUs / processes)")
    p.add_argument("--train-timeout", type=float, default=3600.0, help="seconds before the training phase fails")
    p.add_argument("--override", action="append", default=[], help="extra config override for every server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None, help="comma-separated seeds: every set-up once per seed, compared over "
                   "seeds (default: --seed alone)")
    p.add_argument("--keep", action="store_true", help="keep the run folders")
    p.add_argument("--json", default="benchmarks/results/multi_lora.json")
    p.add_argument("--smoke", action="store_true", help="N = 2, one step per policy, 4 eval episodes, no JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.device, args.ns, args.steps, args.batch_size, args.rollouts, args.groups = (
            "tiny", "cpu", "2", 1, 1, 2, 1)
        args.max_tokens, args.eval, args.tp_episodes, args.tp_tokens, args.tp_rounds, args.json = 4, 4, 2, 4, 1, None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ns = [int(x) for x in args.ns.split(",") if x.strip()]
    if max(ns) > len(LETTERS):
        p.error(f"--ns: at most {len(LETTERS)} policies (one letter each)")
    rows: list[dict[str, Any]] = []

    def save() -> None:  # after every row: a run stopped half way keeps what it measured
        if args.json:
            payload = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "cpu_count": os.cpu_count(),
                       "args": vars(args), "rows": rows, "compare": compare(rows), "over_seeds": over_seeds(rows)}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(payload, indent=1))

    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else [args.seed]
    for n in ns:
        for seed in seeds:
            for setup in args.setups.split(","):
                print(f"running {setup} N={n} seed {seed} ...", flush=True)
                rows.append(asyncio.run(run_setup(setup, n, argparse.Namespace(**{**vars(args), "seed": seed}))))
                save()
    print()
    print(f"{args.model} on {args.device}, LoRA r={args.lora_rank}, {args.steps} steps per policy of "
          f"{args.batch_size}×{args.rollouts} episodes, {os.cpu_count()} CPUs")
    print(table(rows))
    cmp = compare(rows)
    for c in cmp:
        if "letter" in c:
            print(f"N={c['n']} seed {c['seed']} rule {c['letter']}: adapters {c['adapters']:.3f} vs servers {c['servers']:.3f}, "
                  f"diff {c['diff']:+.3f} ± {c['diff_ci95']:.3f} ({'within' if c['within'] else 'OUTSIDE'} the interval)")
        else:
            print(f"N={c['n']} seed {c['seed']}: memory adapters/servers {c['memory_ratio']:.2f}, "
                  f"adapters / one server {c['memory_vs_one_server']:.2f}")
    for c in over_seeds(rows):
        print(f"N={c['n']} rule {c['letter']} over {c['seeds']} seeds: adapters {c['adapters']['mean']:.3f} ± "
              f"{c['adapters']['ci95']:.3f}, servers {c['servers']['mean']:.3f} ± {c['servers']['ci95']:.3f}, diff "
              f"{c['diff']:+.3f} ± {c['diff_ci95']:.3f} ({'within' if c['within'] else 'OUTSIDE'} the interval)")
    if args.json:
        save()
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
