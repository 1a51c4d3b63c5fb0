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
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--journal", required=True, type=Path)
    p.add_argument("--model", default="builtin:smollm2")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_merge.json"))
    args = p.parse_args()
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
