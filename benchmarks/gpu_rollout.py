"""Rollout speed of the ``hf`` engine on one GPU, against the bandwidth limit and transformers' generate.

For each concurrency ``C`` (1, 8, 32, 128 by default) ``C`` requests of a
``--prompt``-token random prompt each generate ``--new`` tokens (EOS suppressed:
the engine's end-of-sequence set is emptied, so every sequence runs to
``max_tokens``), sampled at temperature 1, submitted together. After one
warm-up round (which captures the CUDA graphs) the script times one round and
reports:

- **engine tokens/s** (generated tokens / wall time of the round) and **ms per
  decode step** (wall time / decode steps);
- **the bandwidth limit**: ``C`` tokens per step over the fewest bytes a step
  must read (the weights once, plus each sequence's cached keys and values at
  its mean length) at the device-to-device copy bandwidth measured in the same
  run;
- **``model.generate``** with ``cache_implementation="static"`` (transformers'
  compiled static-cache path, no continuous batching), warm (``--generate 32,128``);
- **train/inference mismatch**: the engine's logprobs of its own sampled tokens
  against the trainer's forward (the same transformers model class with its
  default attention, full sequence, same dtype): mean |Δ logprob| and the KL
  estimate ``E[r - 1 - log r]``, ``r = p_trainer / p_engine`` (k3), per ``C``;
- **weight sync**: ``update_weights`` of the full weights (GPU tensors) against
  a device copy of the same tensors into preallocated ones.

The model is a random Qwen2.5-0.5B trunk (``--shape 0.5b``: 24 layers, hidden
896, 14 heads, 2 key/value heads) with swarmkit's built-in tiny tokenizer,
saved in bf16 to a temporary folder (nothing can be downloaded on the GPU
machine), or any model folder / ``builtin:NAME`` (``--model``).

    python benchmarks/gpu_rollout.py [--concurrency 1,8,32,128] [--prompt 256] [--new 256] [--generate 32,128] [--json out.json]
    python benchmarks/gpu_rollout.py --profile 32 [--pipeline on|off]  # where a step's time goes, at 32
    python benchmarks/gpu_rollout.py --smoke     # a 2-layer model on the CPU, seconds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _repo import (
    QWEN_05B,  # also makes the checkout importable (the GPU machine may not pip-install it)
)

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": QWEN_05B,
    "smoke": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=256),
}


def build_trunk(shape: str, dtype: torch.dtype) -> Path:
    """A random Qwen2 model of ``shape`` with the built-in tiny tokenizer, saved once to a temp folder."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from swarmkit.models import tiny_model_dir

    folder = Path(tempfile.gettempdir()) / f"swarmkit-trunk-{shape}-{str(dtype).split('.')[-1]}"
    if (folder / "config.json").exists():
        return folder
    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    cfg = Qwen2Config(**SHAPES[shape], vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # larger weights than the default init: varied, prompt-dependent continuations
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev: torch.device, smoke: bool) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = (1 << 22) if smoke else (1 << 30)
    a = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(dev)
    reps = 3 if smoke else 20
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    sync(dev)
    return 2 * a.numel() * a.element_size() * reps / (time.perf_counter() - t)


