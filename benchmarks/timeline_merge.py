"""Timeline merging: fast vs reference merge time, and training tokens saved.

Run: ``python benchmarks/timeline_merge.py [--out benchmarks/results/timeline_merge.json] [--quick]``,
or ``python benchmarks/timeline_merge.py --smoke`` (n = 100 and 5-turn episodes only, nothing written; seconds).

(1) merge time of :func:`merge_timelines` vs the literal walk for n = 100,
    1,000, 5,000 timelines from synthetic multi-turn episodes (n / 10 concurrent
    episodes of 1-20 turns, calls interleaved in collection order); identical
    output is asserted.
(2) for episodes of 5, 10, 20, 40 turns: training tokens without merging (every
    call is a sample) vs with merging (the survivors), and their ratio.

Synthetic episode (token counts): system 200, task 100, per turn an LLM
completion of 60-140 and a tool observation of 100-300; the history block of
an earlier completion has the same text and tokens (no drift). The system prompt is
the same text and the same tokens in every episode (it used to draw random tokens per
episode for one text, which no tokenizer does).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from swarmkit.timelines import Block, merge

SYSTEM, TASK = 200, 100
#: the system prompt's tokens, shared by all episodes (as its text is)
SYSTEM_IDS = [random.Random(0).randrange(32000) for _ in range(SYSTEM)]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32000) for _ in range(n)]


def episode_calls(rng: random.Random, episode: int, turns: int, drift: bool = False) -> list[list[Block]]:
    """The timelines of one episode: call t sees every earlier turn as prompt.

    ``drift``: the re-rendered history has other token ids than the generated
    block (same text), so ``token`` match merges nothing across turns.
    """
    header = Block("template", "<|im_start|>assistant\n", [1, 77, 13])
    trailer = Block("template", "\n", [13])
    # one system prompt for every episode: same text, same tokens (a block of its own per episode)
    prompt = [Block("user", "system prompt", list(SYSTEM_IDS)),
              Block("user", f"task {episode}", _ids(rng, TASK))]
    calls = []
    for t in range(turns):
        gen_ids = _ids(rng, rng.randint(60, 140))
        gen_text = f"episode {episode} turn {t} " + " ".join(map(str, gen_ids[:8]))
        calls.append(prompt + [header, Block("llm", gen_text, gen_ids, [-0.5] * len(gen_ids))])
        hist_ids = gen_ids[1:] if drift else list(gen_ids)
        prompt = prompt + [header, Block("history", gen_text, hist_ids), trailer,
                           Block("env", f"obs {episode} {t}", _ids(rng, rng.randint(100, 300)))]
    return calls


def interleaved(rng: random.Random, n: int, max_turns: int = 20, drift: bool = False) -> list[list[Block]]:
    """About ``n`` timelines of ``n // 10`` concurrent episodes, in collection order."""
    per_episode = []
    total = 0
    e = 0
    while total < n:
        turns = min(rng.randint(1, max_turns), n - total)
        per_episode.append(episode_calls(rng, e, turns, drift))
        total += turns
        e += 1
    # collection order: a random interleaving that keeps each episode's calls in order
    events = [(rng.random() + t, e, t) for e, calls in enumerate(per_episode) for t in range(len(calls))]
    events.sort()
    return [per_episode[e][t] for _, e, t in events]


def time_merge(timelines, match: str, method: str, repeat: int = 1):
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = merge(timelines, match, method=method)
        best = min(best, time.perf_counter() - t0)
    return best, result


def bench_speed(sizes, match: str = "text", drift: bool = False) -> list[dict]:
    rows = []
    for n in sizes:
        ts = interleaved(random.Random(n), n, drift=drift)
        fast_s, fast = time_merge(ts, match, "fast", repeat=3)
        ref_s, ref = time_merge(ts, match, "reference")
        assert fast.absorbed_into == ref.absorbed_into and fast.timelines == ref.timelines
        rows.append({"workload": f"{match}{' drift' if drift else ''}", "n": len(ts), "survivors": sum(1 for x in ref.absorbed_into if x is None),
                     "blocks": sum(len(t) for t in ts), "fast_ms": fast_s * 1e3, "reference_ms": ref_s * 1e3,
                     "speedup": ref_s / fast_s})
    return rows


def bench_tokens(turn_counts, episodes: int = 20) -> list[dict]:
    rows = []
    for turns in turn_counts:
        rng = random.Random(turns)
        ts = [c for e in range(episodes) for c in episode_calls(rng, e, turns)]
        res = merge(ts, "text")
        without = sum(len(b) for t in ts for b in t)
        with_ = sum(len(b) for t in res.timelines for b in t)
        trainable = sum(sum(b.loss_mask) for t in res.timelines for b in t)
        assert trainable == sum(sum(b.loss_mask) for t in ts for b in t)  # nothing generated is lost
        rows.append({"turns": turns, "samples_without": len(ts), "samples_with": len(res.timelines),
                     "tokens_without": without, "tokens_with": with_, "ratio": without / with_})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/timeline_merge.json")
    ap.add_argument("--quick", action="store_true", help="n = 100, 1000 only")
    ap.add_argument("--smoke", action="store_true", help="n = 100, 5-turn episodes only, no JSON (seconds)")
    args = ap.parse_args(argv)
    sizes = [100] if args.smoke else [100, 1000] if args.quick else [100, 1000, 5000]
    speed = bench_speed(sizes, "text") + bench_speed(sizes, "token")
    # token match under tokenizer drift: nothing merges across turns, the literal walk is ~n^2
    speed += bench_speed(sizes, "token", drift=True)
    print("merge time, fast vs literal walk (identical output asserted)")
    print(f"{'workload':>12} {'n':>6} {'survivors':>9} {'fast ms':>9} {'reference ms':>13} {'speedup':>8}")
    for r in speed:
        print(f"{r['workload']:>12} {r['n']:>6} {r['survivors']:>9} {r['fast_ms']:>9.2f} "
              f"{r['reference_ms']:>13.1f} {r['speedup']:>7.1f}x")
    tokens = bench_tokens([5] if args.smoke else [5, 10, 20, 40])
    print("\ntraining tokens per 20 episodes, without vs with merging")
    print(f"{'turns':>5} {'samples':>13} {'tokens without':>15} {'tokens with':>12} {'ratio':>6}")
    for r in tokens:
        samples = f"{r['samples_without']} -> {r['samples_with']}"
        print(f"{r['turns']:>5} {samples:>13} {r['tokens_without']:>15,} {r['tokens_with']:>12,} {r['ratio']:>5.2f}x")
    if args.smoke:
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"speed": speed, "tokens": tokens}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
