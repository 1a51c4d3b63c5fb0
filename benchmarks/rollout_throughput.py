"""Tokens/s generated through the swarm endpoint vs calling the same engine directly.

For each backend available here (``hf`` always, ``vllm`` when importable) one
engine is started inside a real swarm server (uvicorn in a thread of this
process, ``swarmkit.apps.serve.start_server_thread``). Then, for 1, 8 and 32
concurrent episodes:

- **direct**: ``C`` concurrent ``backend.generate(prompt_ids, params)`` calls on
  the engine (prompt already rendered with the chat template);
- **endpoint**: ``C`` episodes registered (``POST /api/v1/episodes``), then ``C``
  concurrent ``POST /v1/chat/completions`` with each episode's ``api_key``, each
  episode with its own HTTP client as independent agents have (so
  every call goes through auth, chat rendering, the context tracker and the
  OpenAI answer), then rewards reported; only the chat calls are timed. The
  HTTP client runs in a separate process, as swarm clients do (``--client
  thread`` runs it in this process, where it also competes for the GIL).

``--fake-forward-ms MS`` replaces the model's forward by a sleep (GIL released, as
while a GPU computes) and fixed random logits, so on a CPU the engine steps at a
GPU's pace and what the server path costs shows (the 2-core CPU's real forward
hides it).

No training step runs during the measurement: every episode has its own task
and the batch asks for far more tasks than the run makes.

tokens/s = completion tokens generated / wall time of the concurrent calls,
summed over ``--rounds`` rounds. Same messages, ``max_tokens`` and temperature
in both paths.

    python benchmarks/rollout_throughput.py [--model tiny|smollm2|FOLDER] [--max-tokens 32] [--client process|thread]
        [--device cpu|cuda] [--concurrency 1,8,32] [--fake-forward-ms 4] [--json out.json]
    python benchmarks/rollout_throughput.py --smoke      # seconds, on the CPU
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MESSAGES = [{"role": "system", "content": "You are a helpful assistant. Answer the question."},
            {"role": "user", "content": "What is 12 + 7? Think step by step."}]


def _model(name: str) -> dict[str, Any]:
    from swarmkit.testing import build_test_model

    if name == "tiny":
        path = str(build_test_model(Path(tempfile.gettempdir()) / "swarmkit-bench-tiny"))
    else:
        path = name if os.path.isdir(name) else f"builtin:{name}"
    return {"name": name, "path": path, "max_context": 1024, "lora_rank": 0}


def _backend(kind: str, model: dict[str, Any], device: str = "cpu", max_batch: int = 32) -> Any:
    if kind == "hf":
        from swarmkit_plugins.backend_hf.engine import HFBackend

        return HFBackend(config={"name": "hf", "device": device, "max_batch_size": max_batch}, model=model)
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend

    if device == "cpu":
        return VLLMBackend(config={"name": "vllm", "dtype": "float32", "cpu_kvcache_gib": 1,
                                   "max_model_len": 1024}, model=model)
    # on a GPU: bfloat16 and CUDA graphs (the backend's GPU defaults, as the hf engine's), a share of the GPU
    # that leaves room for the hf engine measured after it (SWARMKIT_BENCH_VLLM_GPU_MEM)
    return VLLMBackend(config={"name": "vllm", "max_model_len": 1024, "max_num_seqs": max(max_batch, 128),
                               "gpu_memory_utilization": float(os.environ.get("SWARMKIT_BENCH_VLLM_GPU_MEM", "0.3"))},
                       model=model)


def _fake_forward(backend: Any, ms: float) -> None:
    """Replace the engine's model forward (prefill and decode) by a sleep of ``ms`` milliseconds (the GIL is
    released, as while a GPU computes) returning fixed random logits: the engine then steps at a GPU's pace on
    a CPU, and sampling, the engine's bookkeeping and the whole server path stay real."""
    import torch

    vocab = backend.model.get_input_embeddings().num_embeddings
    table = torch.randn(backend.max_batch_size, vocab, generator=torch.Generator().manual_seed(0))

    def forward(rows: int) -> Any:
        time.sleep(ms / 1000)
        return table[:rows]

    backend._runner.decode = lambda ids, pos: forward(len(ids))
    backend._runner.prefill = lambda prompts, slots, pad_id: forward(len(prompts))


