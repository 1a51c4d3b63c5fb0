"""The ``sglang`` backend against a stand-in of SGLang's native HTTP API.

SGLang itself cannot run on these machines (no CPU build) and is NOT tested
here. The stand-in below is a test double: a Starlette app that implements the
request/response shapes of the SGLang endpoints the backend uses (``/health``,
``/generate`` with ``input_ids`` / ``sampling_params`` / ``return_logprob`` /
``top_logprobs_num`` / ``lora_path`` / ``stream``, ``/update_weights_from_disk``,
``/load_lora_adapter``, ``/unload_lora_adapter``) on top of a transformers
model, following SGLang's documentation: ``output_ids`` include the stop token,
``text`` is trimmed of the stop string, ``meta_info.output_token_logprobs`` are
``[logprob, token_id, text]`` triples of the raw distribution (as with
``SGLANG_RETURN_ORIGINAL_LOGPROB=1``), ``finish_reason`` is
``{"type": "stop", "matched": ...}`` or ``{"type": "length", "length": n}``,
and streamed events are cumulative ``data: {...}`` lines ending in
``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import socket
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")


# --------------------------------------------------------------------------- the stand-in
class StandInSGLang:
    """A transformers model behind SGLang-shaped endpoints (one request computed at a time)."""

    def __init__(self, model_path: str | Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = str(model_path)
        self.tok = AutoTokenizer.from_pretrained(self.model_path)
        self.base = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32).eval()
        self.loras: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.eos = {self.tok.eos_token_id}
        self.calls: list[str] = []

    # ---------------------------------------------------------------- model side
    def _sample(self, model: Any, prompt: list[int], sp: dict[str, Any], top_k: int):
        """Yield (token, logprob, top list, finish) one token at a time."""
        import torch

        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        max_new = int(sp.get("max_new_tokens", 128))
        stop_ids = self.eos | set(sp.get("stop_token_ids") or [])
        stops = sp.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        gen = torch.Generator()
        seed = sp.get("sampling_seed")
        gen.manual_seed(int(seed) if seed is not None else int(time.time_ns() % 2**31))
        ids = list(prompt)
        out: list[int] = []
        for _ in range(max_new):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            if temperature == 0:
                t = int(torch.argmax(logits))
            else:
                probs = torch.softmax(logits / temperature, -1)
                if top_p < 1.0:
                    sp_, si = torch.sort(probs, descending=True)
                    drop = (torch.cumsum(sp_, 0) - sp_) >= top_p
                    probs = torch.zeros_like(probs).scatter_(0, si, sp_.masked_fill(drop, 0.0))
                t = int(torch.multinomial(probs, 1, generator=gen))
            top = None
            if top_k > 0:
                v, i = torch.topk(logprobs, top_k)
                top = [[float(a), int(b), None] for a, b in zip(v.tolist(), i.tolist(), strict=True)]
            ids.append(t)
            out.append(t)
            finish = None
            if t in stop_ids:
                finish = {"type": "stop", "matched": t}
            else:
                text = self.tok.decode(out, skip_special_tokens=bool(sp.get("skip_special_tokens", True)))
                hit = next((s for s in stops if s and s in text), None)
                if hit is not None:
                    finish = {"type": "stop", "matched": hit}
                elif len(out) >= max_new:
                    finish = {"type": "length", "length": max_new}
            yield t, float(logprobs[t]), top, finish
            if finish is not None:
                return

    def _text(self, out: list[int], finish: dict[str, Any] | None) -> str:
        ids = out[:-1] if finish and isinstance(finish.get("matched"), int) else out
        text = self.tok.decode(ids, skip_special_tokens=True)
        if finish and isinstance(finish.get("matched"), str):
            text = text[: text.find(finish["matched"])]
        return text

    def _state(self, rid: str, prompt: list[int], out: list[int], lps: list, tops: list | None,
               finish: Any) -> dict[str, Any]:
        return {
            "text": self._text(out, finish),
            "output_ids": list(out),
            "meta_info": {
                "id": rid, "finish_reason": finish, "prompt_tokens": len(prompt),
                "completion_tokens": len(out),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, out, strict=True)],
                "output_top_logprobs": list(tops) if tops is not None else None,
            },
        }

    # ---------------------------------------------------------------- HTTP side
    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        async def health(request: Request) -> Any:
            return PlainTextResponse("")

        async def generate(request: Request) -> Any:
            body = await request.json()
            self.calls.append("generate")
            prompt = body.get("input_ids")
            if not isinstance(prompt, list) or not prompt or isinstance(prompt[0], list):
                return JSONResponse({"error": {"message": "stand-in takes one input_ids list"}}, 400)
            sp = body.get("sampling_params") or {}
            top_k = int(body.get("top_logprobs_num") or 0) if body.get("return_logprob") else 0
            lora = body.get("lora_path")
            if lora is not None and lora not in self.loras:
                return JSONResponse({"error": {"message": f"LoRA adapter {lora} is not loaded"}}, 400)
            model = self.loras[lora] if lora is not None else self.base
            rid = f"req-{len(self.calls)}"
            if not body.get("stream"):
                def run() -> dict[str, Any]:
                    out, lps, tops, finish = [], [], [] if top_k else None, None
                    with self.lock:
                        for t, lp, top, fin in self._sample(model, prompt, sp, top_k):
                            finish = fin
                            out.append(t)
                            lps.append(lp)
                            if tops is not None:
                                tops.append(top)
                    return self._state(rid, prompt, out, lps, tops, finish)
                return JSONResponse(await asyncio.to_thread(run))

            queue: asyncio.Queue = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def produce() -> None:
                out, lps, tops = [], [], [] if top_k else None
                with self.lock:
                    for t, lp, top, finish in self._sample(model, prompt, sp, top_k):
                        out.append(t)
                        lps.append(lp)
                        if tops is not None:
                            tops.append(top)
                        event = self._state(rid, prompt, out, lps, tops, finish)
                        loop.call_soon_threadsafe(queue.put_nowait, event)
                loop.call_soon_threadsafe(queue.put_nowait, None)

            async def events() -> Any:
                task = asyncio.ensure_future(asyncio.to_thread(produce))
                while True:
                    item = await queue.get()
                    if item is None:
                        break
                    yield f"data: {json.dumps(item)}\n\n"
                yield "data: [DONE]\n\n"
                await task

            return StreamingResponse(events(), media_type="text/event-stream")

        async def update_from_disk(request: Request) -> Any:
            body = await request.json()
            self.calls.append("update_weights_from_disk")

            def load() -> None:
                from safetensors.torch import load_file

                folder = Path(body["model_path"])
                state: dict[str, Any] = {}
                for f in sorted(folder.glob("*.safetensors")):
                    state.update(load_file(str(f)))
                if not state:
                    raise FileNotFoundError(f"no safetensors in {folder}")
                with self.lock:
                    missing, unexpected = self.base.load_state_dict(state, strict=False)
                    if unexpected:
                        raise KeyError(f"unexpected weights {unexpected[:3]}")
                    self.base.tie_weights()
            try:
                await asyncio.to_thread(load)
            except Exception as exc:  # noqa: BLE001 - reported like SGLang does
                return JSONResponse({"success": False, "message": str(exc)}, 400)
            return JSONResponse({"success": True, "message": "Succeeded to update model weights."})

        async def load_lora(request: Request) -> Any:
            body = await request.json()
            self.calls.append("load_lora_adapter")

            def load() -> None:
                from peft import PeftModel

                merged = PeftModel.from_pretrained(copy.deepcopy(self.base), body["lora_path"]).merge_and_unload()
                self.loras[body["lora_name"]] = merged.eval()
            try:
                await asyncio.to_thread(load)
            except Exception as exc:  # noqa: BLE001
                return JSONResponse({"success": False, "error_message": str(exc)}, 400)
            return JSONResponse({"success": True, "error_message": "",
                                 "loaded_adapters": {k: "" for k in self.loras}})

        async def unload_lora(request: Request) -> Any:
            body = await request.json()
            self.calls.append("unload_lora_adapter")
            if self.loras.pop(body.get("lora_name"), None) is None:
                return JSONResponse({"success": False, "error_message": "not loaded"}, 400)
            return JSONResponse({"success": True, "error_message": ""})

        return Starlette(routes=[
            Route("/health", health, methods=["GET"]),
            Route("/generate", generate, methods=["POST"]),
            Route("/update_weights_from_disk", update_from_disk, methods=["POST"]),
            Route("/load_lora_adapter", load_lora, methods=["POST"]),
            Route("/unload_lora_adapter", unload_lora, methods=["POST"]),
        ])


def serve_standin(model_path: str, host: str = "127.0.0.1", port: int = 0) -> tuple[Any, str, Any]:
    """Run the stand-in with uvicorn in a daemon thread; returns (server, url, stand-in)."""
    import uvicorn

    standin = StandInSGLang(model_path)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(standin.app(), log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://{host}:{sock.getsockname()[1]}", standin


# --------------------------------------------------------------------------- tests
from swarmkit.testing import CONFORMANCE_CHECKS, BackendConformance, build_test_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_test_model(tmp_path_factory.mktemp("sglang-standin-model"))


@pytest.fixture(scope="module")
def standin(model_dir):
    server, url, fake = serve_standin(str(model_dir))
    yield url, fake
    server.should_exit = True


@pytest.fixture(scope="module")
def conformance(standin, model_dir):
    from swarmkit_plugins.backend_sglang.engine import SGLangBackend

    url, _ = standin
    with BackendConformance.started(SGLangBackend, config={"name": "sglang", "url": url},
                                    model={"path": str(model_dir), "max_context": 1024},
                                    reference_dir=model_dir, tol=1e-3) as suite:
        yield suite


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS)
def test_sglang_backend_conformance_against_standin(conformance, check):
    conformance.run(check)


def test_sglang_uses_documented_endpoints(conformance, standin):
    """Weight sync went through /update_weights_from_disk and LoRA through /load_lora_adapter."""
    _, fake = standin
    for check in ("weight_update", "lora_adapter"):
        conformance.run(check)
    assert "update_weights_from_disk" in fake.calls
    assert "load_lora_adapter" in fake.calls and "unload_lora_adapter" in fake.calls
    assert not fake.loras, "the adapter was not unloaded after full weights were pushed"


def test_sglang_launch_command(model_dir):
    from swarmkit_plugins.backend_sglang.engine import SGLangBackend

    b = SGLangBackend(config={"port": 31234, "enable_lora": True, "max_lora_rank": 16,
                              "extra_args": ["--tp-size", "2"]},
                      model={"path": str(model_dir), "max_context": 2048})
    b.model_dir = Path(model_dir)
    cmd = b.launch_command()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    for part in (f"--model-path {model_dir}", "--port 31234", "--context-length 2048", "--enable-lora",
                 "--max-lora-rank 16", "--tp-size 2"):
        assert part in joined


def test_sglang_managed_subprocess(model_dir, tmp_path):
    """Managed mode: ``python -m sglang.launch_server`` is started, polled on /health, and stopped.

    A fake ``sglang`` package on PYTHONPATH runs the stand-in, so this checks the
    process management, not SGLang.
    """
    from swarmkit.contract import SamplingParams
    from swarmkit_plugins.backend_sglang.engine import SGLangBackend

    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(textwrap.dedent(f"""
        import argparse, importlib.util, time
        ap = argparse.ArgumentParser()
        ap.add_argument("--model-path"); ap.add_argument("--host"); ap.add_argument("--port", type=int)
        args, _ = ap.parse_known_args()
        spec = importlib.util.spec_from_file_location("standin", {str(Path(__file__).resolve())!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        server, url, _ = mod.serve_standin(args.model_path, args.host, args.port)
        while True:
            time.sleep(1)
    """))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import os

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), *([old] if old else []),
                                                str(Path(__file__).resolve().parents[1])])
    backend = SGLangBackend(config={"port": port, "startup_timeout_s": 120, "python": sys.executable,
                                    "log_path": str(tmp_path / "sglang.log")},
                            model={"path": str(model_dir)})

    async def run() -> Any:
        await backend.start()
        try:
            ids = backend.tokenizer("hello world", add_special_tokens=False)["input_ids"]
            return await backend.generate(ids, SamplingParams(max_tokens=4, temperature=0.0)), backend._proc
        finally:
            await backend.close()

    try:
        outs, proc = asyncio.run(run())
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    assert len(outs[0].token_ids) >= 1
    assert proc.poll() is not None, "close() did not stop the managed server"
    with contextlib.suppress(Exception):
        proc.kill()
