"""Timeline merging on vs off on real multi-turn tool episodes (the ``calc_agent`` task).

Reads the sampled (non-demonstration) episodes of a run's journal — e.g. the
main job ``python -m swarmkit task=calc_agent server.run_dir=runs/calc`` — and
builds the training samples twice, with ``match=text`` (merging) and
``match=none`` (every call is its own sample), then times one actor update
(``FSDPEngine.train_step``, the run's model and LoRA settings) on each set, on
the same engine state (learning rate 1e-9, after one untimed warm-up step). Prints a
table and writes JSON.

    python benchmarks/agent_merge.py --journal runs/calc/journal.sqlite [--model builtin:smollm2]
        [--episodes 16] [--repeats 2] [--out benchmarks/results/agent_merge.json]
    python benchmarks/agent_merge.py --smoke      # tiny model, 4 scripted calc_agent episodes, no JSON; seconds

``--smoke`` makes its own journal first: 4 ``calc_agent`` episodes (the task's own
agent loop, ``run_calc_episode``) against a server in this process whose engine
answers from a script (a calculator call, then the answer), so every episode has
two calls; then it times one update per set on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from swarmkit.models import resolve_model_path
from swarmkit.pool.journal import SamplePool
from swarmkit.training.samples import build_samples
from swarmkit.training.trainer import build_algo
from swarmkit_plugins.optim_fsdp.engine import FSDPEngine


def load_episodes(journal: Path, n: int) -> list:
    with SamplePool(journal) as pool:
        records = [r for r in pool.iter_all() if not r.meta.get("demonstration") and len(r.timelines) > 1]
    return records[:n]


def smoke_journal(run_dir: Path, n: int) -> Path:
    """A journal of ``n`` two-call ``calc_agent`` episodes, from a scripted engine behind a real server."""
    import httpx

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.swarm.cycle import JOURNAL_FILE
    from swarmkit.tasks import make_tasks
    from swarmkit.tasks.calc_agent import run_calc_episode
    from swarmkit.testing.scripted import ScriptedBackend

    tasks = make_tasks("calc_agent", n, split="train")
    tok = build_tiny_tokenizer()

    def script(ids: list[int]) -> str:  # the agent: call the calculator, then answer with its result
        prompt = tok.decode(ids)
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", prompt, re.S)
        if results:
            return f"<answer>{results[-1]}</answer>"
        task = next(t for t in tasks if t.messages[1]["content"] in prompt)
        call = {"name": "calculator", "arguments": {"expression": task.meta["expression"]}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"

    backend = ScriptedBackend(tok, replies=script)
    # the journal comes with the training cycle; its batch is never full, so no step runs
    cfg = validate_config(compose(["model=tiny", "batching.batch_size=1000000"]), get_registry())
    token = "bench-agent-merge-" + "x" * 16
    handle = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": token,
                                             "run_dir": str(run_dir)}},
                                 config=cfg, backend_factory=lambda c: backend, step_fn=lambda records, step: {})
    try:
        with SwarmClient(handle.url, token=token, retry_for=30) as client, httpx.Client(timeout=60) as http:
            client.start()
            client.wait_for_state("ROLLING", timeout=60)
            for task in tasks:
                with client.episode(task.task_id) as ep:
                    outcome = run_calc_episode(http, ep.base_url, ep.api_key, task, max_tokens=64)
                    ep.report(outcome.reward)
    finally:
        handle.stop()
    return run_dir / JOURNAL_FILE


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--journal", type=Path, help="the run's journal.sqlite (required unless --smoke)")
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_merge.json"))
    p.add_argument("--smoke", action="store_true", help="tiny model, 4 scripted calc_agent episodes, one timed "
                   "update per set, no JSON (seconds, on the CPU)")
    args = p.parse_args()
    smoke_dir = None
    if args.smoke:
        smoke_dir = Path(tempfile.mkdtemp(prefix="swarmkit-bench-agent-merge-"))
        args.model, args.episodes, args.repeats, args.out = "builtin:tiny", 4, 1, None
        args.journal = smoke_journal(smoke_dir, args.episodes)
    elif args.journal is None:
        p.error("--journal is required (or --smoke)")
    try:
        return run(args)
    finally:
        if smoke_dir is not None:
            shutil.rmtree(smoke_dir, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    records = load_episodes(args.journal, args.episodes)
    if not records:
        raise SystemExit(f"{args.journal}: no sampled episode with more than one call")
    algo = build_algo({"name": "grpo"})
    engine = FSDPEngine(resolve_model_path(args.model), {"lora_rank": args.lora_rank, "lora_alpha": 2 * args.lora_rank},
                        {"lr": 1e-9, "token_budget": 8192}, algo)
    engine.train_step(build_samples(records[:2], algo, "text"))  # warm-up (allocations, first-call costs)
    rows = {}
    for match in ("text", "none"):
        samples = build_samples(records, algo, match)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.train_step(samples)
            times.append(time.perf_counter() - t0)
        rows[match] = {
            "samples": len(samples),
            "timelines": sum(len(r.timelines) for r in records),
            "trained_tokens": sum(sum(s.loss_mask) for s in samples),
            "forwarded_tokens": sum(len(s.input_ids) for s in samples),
            "update_s_median": statistics.median(times),
            "update_s": times,
        }
    on, off = rows["text"], rows["none"]
    out = {"journal": str(args.journal), "model": args.model, "episodes": len(records),
           "calls_per_episode": on["timelines"] / len(records), "merge_on": on, "merge_off": off,
           "forwarded_ratio_off_on": off["forwarded_tokens"] / on["forwarded_tokens"],
           "update_time_ratio_off_on": off["update_s_median"] / on["update_s_median"]}
    print(f"{len(records)} calc_agent episodes, {out['calls_per_episode']:.2f} calls each, model {args.model}")
    print(f"{'':12}{'samples':>9}{'trained tok':>13}{'forwarded tok':>15}{'update s':>10}")
    for name, r in (("merge on", on), ("merge off", off)):
        print(f"{name:12}{r['samples']:>9}{r['trained_tokens']:>13}{r['forwarded_tokens']:>15}"
              f"{r['update_s_median']:>10.2f}")
    print(f"off/on: forwarded tokens x{out['forwarded_ratio_off_on']:.2f}, "
          f"actor-update time x{out['update_time_ratio_off_on']:.2f}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