async def _direct(backend: Any, prompt: list[int], c: int, rounds: int, params: Any) -> tuple[int, float]:
    tokens, wall = 0, 0.0
    for r in range(rounds):
        ps = [type(params)(**{**params.__dict__, "seed": 1000 * r + i}) for i in range(c)]
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(backend.generate(prompt, p) for p in ps))
        wall += time.perf_counter() - t0
        tokens += sum(len(o[0].token_ids) for o in outs)
    return tokens, wall


async def _endpoint(url: str, c: int, rounds: int, max_tokens: int, temperature: float,
                    tag: str = "") -> tuple[int, float]:
    import httpx

    tokens, wall = 0, 0.0
    # one HTTP client (one keep-alive connection) per concurrent episode, as independent agents have: a
    # pool shared by C requests rescans its C connections at every request and response (httpcore), which
    # made this client process, not the server, the cap at C = 128 (docs/benchmarks.md); plain HTTP, so no
    # CA bundle is loaded (60 ms a client)
    https = [httpx.AsyncClient(base_url=url, timeout=600, verify=False) for _ in range(c)]
    try:
        for r in range(rounds):
            eps = await asyncio.gather(*(h.post("/api/v1/episodes", json={"task_id": f"bench{tag}-{c}-{r}-{i}"})
                                         for i, h in enumerate(https)))
            eps = [e.json() for e in eps]

            async def chat(ep: dict[str, Any], i: int, r: int = r) -> int:
                resp = await https[i].post(
                    ep["base_url"].rstrip("/") + "/chat/completions",
                    headers={"Authorization": f"Bearer {ep['api_key']}"},
                    json={"model": "m", "messages": MESSAGES, "max_tokens": max_tokens,
                          "temperature": temperature, "seed": 1000 * r + i})
                resp.raise_for_status()
                return int(resp.json()["usage"]["completion_tokens"])

            t0 = time.perf_counter()
            counts = await asyncio.gather(*(chat(ep, i) for i, ep in enumerate(eps)))
            wall += time.perf_counter() - t0
            tokens += sum(counts)
            await asyncio.gather(*(https[i].post(f"/api/v1/episodes/{ep['episode_id']}/report",
                                                 headers={"Authorization": f"Bearer {ep['api_key']}"},
                                                 json={"reward": 0.0}) for i, ep in enumerate(eps)))
    finally:
        await asyncio.gather(*(h.aclose() for h in https))
    return tokens, wall


def _endpoint_blocking(url: str, c: int, rounds: int, max_tokens: int, temperature: float,
                       tag: str = "") -> tuple[int, float]:
    """``_endpoint`` run to completion (the entry point of the client process)."""
    return asyncio.run(_endpoint(url, c, rounds, max_tokens, temperature, tag))


