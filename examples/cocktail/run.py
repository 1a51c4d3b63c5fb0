"""Cocktail training: two clients with different tasks feed one swarm server at once.

One server (the embedded SmolLM2 with its tool template, LoRA) is fed by two
client processes that know nothing of each other:

- the tool agent (``python -m swarmkit.apps.task_client --task calc_agent``):
  multi-turn word problems with a calculator tool, after a supervised warm start
  of demonstrations;
- the game client (``examples/who_is_spy/run.py client``): "Who is the Spy",
  both roles on this server.

The pool mixes them under ``batching.cocktail`` (each family's share of a
batch, in tasks; default 0.5 / 0.5), and the server logs every step's metrics
per task family (``reward_mean/<family>``, ``episodes/<family>``,
``tokens/<family>``, ``eval_reward/<family>`` from the clients' held-out eval
episodes) in ``metrics.jsonl`` and TensorBoard. At the end the journal is
read back to check that every trained batch kept the caps.

With ``--adapters`` the same two clients train three LoRA adapters of one base
instead of one shared model (``model.adapters=[tools,civilians,spies]``): the
tool agent its own ``tools``, the game's civilians and spies theirs. A step
then trains one adapter on its own episodes only, so no batch mixes families
and ``--cocktail`` is not used (a cap below 1 on an adapter's only family would
hold its batches back for ever); every step's line names its adapter::

    python examples/cocktail/run.py                     # SmolLM2 on CPU, 12 steps
    python examples/cocktail/run.py --adapters          # the same, three adapters of one base
    python examples/cocktail/run.py --model tiny --steps 3 --max-tokens 8   # a quick look
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmkit.apps.processes import DEFAULT_TOKEN, boot_servers, launch_server, server_env
from swarmkit.swarm.metrics import read_metrics

HERE = Path(__file__).resolve().parent
SPY = HERE.parent / "who_is_spy" / "run.py"
FAMILIES = ("calc_agent", "who_is_spy")
#: ``--adapters``: the adapter of the tool agent, and of each role of the game
ADAPTERS = {"calc_agent": "tools", "civilian": "civilians", "spy": "spies"}


def batch_families(run_dir: Path) -> dict[int, collections.Counter]:
    """Trained step → task family → tasks (distinct task ids) in that step's batch, from the journal."""
    db = sqlite3.connect(f"file:{run_dir / 'journal.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT trained_step, task_family, task_id FROM episodes "
                          "WHERE status = 'trained'").fetchall()
    finally:
        db.close()
    tasks: dict[int, set[tuple[str, str]]] = collections.defaultdict(set)
    for step, fam, task in rows:
        tasks[int(step)].add((fam, task))
    return {step: collections.Counter(f for f, _ in pairs) for step, pairs in sorted(tasks.items())}


def check_caps(batches: dict[int, collections.Counter], caps: dict[str, float], batch_size: int) -> list[str]:
    """Steps whose batch broke a cap (a family over ``share * batch_size`` tasks); [] when all kept them."""
    bad = []
    for step, counts in batches.items():
        for fam, n in counts.items():
            if fam in caps and n > caps[fam] * batch_size + 1e-9:
                bad.append(f"step {step}: {n} {fam} tasks > {caps[fam]} x {batch_size}")
    return bad


