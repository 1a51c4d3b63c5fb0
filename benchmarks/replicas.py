"""One server, one vs several inference replicas (``backend.replicas``).

Two measurements:

1. **Rollout throughput**: a server (in this process, real HTTP on 127.0.0.1, the
   ``hf`` backend) serves ``--episodes`` multi-turn episodes, ``--concurrency`` at
   a time, for each replica count of ``--replicas``; reported: generated tokens per
   second (``status.tokens_generated`` over the wall time), calls per second, the
   calls each replica served, and the ratio against one replica from the same run.
   Replica ``i`` runs on ``--devices[i]`` when given (e.g. ``cuda:0,cuda:1``; on
   one GPU, ``cuda:0,cuda:0`` puts both on it).
2. **Balancer overhead**: the latency a :class:`ReplicaSet` adds to a call, in
   process, over zero-compute engines: p50 / p90 of ``set.generate`` minus the same
   engine called directly (``--calls`` each, interleaved), plus ``Balancer.pick``
   alone. Target: ≤ 0.2 ms p50.

    python benchmarks/replicas.py                                # tiny model, CPU, 1 vs 2 replicas
    python benchmarks/replicas.py --model smollm2 --episodes 32 --max-tokens 32
    python benchmarks/replicas.py --model PATH --devices cuda:0,cuda:0 --json benchmarks/results/replicas_h200.json
    python benchmarks/replicas.py --smoke                        # tiny model, 1 vs 2 replicas, a few calls, no JSON
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-replicas-" + "x" * 16


def _config(model: str, replicas: int, devices: list[str], batch_size: int) -> Any:
    from omegaconf import OmegaConf

    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    path = {"tiny": "builtin:tiny", "smollm2": "builtin:smollm2"}.get(model, model)
    overrides = [f"model.path={path}", "model.lora_rank=0", f"backend.max_batch_size={batch_size}"]
    if replicas > 1:
        overrides.append(f"+backend.replicas={replicas}")
        if devices:
            overrides.append(f"+backend.replica_devices=[{','.join(devices[:replicas])}]")
    elif devices:
        overrides.append(f"backend.device={devices[0]}")
    cfg = OmegaConf.create(OmegaConf.to_container(validate_config(compose(overrides), get_registry()), resolve=True))
    cfg.logger = []
    return cfg


def rollout(model: str, replicas: int, devices: list[str], episodes: int, concurrency: int, turns: int,
            max_tokens: int, batch_size: int) -> dict[str, Any]:
    """Tokens/s of ``episodes`` episodes of ``turns`` chat calls against one server with ``replicas`` engines."""
    import tempfile

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient

    cfg = _config(model, replicas, devices, batch_size)
    with tempfile.TemporaryDirectory() as run_dir:
        h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN, "run_dir": run_dir}},
                                config=cfg, train=False)
        try:
            with SwarmClient(h.url, token=TOKEN, retry_for=60) as c:
                c.start()
                c.wait_for_state("ROLLING", timeout=600)

                def episode(i: int) -> int:
                    with c.episode(f"bench-{i}") as ep, httpx.Client(base_url=ep.base_url, timeout=600,
                                                                     headers={"Authorization": f"Bearer {ep.api_key}"}) as http:
                        messages = [{"role": "user", "content": f"Tell me a story about the number {i}."}]
                        for _ in range(turns):
                            r = http.post("/chat/completions", json={"model": "m", "messages": messages,
                                                                     "max_tokens": max_tokens, "temperature": 1.0})
                            r.raise_for_status()
                            text = r.json()["choices"][0]["message"]["content"]
                            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}]
                        ep.abort("benchmark episode")  # nothing to train on
                    return turns

                with ThreadPoolExecutor(concurrency) as pool:  # warm-up: one wave, not timed
                    list(pool.map(episode, range(concurrency)))
                st0 = c.status()
                t0 = time.perf_counter()
                with ThreadPoolExecutor(concurrency) as pool:
                    calls = sum(pool.map(episode, range(concurrency, concurrency + episodes)))
                wall = time.perf_counter() - t0
                st1 = c.status()
        finally:
            h.stop()
    tokens = st1["tokens_generated"] - st0["tokens_generated"]
    per_replica = [r["calls"] - r0["calls"] for r, r0 in zip(st1.get("replicas") or [], st0.get("replicas") or [],
                                                               strict=True)]
    return {"replicas": replicas, "devices": devices[:replicas], "episodes": episodes, "calls": calls,
            "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "calls_per_s": calls / wall,
            "calls_per_replica": per_replica or [calls]}


def overhead(calls: int) -> dict[str, Any]:
    """Per-call latency added by the replica set over zero-compute engines (µs), and ``pick`` alone."""
    from swarmkit.contract import SamplingParams
    from swarmkit.contract.backend import ROUTING_KEY
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.swarm.replicas import Balancer, Replica, ReplicaSet
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()
    direct = ScriptedBackend(tok, replies=["ok"])
    rset = ReplicaSet([ScriptedBackend(tok, replies=["ok"]) for _ in range(2)])
    params = SamplingParams(max_tokens=4)
    prompt = [1, 2, 3]

    async def go() -> tuple[list[float], list[float]]:
        await direct.start()
        await rset.start()
        a, b = [], []
        for i in range(calls):
            ROUTING_KEY.set(f"ep-{i % 256}")  # 256 live episodes, each called again and again
            t = time.perf_counter_ns()
            await direct.generate(prompt, params)
            a.append(time.perf_counter_ns() - t)
            t = time.perf_counter_ns()
            await rset.generate(prompt, params)
            b.append(time.perf_counter_ns() - t)
        return a, b

    a, b = asyncio.run(go())
    bal = Balancer([Replica(i, None) for i in range(8)])  # type: ignore[arg-type]
    picks = []
    for i in range(calls):
        t = time.perf_counter_ns()
        bal.pick(f"ep-{i % 4096}")
        picks.append(time.perf_counter_ns() - t)

    def q(xs: list[float], p: float) -> float:
        return statistics.quantiles(xs, n=100)[int(p) - 1] / 1000.0

    added = [y - x for x, y in zip(a, b, strict=True)]
    return {"calls": calls, "direct_p50_us": q(a, 50), "set_p50_us": q(b, 50),
            "added_p50_us": statistics.median(added) / 1000.0, "added_p90_us": q(added, 90),
            "pick_p50_us": q(picks, 50), "pick_p99_us": q(picks, 99)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a local model folder")
    p.add_argument("--replicas", default="1,2", help="replica counts to compare (comma-separated)")
    p.add_argument("--devices", default="", help="devices of the replicas, e.g. cuda:0,cuda:1 (default: the backend's)")
    p.add_argument("--episodes", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=32, help="backend.max_batch_size of each replica")
    p.add_argument("--calls", type=int, default=20000, help="calls of the overhead measurement")
    p.add_argument("--json", default="benchmarks/results/replicas.json")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 vs 2 replicas, 2 one-turn episodes of "
                   "4 tokens, 200 overhead calls, no JSON (seconds, on the CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.replicas, args.devices, args.json = "tiny", "1,2", "", None
        args.episodes, args.concurrency, args.turns, args.max_tokens, args.batch_size, args.calls = 2, 2, 1, 4, 4, 200
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    devices = [d for d in args.devices.split(",") if d]
    counts = [int(x) for x in args.replicas.split(",")]
    rows = [rollout(args.model, n, devices, args.episodes, args.concurrency, args.turns, args.max_tokens,
                    args.batch_size) for n in counts]
    base = rows[0]["tokens_per_s"]
    print(f"\nrollout throughput ({args.model}, {args.episodes} episodes x {args.turns} turns, "
          f"{args.max_tokens} tokens/turn, concurrency {args.concurrency})")
    print(f"{'replicas':>8} {'devices':>16} {'tokens/s':>9} {'calls/s':>8} {'vs 1':>6}  calls per replica")
    for r in rows:
        print(f"{r['replicas']:>8} {','.join(r['devices']) or 'default':>16} {r['tokens_per_s']:>9.1f} "
              f"{r['calls_per_s']:>8.2f} {r['tokens_per_s'] / base:>5.2f}x  {r['calls_per_replica']}")
    ov = overhead(args.calls)
    print(f"\nbalancer overhead ({ov['calls']} calls, zero-compute engines, in process)")
    print(f"  direct call p50 {ov['direct_p50_us']:.1f} us; through the replica set p50 {ov['set_p50_us']:.1f} us")
    print(f"  added per call: p50 {ov['added_p50_us']:.1f} us, p90 {ov['added_p90_us']:.1f} us "
          f"(target <= 200 us p50: {'met' if ov['added_p50_us'] <= 200 else 'NOT met'})")
    print(f"  Balancer.pick alone: p50 {ov['pick_p50_us']:.2f} us, p99 {ov['pick_p99_us']:.2f} us")
    payload = {"argv": sys.argv[1:], "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
               "rollout": rows, "overhead": ov}
    try:
        import torch

        if torch.cuda.is_available():
            payload["machine"]["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(payload, indent=1))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
