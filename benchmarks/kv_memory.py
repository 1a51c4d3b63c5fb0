"""Memory of the ``hf`` engine's KV cache for one long prompt: the cache's shape and bytes, the process's peak RSS.

One request of a ``--prompt``-token prompt with the ``max_tokens`` a chat call without one gets (the room
left in the context) streams ``--tokens`` tokens; the script prints the cache's shape, its bytes, the
budget (``backend.kv_cache_memory``) and the process's peak RSS. Before the budget the cache was sized
``max_batch_size`` slots x the context (SmolLM2 on a CPU: 32 x 8,193 positions x 45 KiB = 12 GB for one
4k-token prompt); now it holds what the running sequences need, within the budget.

    python benchmarks/kv_memory.py --model builtin:smollm2 --prompt 4000          # docs/backends.md's numbers
    /usr/bin/time -v python benchmarks/kv_memory.py --model builtin:smollm2 --prompt 4000 --max-batch-size 8
    python benchmarks/kv_memory.py --smoke                                         # the tiny model, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from typing import Any

import _repo  # noqa: F401 - the checkout on sys.path


async def measure(model: str, prompt_len: int, tokens: int, max_batch_size: int, kv_cache_memory: str | None,
                  device: str) -> dict[str, Any]:
    from swarmkit.contract import SamplingParams
    from swarmkit_plugins.backend_hf.engine import HFBackend

    cfg: dict[str, Any] = {"device": device, "max_batch_size": max_batch_size}
    if kv_cache_memory is not None:
        cfg["kv_cache_memory"] = kv_cache_memory
    b = HFBackend(config=cfg, model={"path": model})
    await b.start()
    try:
        context = int(b.max_context or 2 * prompt_len)
        prompt = [(37 * k + 11) % 40000 % (b.model.get_input_embeddings().num_embeddings - 100) + 100
                  for k in range(prompt_len)]
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=context - prompt_len)
        t0, n = time.perf_counter(), 0
        async for chunk in b.stream(prompt, params):
            n += len(chunk.token_ids)
            if n >= tokens:
                break
        cache = b._cache
        return {"model": model, "prompt": prompt_len, "max_tokens": params.max_tokens, "tokens": n,
                "seconds": round(time.perf_counter() - t0, 2), "max_batch_size": max_batch_size,
                "cache_slots": cache.slots, "cache_capacity": cache.capacity, "cache_bytes": cache.nbytes(),
                "kv_budget_bytes": b.kv_budget_bytes, "kv_cache_memory": b.cfg.kv_cache_memory,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    finally:
        await b.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2")
    ap.add_argument("--prompt", type=int, default=4000, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=8, help="tokens to stream before the request is dropped")
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--kv-cache-memory", default=None, help="backend.kv_cache_memory (default: the engine's)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="the tiny model, a 300-token prompt, 2 tokens")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.prompt, args.tokens = "builtin:tiny", 300, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    row = asyncio.run(measure(args.model, args.prompt, args.tokens, args.max_batch_size, args.kv_cache_memory,
                              args.device))
    gb = 1e9
    print(f"{row['model']}: prompt {row['prompt']} + max_tokens {row['max_tokens']}, {row['tokens']} tokens in "
          f"{row['seconds']} s; cache {row['cache_slots']} slots x {row['cache_capacity']} = "
          f"{row['cache_bytes'] / gb:.2f} GB (budget {row['kv_budget_bytes'] / gb:.2f} GB, "
          f"kv_cache_memory={row['kv_cache_memory']}); peak RSS {row['peak_rss_bytes'] / gb:.2f} GB")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