async def engine_round(backend: Any, prompts: list[list[int]], new: int, seed0: int) -> tuple[list[Any], float]:
    from swarmkit.contract import SamplingParams

    params = [SamplingParams(max_tokens=new, temperature=1.0, seed=seed0 + i) for i in range(len(prompts))]
    t = time.perf_counter()
    outs = await asyncio.gather(*(backend.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
    return [o[0] for o in outs], time.perf_counter() - t


def mismatch(ref_model: Any, prompts: list[list[int]], outs: list[Any], dev: torch.device) -> dict[str, float]:
    """Engine logprobs vs a full-sequence forward of ``ref_model`` (the trainer's implementation)."""
    deltas: list[torch.Tensor] = []
    k3: list[torch.Tensor] = []
    with torch.inference_mode():
        for i in range(0, len(prompts), 16):
            batch = list(zip(prompts[i:i + 16], outs[i:i + 16], strict=True))
            ids = torch.tensor([p + o.token_ids for p, o in batch], device=dev)
            logits = ref_model(input_ids=ids).logits.float()
            lp = torch.log_softmax(logits, dim=-1)
            for row, (p, o) in enumerate(batch):
                n = len(o.token_ids)
                tgt = torch.tensor(o.token_ids, device=dev)
                ref = lp[row, len(p) - 1:len(p) - 1 + n].gather(1, tgt[:, None])[:, 0]
                eng = torch.tensor(o.logprobs, device=dev)
                deltas.append((ref - eng).abs())
                r = torch.exp(ref - eng)
                k3.append(r - 1 - torch.log(r))
    d, k = torch.cat(deltas), torch.cat(k3)
    return {"mean_abs_dlogprob": float(d.mean()), "max_abs_dlogprob": float(d.max()), "kl_k3": float(k.mean())}


def generate_static(model: Any, prompts: list[list[int]], new: int, dev: torch.device) -> float:
    """Tokens/s of ``model.generate(cache_implementation="static")``, warm (second call timed)."""
    ids = torch.tensor(prompts, device=dev)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
              cache_implementation="static", pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **kw)
        sync(dev)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(dev)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - t)


async def weight_sync(backend: Any, dev: torch.device, repeats: int) -> dict[str, float]:
    named = [(k, v.detach().clone()) for k, v in backend.model.state_dict().items()]
    dsts = [torch.empty_like(v) for _, v in named]
    ts = []
    for i in range(repeats + 1):
        sync(dev)
        t = time.perf_counter()
        await backend.update_weights(named_tensors=named, version=100 + i)
        sync(dev)
        ts.append(time.perf_counter() - t)
    cs = []
    for _ in range(repeats + 1):
        sync(dev)
        t = time.perf_counter()
        for d, (_, s) in zip(dsts, named, strict=True):
            d.copy_(s)
        sync(dev)
        cs.append(time.perf_counter() - t)
    up, cp = statistics.median(ts[1:]), statistics.median(cs[1:])
    return {"update_weights_s": up, "copy_same_tensors_s": cp, "ratio_vs_copy": up / cp, "tensors": len(named)}


#: the parts of a decode step that profile_round times. The serial path's are synchronised (the device's work
#: is in them); the pipelined path's are host time only (a sync would stop the overlap they are there for)
SYNCED_PARTS = {"decode (graph replay)": "runner.decode", "sample (device)": "engine.sample",
                "to_host": "engine.to_host"}
HOST_PARTS = {"fused launch (inputs, replay)": "backend._launch", "wait for the step": "backend._await_flight",
              "bookkeeping (append, stops)": "backend._append_rows"}


