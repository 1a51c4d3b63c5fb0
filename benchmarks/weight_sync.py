"""Seconds per weight sync into the inference engine, against the floor of a plain copy.

For each model and each backend available here (``hf`` always, ``vllm`` when
importable) the script starts the backend, then times
``await backend.update_weights(named_tensors=state, version=i)`` over a fresh
set of full weights (what the trainer pushes after an optimizer step). The
floor is a plain in-memory ``copy_`` of the same tensors into preallocated
tensors of the same shapes (what any sync must at least do). Median of
``--repeats`` syncs after one warm-up.

    python benchmarks/weight_sync.py [--models tiny,smollm2] [--repeats 5] [--json out.json]
    python benchmarks/weight_sync.py --smoke      # tiny model, hf, one timed sync, no JSON; seconds

Run it in a venv with vLLM (``/work/venv-vllm``, see docs/backends.md) to get
the vllm row; without vLLM only ``hf`` and the floor are measured.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _model_dir(name: str) -> Path | None:
    from swarmkit.models import resolve_model_path
    from swarmkit.testing import build_test_model

    if name == "tiny":
        return build_test_model(Path(tempfile.gettempdir()) / "swarmkit-bench-tiny")
    try:
        return resolve_model_path(f"builtin:{name}" if ":" not in name and not os.path.isdir(name) else name)
    except Exception as exc:  # noqa: BLE001 - model not available here
        print(f"skipping model {name}: {exc}", file=sys.stderr)
        return None


def _fresh_state(model_dir: Path, seed: int) -> list[tuple[str, Any]]:
    """Full HF-named weights of the model, slightly perturbed (a new optimizer step)."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, v in state.items():
        v = v.float()
        out.append((k, v + 1e-4 * torch.randn(v.shape, generator=gen)))
    return out


def _floor(states: list[list[tuple[str, Any]]]) -> float:
    import torch

    dst = [torch.empty_like(t) for _, t in states[0]]
    times = []
    for state in states:
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, (_, t) in zip(dst, state, strict=True):
                d.copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:] or times)


def _backend(kind: str, model_dir: Path) -> Any:
    model = {"path": str(model_dir), "max_context": 1024}
    if kind == "hf":
        from swarmkit_plugins.backend_hf.engine import HFBackend

        return HFBackend(config={"name": "hf", "device": "cpu"}, model=model)
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend

    return VLLMBackend(config={"name": "vllm", "dtype": "float32", "cpu_kvcache_gib": 1,
                               "max_model_len": 1024}, model=model)


async def _time_backend(kind: str, model_dir: Path, states: list[list[tuple[str, Any]]]) -> dict[str, float]:
    from swarmkit.contract import SamplingParams

    backend = _backend(kind, model_dir)
    t0 = time.perf_counter()
    await backend.start()
    start_s = time.perf_counter() - t0
    prompt = list(backend.tokenizer("hello world", add_special_tokens=False)["input_ids"])
    times = []
    try:
        for i, state in enumerate(states):
            t0 = time.perf_counter()
            await backend.update_weights(named_tensors=state, version=i + 1)
            times.append(time.perf_counter() - t0)
            out = await backend.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0))
            assert out[0].policy_version == i + 1
    finally:
        await backend.close()
    return {"sync_s": statistics.median(times[1:] or times), "first_sync_s": times[0],
            "start_s": start_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2, or a folder")
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default="benchmarks/results/weight_sync.json")
    ap.add_argument("--smoke", action="store_true", help="tiny model, hf only, one timed sync, no JSON")
    args = ap.parse_args(argv)
    if args.smoke:
        args.models, args.backends, args.repeats, args.json = "tiny", "hf", 1, None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    kinds = [k for k in args.backends.split(",") if k == "hf" or importlib.util.find_spec(k) is not None]
    rows = []
    for name in args.models.split(","):
        model_dir = _model_dir(name)
        if model_dir is None:
            continue
        states = [_fresh_state(model_dir, s) for s in range(args.repeats + 1)]
        n_params = sum(t.numel() for _, t in states[0])
        mb = sum(t.numel() * t.element_size() for _, t in states[0]) / 2**20
        floor = _floor(states)
        rows.append({"model": name, "backend": "floor (in-memory copy)", "params": n_params, "mib": mb,
                     "sync_s": floor, "x_floor": 1.0})
        for kind in kinds:
            r = asyncio.run(_time_backend(kind, model_dir, states))
            rows.append({"model": name, "backend": kind, "params": n_params, "mib": mb, **r,
                         "x_floor": r["sync_s"] / floor if floor > 0 else float("nan")})
    print(f"{'model':10}{'backend':26}{'params':>12}{'MiB':>8}{'sync s':>10}{'x floor':>9}{'first s':>9}")
    for r in rows:
        first = f"{r['first_sync_s']:>9.4f}" if "first_sync_s" in r else f"{'':>9}"
        print(f"{r['model']:10}{r['backend']:26}{r['params']:>12,}{r['mib']:>8.1f}{r['sync_s']:>10.4f}"
              f"{r['x_floor']:>9.1f}{first}")
    result = {"rows": rows, "repeats": args.repeats, "cpu_count": os.cpu_count(),
              "torch_threads": torch.get_num_threads(), "python": sys.version.split()[0]}
    print(json.dumps(result))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