def _run_backend(kind: str, model: dict[str, Any], concurrency: list[int], rounds: int,
                 max_tokens: int, temperature: float, client: str = "process",
                 device: str = "cpu", fake_forward_ms: float = 0.0) -> list[dict[str, Any]]:
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.contract import SamplingParams
    from swarmkit.plugins import get_registry

    backend = _backend(kind, model, device, max(32, *concurrency))
    # every episode has its own task and the batch needs far more tasks than the run makes, so no
    # training step (which would run in this process) disturbs the measurement
    cfg = validate_config(compose([f"model={'tiny' if model['name'] == 'tiny' else 'smollm2'}",
                                   f"model.path={model['path']}", "batching.batch_size=1000000"]), get_registry())
    run_dir = tempfile.mkdtemp(prefix=f"swarmkit-bench-rollout-{kind}-")
    handle = start_server_thread({"server": {"port": 0, "admin_token": "bench-admin-token", "run_dir": run_dir,
                                             "episode_timeout_s": 3600}},
                                 config=cfg, backend_factory=lambda c: backend)
    rows = []
    # like a real swarm client, the HTTP client runs in its own process (it only imports httpx),
    # so it shares the CPUs with the server but not the server's GIL; --client thread keeps it here
    pool = None
    if client == "process":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))

    def endpoint(c: int, r: int, tag: str = "") -> tuple[int, float]:
        args = (handle.url, c, r, max_tokens, temperature, tag)
        return pool.submit(_endpoint_blocking, *args).result() if pool else _endpoint_blocking(*args)

    try:
        import httpx

        httpx.post(handle.url + "/api/v1/admin/start", headers={"Authorization": "Bearer bench-admin-token"}, json={})
        end = time.monotonic() + 300
        while handle.swarm.state.state != "ROLLING":
            if handle.swarm.state.last_error:
                raise RuntimeError(f"server boot failed: {handle.swarm.state.last_error}")
            if time.monotonic() > end:
                raise TimeoutError("server did not reach ROLLING")
            time.sleep(0.05)
        if fake_forward_ms > 0:
            _fake_forward(backend, fake_forward_ms)
        prompt = list(backend.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        # warm-up both paths
        asyncio.run(_direct(backend, prompt, 2, 1, params))
        endpoint(2, 1, tag="-warmup")
        for c in concurrency:
            # an untimed round first: it captures the engine's CUDA graphs of this batch size (new shapes), which
            # the timed direct round would otherwise pay and the endpoint round after it would not
            asyncio.run(_direct(backend, prompt, c, 1, params))
            dt, dw = asyncio.run(_direct(backend, prompt, c, rounds, params))
            et, ew = endpoint(c, rounds)
            if handle.swarm.state.state != "ROLLING":
                raise RuntimeError(f"server left ROLLING ({handle.swarm.state.state}): the measurement is void")
            rows.append({"backend": kind, "concurrency": c, "direct_tok_s": dt / dw, "endpoint_tok_s": et / ew,
                         "direct_tokens": dt, "endpoint_tokens": et, "endpoint_vs_direct": (et / ew) / (dt / dw)})
            print(f"  {kind} C={c}: direct {dt / dw:.1f} tok/s, endpoint {et / ew:.1f} tok/s", file=sys.stderr)
    finally:
        if pool is not None:
            pool.shutdown()
        handle.stop()
        with contextlib.suppress(Exception):
            asyncio.run(backend.close())
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", help="tiny, smollm2 or a local HF folder")
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--client", choices=["process", "thread"], default="process",
                    help="run the HTTP client in its own process (like a swarm client) or in a thread here")
    ap.add_argument("--device", default="cpu", help="the engines' device (cpu, cuda; vLLM takes its platform's)")
    ap.add_argument("--fake-forward-ms", type=float, default=0.0,
                    help="replace the model's forward by a sleep of this many ms and fixed random logits (hf only): "
                         "the engine steps at a GPU's pace on a CPU, so the server path can be measured here")
    ap.add_argument("--smoke", action="store_true", help="tiny model, C=1,2, 4 tokens, one round, no JSON")
    ap.add_argument("--json", default="benchmarks/results/rollout_throughput.json")
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.backends, args.concurrency, args.rounds, args.max_tokens, args.json = (
            "tiny", "hf", "1,2", 1, 4, None)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("swarmkit").setLevel(logging.WARNING)
    kinds = [k for k in args.backends.split(",") if k == "hf" or importlib.util.find_spec(k) is not None]
    model = _model(args.model)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict[str, Any]] = []
    for kind in kinds:
        rows += _run_backend(kind, model, concurrency, args.rounds, args.max_tokens, args.temperature, args.client,
                             args.device, args.fake_forward_ms if kind == "hf" else 0.0)
    fake = f", forward faked as a {args.fake_forward_ms:g} ms sleep" if args.fake_forward_ms else ""
    print(f"model {args.model}{fake}, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"{args.rounds} rounds, client in a {args.client}, {os.cpu_count()} CPUs")
    print(f"{'backend':10}{'episodes':>10}{'direct tok/s':>14}{'endpoint tok/s':>16}{'endpoint/direct':>17}")
    for r in rows:
        print(f"{r['backend']:10}{r['concurrency']:>10}{r['direct_tok_s']:>14.1f}{r['endpoint_tok_s']:>16.1f}"
              f"{r['endpoint_vs_direct']:>17.2f}")
    result = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "rounds": args.rounds, "client": args.client, "fake_forward_ms": args.fake_forward_ms, "rows": rows, "cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    print(json.dumps(result))
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