async def profile_round(backend: Any, prompts: list[list[int]], new: int, dev: torch.device) -> dict[str, Any]:
    """Where a decode step's time goes, at one concurrency: (1) a round with the engine's parts timed
    (:data:`SYNCED_PARTS`, each synchronised, so they add up to more than an unsynchronised step, and
    :data:`HOST_PARTS`, the host's time in each: with one step in flight the device computes step t + 1
    during the bookkeeping of step t, and "wait for the step" is the host idle); (2) a round under
    torch.profiler, its ops by self CPU time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    from swarmkit_plugins.backend_hf import engine as engine_mod

    owners = {"runner": backend._runner, "engine": engine_mod, "backend": backend}
    parts: dict[str, float] = dict.fromkeys([*SYNCED_PARTS, *HOST_PARTS], 0.0)
    saved: list[tuple[Any, str, Any]] = []

    def timed(name: str, fn: Any, synced: bool) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            if synced:
                sync(dev)
            t = time.perf_counter()
            out = fn(*a, **k)
            if synced:
                sync(dev)
            parts[name] += time.perf_counter() - t
            return out
        return wrapper

    for table_, synced in ((SYNCED_PARTS, True), (HOST_PARTS, False)):
        for name, where in table_.items():
            owner, attr = where.split(".")
            obj = owners[owner]
            saved.append((obj, attr, obj.__dict__.get(attr)))
            setattr(obj, attr, timed(name, getattr(obj, attr), synced))
    try:
        backend.reset_stats()
        _, wall = await engine_round(backend, prompts, new, 2000)
    finally:
        for obj, attr, old in saved:
            if old is None:
                delattr(obj, attr)  # an instance's wrapper over its class's method
            else:
                setattr(obj, attr, old)
    steps = max(1, int(backend.stats["decode_steps"]))
    fused = int(backend.stats.get("fused_steps", 0))
    rest = wall - sum(parts.values())
    lines = [f"C={len(prompts)}: {1000 * wall / steps:.2f} ms per decode step ({fused} of {steps} fused, one "
             f"in flight; pipeline {'on' if backend.pipelined else 'off'}); its parts:"]
    lines += [f"  {k:30s} {1000 * v / steps:7.3f} ms" for k, v in [*parts.items(), ("the rest (Python)", rest)]
              if v or k == "the rest (Python)"]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        await engine_round(backend, prompts, new, 3000)
    ka = prof.key_averages()
    ops = ka.table(sort_by="self_cpu_time_total", row_limit=20)
    if dev.type == "cuda":
        ops += "\n" + ka.table(sort_by="self_device_time_total", row_limit=12)
    return {"breakdown": "\n".join(lines), "ms_per_step_parts": {k: 1000 * v / steps for k, v in parts.items()},
            "fused_steps": fused, "decode_steps": steps,
            "ms_per_step_rest": 1000 * rest / steps, "ops": ops}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from swarmkit.models import resolve_model_path
    from swarmkit_plugins.backend_hf.engine import HFBackend

    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    folder = build_trunk(args.shape, dtype) if args.model is None else resolve_model_path(args.model)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    backend = HFBackend(config={"device": str(dev), "dtype": str(dtype).split(".")[-1],
                                "max_batch_size": max(concurrency), "cuda_graphs": not args.no_graphs,
                                "fuse_projections": not args.no_fuse,
                                "pipeline": args.pipeline,
                                "max_prefill_tokens": max(16384, args.prompt * 32)},
                        model={"path": str(folder), "max_context": args.prompt + args.new + 64})
    await backend.start()
    backend._eos_ids = frozenset()  # EOS suppressed: every sequence runs to max_tokens
    vocab = backend.model.get_input_embeddings().num_embeddings
    params = sum(p.numel() * p.element_size() for p in backend.model.parameters())
    per_token_kv = backend._cache.bytes_per_token()
    bw = copy_bandwidth(dev, args.smoke)
    ref = None
    if not args.no_mismatch:
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for c in concurrency:
        prompts = [torch.randint(3, vocab, (args.prompt,), generator=g).tolist() for _ in range(c)]
        await engine_round(backend, prompts, args.new, 0)  # warm-up: graphs captured
        backend.reset_stats()
        outs, wall = await engine_round(backend, prompts, args.new, 1000)
        tokens = sum(len(o.token_ids) for o in outs)
        steps = max(1, int(backend.stats["decode_steps"]))
        mean_len = args.prompt + args.new / 2
        step_bytes = params + c * mean_len * per_token_kv
        row: dict[str, Any] = {
            "concurrency": c, "tokens": tokens, "wall_s": wall, "engine_tok_s": tokens / wall,
            "ms_per_step": 1000 * wall / steps, "decode_steps": steps,
            "fused_steps": int(backend.stats.get("fused_steps", 0)),
            "bandwidth_limit_tok_s": c * bw / step_bytes,
        }
        if ref is not None:
            row.update(mismatch(ref, prompts, outs, dev))
        rows.append(row)
        print(json.dumps(row), flush=True)
    profile = None
    if args.profile:
        c = args.profile
        prompts = [torch.randint(3, vocab, (args.prompt,), generator=g).tolist() for _ in range(c)]
        await engine_round(backend, prompts, args.new, 0)  # the graphs of this concurrency
        profile = await profile_round(backend, prompts, args.new, dev)
        print(profile["breakdown"], flush=True)
        print(profile["ops"], flush=True)
    sync_res = await weight_sync(backend, dev, 3 if args.smoke else 10)
    print(json.dumps(sync_res), flush=True)
    gen_at = {int(c) for c in args.generate.split(",") if c}
    for row in rows:  # after the engine's rows: compiling generate's static cache takes minutes
        if row["concurrency"] in gen_at:
            if ref is None:
                ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(dev).eval()
            g2 = torch.Generator().manual_seed(1)
            prompts = [torch.randint(3, vocab, (args.prompt,), generator=g2).tolist()
                       for _ in range(row["concurrency"])]
            try:
                row["generate_static_tok_s"] = generate_static(ref, prompts, args.new, dev)
            except Exception as exc:  # noqa: BLE001 - report, keep measuring
                row["generate_static_error"] = f"{type(exc).__name__}: {exc}"[:300]
            print(json.dumps({k: v for k, v in row.items() if k.startswith("generate") or k == "concurrency"}),
                  flush=True)
    runner = backend._runner
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "dtype": str(dtype),
            "model": str(args.model or args.shape), "prompt": args.prompt, "new": args.new,
            "copy_bandwidth_gb_s": bw / 1e9, "weights_bytes": params, "kv_bytes_per_token": per_token_kv,
            "cuda_graphs": runner.use_graphs, "pipelined": backend.pipelined, "fused_groups": backend.fused_groups, "graphs_captured": runner.graphs,
            "graph_capture_s": runner.capture_s,
            "graph_failed": runner.graph_failed, "fused_failed": runner.fused_failed, "torch": torch.__version__}
    await backend.close()
    return {"info": info, "rows": rows, "weight_sync": sync_res, "profile": profile}


def table(res: dict[str, Any]) -> str:
    i = res["info"]
    lines = [f"device {i['device']}, {i['dtype']}, model {i['model']}, {i['prompt']} + {i['new']} tokens, "
             f"copy bandwidth {i['copy_bandwidth_gb_s']:.0f} GB/s, pipeline {'on' if i.get('pipelined') else 'off'}, fused groups {i.get('fused_groups', 0)}, "
             f"graphs {i['graphs_captured']} "
             f"({i['graph_capture_s']:.1f} s to capture){', FAILED: ' + i['graph_failed'] if i['graph_failed'] else ''}"
             f"{', fused step FAILED: ' + i['fused_failed'] if i.get('fused_failed') else ''}",
             "", "| C | engine tok/s | ms/step | bandwidth limit tok/s | of limit | generate(static) tok/s "
             "| mean abs dlogprob | KL (k3) |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        gen = f"{r['generate_static_tok_s']:,.0f}" if "generate_static_tok_s" in r else "—"
        lines.append(f"| {r['concurrency']} | {r['engine_tok_s']:,.0f} | {r['ms_per_step']:.2f} | "
                     f"{r['bandwidth_limit_tok_s']:,.0f} | {r['engine_tok_s'] / r['bandwidth_limit_tok_s']:.1%} | "
                     f"{gen} | {r.get('mean_abs_dlogprob', float('nan')):.2e} | {r.get('kl_k3', float('nan')):.2e} |")
    w = res["weight_sync"]
    lines += ["", f"weight sync: update_weights {1000 * w['update_weights_s']:.2f} ms, device copy of the same "
              f"{w['tensors']} tensors {1000 * w['copy_same_tensors_s']:.2f} ms: {w['ratio_vs_copy']:.2f}x a copy"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    ap.add_argument("--model", default=None, help="a model folder or builtin:NAME instead of a random trunk")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--generate", default="", help="concurrencies at which to also time model.generate with "
                    "a static cache, e.g. 32,128 (compiles: minutes)")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly (no CUDA graphs)")
    ap.add_argument("--pipeline", default="auto", choices=["auto", "on", "off"],
                    help="the engine's backend.pipeline: one fused step in flight (auto: on with CUDA graphs)")
    ap.add_argument("--no-mismatch", action="store_true")
    ap.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up as separate matmuls "
                    "(backend.fuse_projections=false)")
    ap.add_argument("--profile", type=int, default=0, metavar="C",
                    help="also profile one round at concurrency C: each part's time, and torch.profiler's ops")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer model on the CPU, small workload")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.concurrency, args.prompt, args.new = "smoke", "1,4", 16, 8
        args.generate, args.profile = "4", 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    res = asyncio.run(run(args))
    print(table(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