def family_line(m: dict[str, Any]) -> str:
    trained = [k.split("/")[1] for k in m if k.startswith("adapter/") and k.endswith("/step")]  # its adapter
    parts = [f"[{trained[0]}]"] if trained else []
    for fam in FAMILIES:
        if f"episodes/{fam}" in m or f"demonstrations/{fam}" in m:
            r = m.get(f"reward_mean/{fam}")
            parts.append(f"{fam}: {int(m.get(f'episodes/{fam}', 0))} ep"
                         + (f" reward {r:.3f}" if r is not None else "")
                         + (f" +{int(m[f'demonstrations/{fam}'])} demo" if f"demonstrations/{fam}" in m else "")
                         + f" {int(m.get(f'tokens/{fam}', 0))} tok"
                         + (f" eval {m[f'eval_reward/{fam}']:.3f}" if f"eval_reward/{fam}" in m else ""))
    return f"step {int(m['step']):>3}  " + "  |  ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 or tiny")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=4, help="tasks per step (batching.batch_size)")
    p.add_argument("--rollouts", type=int, default=4, help="episodes per task (batching.rollouts_per_task)")
    p.add_argument("--cocktail", default="calc_agent=0.5,who_is_spy=0.5", help="family=share,... (batching.cocktail)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--sft-lr", type=float, default=2e-3)
    p.add_argument("--demonstrations", type=int, default=64, help="calc_agent warm-start demonstrations")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--eval-every", type=int, default=8, help="each client: one eval episode per this many")
    p.add_argument("--token", default=os.environ.get("SWARMKIT_ADMIN_TOKEN") or DEFAULT_TOKEN)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--out", default=None, help="write the summary JSON here")
    p.add_argument("--adapters", action="store_true", help="three LoRA adapters of one base: tools (the tool agent), "
                   "civilians and spies (the game's roles), instead of one shared model")
    args = p.parse_args(argv)
    # with adapters each adapter trains one family, so a cap below 1 would hold its batches back for ever
    caps = {} if args.adapters else {k: float(v) for k, v in (item.split("=") for item in args.cocktail.split(",")
                                                               if item)}
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="swarmkit-cocktail-"))
    server = launch_server("cocktail", work / "server", token=args.token)
    clients: list[subprocess.Popen] = []
    try:
        cocktail = "{" + ",".join(f"{k}:{v}" for k, v in caps.items()) + "}"
        boot_servers([server], {"cocktail": [
            f"model={args.model}", "batching=c2", f"batching.batch_size={args.batch_size}",
            f"batching.rollouts_per_task={args.rollouts}", *([f"batching.cocktail={cocktail}"] if caps else []),
            f"optim.lr={args.lr}", f"optim.sft_lr={args.sft_lr}", f"trainer.total_steps={args.steps}",
            "trainer.checkpoint_every=0", "server.drain_timeout_s=120", "server.drain_idle_s=120",
            *(["model.lora_rank=8", f"model.adapters=[{','.join(ADAPTERS.values())}]"] if args.adapters else [])]}, timeout=args.timeout)
        print(f"server {server.url}  model {args.model}  caps {caps}  run dir {server.run_dir}", flush=True)
        env = server_env(args.token)
        logs = {name: open(work / f"{name}.log", "ab") for name in FAMILIES}  # noqa: SIM115
        clients.append(subprocess.Popen(
            [sys.executable, "-m", "swarmkit.apps.task_client", "--url", server.url, "--task", "calc_agent",
             "--demonstrations", str(args.demonstrations), "--rollouts-per-task", str(args.rollouts),
             "--max-tokens", str(args.max_tokens), "--concurrency", "4", "--eval-every", str(args.eval_every),
             "--client-id", "calc-agent-client",
             *(["--adapter", ADAPTERS["calc_agent"]] if args.adapters else [])], env=env, stdout=logs["calc_agent"], stderr=subprocess.STDOUT))
        clients.append(subprocess.Popen(
            [sys.executable, str(SPY), "client", "--route", f"civilian={server.url}", "--route", f"spy={server.url}",
             "--rollouts", str(args.rollouts), "--max-tokens", str(min(24, args.max_tokens)), "--concurrency", "2",
             "--eval-every", str(args.eval_every), "--client-id", "spy-client",
             *([a for role in ("civilian", "spy") for a in ("--adapter", f"{role}={ADAPTERS[role]}")]
               if args.adapters else [])],
            env=env, stdout=logs["who_is_spy"], stderr=subprocess.STDOUT))
        ctl = server.client()
        t0 = time.perf_counter()
        shown = 0
        while True:
            rows = [r for r in read_metrics(server.run_dir) if r.get("kind") == "train"]
            for m in rows[shown:]:
                print(family_line(m), flush=True)
            shown = len(rows)
            if shown >= args.steps:
                break
            for c in clients:
                if c.poll() is not None:
                    raise RuntimeError(f"a client exited with {c.returncode}; see {work}/*.log")
            if ctl.status()["state"] == "OFFLINE" or time.perf_counter() - t0 > args.timeout:
                raise RuntimeError(f"the server stopped or the run timed out; see {server.run_dir}/server.log")
            time.sleep(1.0)
        batches = batch_families(server.run_dir)
        broken = check_caps(batches, caps, args.batch_size)
        print(f"{len(batches)} trained batches, tasks per family: "
              + "; ".join(f"{s}: {dict(c)}" for s, c in batches.items()))
        print("every batch kept the caps" if not broken else "CAPS BROKEN: " + "; ".join(broken))
        if args.out:
            Path(args.out).write_text(json.dumps({"caps": caps, "batches": {s: dict(c) for s, c in batches.items()},
                                                  "broken": broken, "steps": rows, "wall_s": time.perf_counter() - t0},
                                                 indent=2))
        return 1 if broken else 0
    finally:
        for c in clients:
            if c.poll() is None:
                c.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.wait(10)
            if c.poll() is None:
                c.kill()
        with contextlib.suppress(Exception):
            server.client(retry_for=5).stop()
        server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
