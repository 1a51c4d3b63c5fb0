"""The ``sglang`` inference backend: an SGLang server driven over its native HTTP API.

**Status: untested against a real SGLang.** SGLang has no CPU build on the
machines this project is developed on (see ``docs/backends.md``). This module is
written against SGLang's documented native API and is tested only against a
stand-in server (``tests/test_backend_sglang_standin.py``) that implements the
request/response shapes below on top of a transformers model.

Process model
-------------
``start()`` either attaches to ``config["url"]`` or launches
``python -m sglang.launch_server`` as a managed subprocess (own process group,
log in ``config["log_path"]`` or a temp file) and polls ``GET /health`` until it
answers 200 or ``startup_timeout_s`` passes. ``close()`` terminates a process it
started (SIGTERM to its group, then SIGKILL) and never touches an attached one.
The managed server gets ``SGLANG_RETURN_ORIGINAL_LOGPROB=1`` so that returned
logprobs are those of the raw (pre-temperature) distribution.

Endpoints used
--------------
- ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``,
  ``temperature``, ``top_p``, ``stop``, ``stop_token_ids``, ``sampling_seed``,
  ``skip_special_tokens``, ``spaces_between_special_tokens``), ``return_logprob``,
  ``top_logprobs_num``, ``lora_path`` and ``stream``. The answer carries ``output_ids``, ``text`` and
  ``meta_info`` with ``output_token_logprobs`` (``[logprob, token_id, text]``
  triples), ``output_top_logprobs`` and ``finish_reason``
  (``{"type": "stop" | "length", ...}``). With ``stream`` the answer is
  server-sent events ``data: {...}`` (cumulative by default; incremental when the
  server runs with ``--incremental-streaming-output``: both are handled),
  ending with ``data: [DONE]``.
- ``POST /update_weights_from_disk`` with ``model_path`` (``{"success", "message"}``).
  Named tensors are written as safetensors (plus the model's config) to a
  temporary folder on the same host and loaded from there.
- ``POST /load_lora_adapter`` / ``/unload_lora_adapter`` with ``lora_name`` and
  ``lora_path`` (server started with ``--enable-lora``).
- ``GET /health``.

Semantics (same as the ``hf`` backend)
--------------------------------------
``n > 1`` is sent as ``n`` concurrent requests (SGLang batches them), request
``i`` seeded with ``seed + i``. ``token_ids`` include a stop token;
``text`` is decoded here from the returned ids with the served tokenizer
(stop token excluded, cut before the earliest stop string), so text handling
does not depend on server-side trimming options.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from swarmkit.config.schema import ModelConfig
from swarmkit.contract import (
    GenerationOutput,
    InferenceBackend,
    SamplingParams,
    StreamChunk,
    decode_generated,
)
from swarmkit.contract.streaming import StreamTextBuffer, cut_at_stop, find_stop
from swarmkit.models import resolve_model_path
from swarmkit_plugins.backend_sglang.schema import SGLangBackendConfig

log = logging.getLogger(__name__)


class SGLangError(RuntimeError):
    """An SGLang endpoint answered with an error."""


class SGLangBackend(InferenceBackend):
    """Talks to one SGLang server (managed subprocess or ``url``) over HTTP.

    Config keys (``backend`` group): ``url`` (attach instead of launching),
    ``host`` / ``port``, ``dtype``, ``mem_fraction_static``, ``startup_timeout_s``,
    ``request_timeout_s``, ``enable_lora``, ``max_lora_rank``,
    ``lora_target_modules``, ``incremental_streaming_output``, ``extra_args``
    (list of extra CLI arguments),
    ``python`` (interpreter that has sglang), ``log_path``.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, model: Mapping[str, Any] | None = None):
        if not model or "path" not in model:
            raise ValueError("sglang backend: the model config needs a 'path'")
        self.cfg = SGLangBackendConfig(**dict(config or {}))
        self.model_cfg = ModelConfig.of(model)
        self.max_context: int | None = self.model_cfg.max_context
        self.policy_version = 0
        self.model_dir: Path | None = None
        self.url: str | None = self.cfg.url
        self.request_timeout_s = float(self.cfg.request_timeout_s)
        self._proc: subprocess.Popen | None = None
        self._log_file: Any = None
        self._client: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._lora_name: str | None = None
        self._lora_count = 0
        self._weights_dir: Path | None = None
        self._lock = asyncio.Lock()
        #: events of ``/generate`` streams carry only new tokens (``--incremental-streaming-output``)
        self.incremental_streaming = bool(self.cfg.incremental_streaming_output)

    # ------------------------------------------------------------------ life cycle
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("sglang backend not started: await backend.start() first")
        return self._tokenizer

    async def start(self) -> None:
        if self._client is not None:
            return
        import httpx

        self.model_dir = resolve_model_path(self.model_cfg.path)
        self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
        if not self.url:
            self.url = self._launch()
        self.url = self.url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self.url, timeout=self.request_timeout_s)
        try:
            await self._wait_healthy(float(self.cfg.startup_timeout_s))
        except BaseException:
            await self.close()
            raise

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer, GenerationConfig

        tok = AutoTokenizer.from_pretrained(str(self.cfg.tokenizer_path or self.model_dir))
        eos: set[int] = set()
        if tok.eos_token_id is not None:
            eos.add(int(tok.eos_token_id))
        with contextlib.suppress(Exception):
            gen_eos = GenerationConfig.from_pretrained(str(self.model_dir)).eos_token_id
            eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self._eos_ids = frozenset(eos)
        return tok

    def launch_command(self) -> list[str]:
        """The ``sglang.launch_server`` command line this backend runs."""
        c = self.cfg
        cmd = [
            str(c.python or sys.executable), "-m", "sglang.launch_server",
            "--model-path", str(self.model_dir),
            "--host", str(c.host),
            "--port", str(c.port),
            "--dtype", str(c.dtype),
            "--mem-fraction-static", str(c.mem_fraction_static),
        ]
        if self.max_context:
            cmd += ["--context-length", str(self.max_context)]
        if c.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(c.max_lora_rank)]
            targets = c.lora_target_modules or ["all"]
            cmd += ["--lora-target-modules", *[str(t) for t in targets]]
        if self.incremental_streaming:
            cmd.append("--incremental-streaming-output")
        cmd += [str(a) for a in c.extra_args or []]
        return cmd

    def _launch(self) -> str:
        cmd = self.launch_command()
        env = dict(os.environ)
        env.setdefault("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
        log_path = self.cfg.log_path or tempfile.mktemp(prefix="sglang-", suffix=".log")
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - lives as long as the process
        log.info("sglang backend: launching %s (log %s)", " ".join(cmd), log_path)
        self._proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        return f"http://{self.cfg.host}:{self.cfg.port}"

    async def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: str = ""
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise SGLangError(f"sglang server exited with status {self._proc.returncode} "
                                  f"during start-up (log: {getattr(self._log_file, 'name', '?')})")
            try:
                r = await self._client.get("/health", timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except Exception as exc:  # noqa: BLE001 - not up yet
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)
        raise TimeoutError(f"sglang server at {self.url} not healthy after {timeout:.0f}s ({last})")

    async def close(self) -> None:
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None
        if self._proc is not None:
            await asyncio.to_thread(_stop_process, self._proc)
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = None

    # ------------------------------------------------------------------ requests
    def _payload(self, prompt_ids: Sequence[int], params: SamplingParams, seed: int | None,
                 stream: bool) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": int(params.max_tokens),
            "temperature": 0.0 if params.greedy() else float(params.temperature),  # the contract's threshold
            "top_p": float(params.top_p),
            "skip_special_tokens": bool(params.skip_special_tokens),
            "spaces_between_special_tokens": False,
        }
        if params.stop:
            sp["stop"] = list(params.stop)
        if params.stop_token_ids:
            sp["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        if seed is not None:
            sp["sampling_seed"] = int(seed)
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in prompt_ids],
            "sampling_params": sp,
            "return_logprob": True,
            "stream": stream,
        }
        if params.top_logprobs > 0:
            body["top_logprobs_num"] = int(params.top_logprobs)
        if self._lora_name is not None:
            body["lora_path"] = self._lora_name
        return body

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        self._check_started()
        params.check()
        version = self.policy_version
        seeds = [None if params.seed is None else params.seed + i for i in range(max(1, params.n))]
        results = await asyncio.gather(*(self._generate_one(prompt_ids, params, s) for s in seeds))
        for r in results:
            r.policy_version = version
        return list(results)

    async def _generate_one(self, prompt_ids: Sequence[int], params: SamplingParams,
                            seed: int | None) -> GenerationOutput:
        r = await self._client.post("/generate", json=self._payload(prompt_ids, params, seed, False))
        data = _json_or_raise(r, "/generate")
        if isinstance(data, list):  # a batch answer of one item
            data = data[0]
        ids = [int(t) for t in data.get("output_ids") or []]
        meta = data.get("meta_info") or {}
        lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
        if len(lps) != len(ids):
            raise SGLangError(f"/generate returned {len(ids)} ids but {len(lps)} logprobs")
        tops = _tops(meta.get("output_top_logprobs"), params.top_logprobs)
        ids, lps, tops, text, finish = self._finalize(ids, lps, tops, params, meta.get("finish_reason"))
        return GenerationOutput(token_ids=ids, logprobs=lps, text=text, finish_reason=finish,
                                top_logprobs=tops)

    def _finalize(self, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None,
                  params: SamplingParams, finish: Any) -> tuple[list[int], list[float], Any, str, str]:
        """Apply the backend contract to a finished sequence: text, stop cut, finish reason."""
        kind = (finish or {}).get("type") if isinstance(finish, dict) else finish
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        hide_last = bool(ids) and ids[-1] in stop_ids
        text = decode_generated(self._tokenizer, ids[:-1] if hide_last else ids, params)
        text, hit = cut_at_stop(text, params.stop)
        if hit:
            kind = "stop"
        elif hide_last:
            kind = "stop"
        reason = {"stop": "stop", "abort": "abort"}.get(str(kind), "length")
        return ids, lps, tops, text, reason

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StreamChunk]:
        self._check_started()
        params.check()
        if params.n != 1:
            raise ValueError("stream() samples one continuation (n == 1)")
        body = self._payload(prompt_ids, params, params.seed, True)
        ids: list[int] = []
        lps: list[float] = []
        tops: list[dict[int, float]] | None = [] if params.top_logprobs > 0 else None
        sent_tokens = 0
        out = StreamTextBuffer(params.stop)
        async with self._client.stream("POST", "/generate", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                _json_or_raise(r, "/generate")
            finish: Any = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                data = json.loads(payload)
                if "error" in data:
                    raise SGLangError(f"/generate stream: {data['error']}")
                meta = data.get("meta_info") or {}
                _merge_stream(ids, lps, tops, data.get("output_ids") or [],
                              meta.get("output_token_logprobs") or [],
                              meta.get("output_top_logprobs"), params.top_logprobs,
                              incremental=self.incremental_streaming)
                finish = meta.get("finish_reason") or finish
                if finish is not None:
                    break
                text = self._visible_text(ids, params)
                if text is None:  # a stop was produced: the final event follows
                    continue
                if len(ids) > sent_tokens:
                    yield StreamChunk(token_ids=ids[sent_tokens:], logprobs=lps[sent_tokens:],
                                      text=out.push(text), finish_reason=None,
                                      top_logprobs=tops[sent_tokens:] if tops is not None else None)
                    sent_tokens = len(ids)
        _, _, _, text, reason = self._finalize(ids, lps, tops, params, finish)
        yield StreamChunk(token_ids=ids[sent_tokens:], logprobs=lps[sent_tokens:],
                          text=out.finish(text), finish_reason=reason,
                          top_logprobs=tops[sent_tokens:] if tops is not None else None)

    def _visible_text(self, ids: list[int], params: SamplingParams) -> str | None:
        """Decoded text so far, or None once a stop id or stop string has been produced."""
        if ids and ids[-1] in (self._eos_ids | set(params.stop_token_ids)):
            return None
        text = decode_generated(self._tokenizer, ids, params)
        if find_stop(text, params.stop) is not None:
            return None
        return text

    def _check_started(self) -> None:
        if self._client is None:
            raise RuntimeError("sglang backend not started: await backend.start() first")

    # ------------------------------------------------------------------ weights
    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | None = None, *,
                             path: str | None = None, version: int) -> None:
        self._check_started()
        async with self._lock:
            if path is not None and (Path(path) / "adapter_config.json").exists():
                await self._load_lora(str(Path(path).resolve()))
            else:
                folder = path if path is not None else await asyncio.to_thread(
                    self._write_weights, named_tensors or ())
                await self._unload_lora()
                r = await self._client.post("/update_weights_from_disk",
                                            json={"model_path": str(Path(folder).resolve())})
                data = _json_or_raise(r, "/update_weights_from_disk")
                if isinstance(data, dict) and data.get("success") is False:
                    raise SGLangError(f"/update_weights_from_disk failed: {data.get('message')}")
            self.policy_version = int(version)

    def _write_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> str:
        """Save tensors + the model's config files to a reusable temp folder SGLang can load."""
        import torch
        from safetensors.torch import save_file

        if self._weights_dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._weights_dir = Path(tempfile.mkdtemp(prefix="swarmkit-sglang-weights-", dir=base))
            for f in self.model_dir.iterdir():  # type: ignore[union-attr]
                if f.is_file() and f.suffix in (".json", ".txt", ".model", ".jinja") \
                        and not f.name.endswith(".index.json"):
                    shutil.copy2(f, self._weights_dir / f.name)
        tensors = {}
        for name, t in named_tensors:
            for pre in ("module.", "_orig_mod.", "base_model.model."):
                if name.startswith(pre):
                    name = name[len(pre):]
            tensors[name] = torch.as_tensor(t).detach().to("cpu").contiguous()
        if not tensors:
            raise ValueError("update_weights: no tensors given")
        save_file(tensors, str(self._weights_dir / "model.safetensors"))
        return str(self._weights_dir)

    async def _load_lora(self, adapter_dir: str) -> None:
        self._lora_count += 1
        name = f"swarmkit-{self._lora_count}"
        r = await self._client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": adapter_dir})
        data = _json_or_raise(r, "/load_lora_adapter")
        if isinstance(data, dict) and data.get("success") is False:
            raise SGLangError(f"/load_lora_adapter failed: {data.get('error_message') or data}")
        old, self._lora_name = self._lora_name, name
        if old is not None:
            await self._unload(old)

    async def _unload_lora(self) -> None:
        old, self._lora_name = self._lora_name, None
        if old is not None:
            await self._unload(old)

    async def _unload(self, name: str) -> None:
        try:
            r = await self._client.post("/unload_lora_adapter", json={"lora_name": name})
            _json_or_raise(r, "/unload_lora_adapter")
        except Exception:  # noqa: BLE001 - a stale adapter only costs memory
            log.warning("sglang backend: unloading LoRA adapter %s failed", name, exc_info=True)


# --------------------------------------------------------------------------- helpers
def _json_or_raise(r: Any, what: str) -> Any:
    if r.status_code != 200:
        raise SGLangError(f"{what}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def _tops(rows: Any, k: int) -> list[dict[int, float]] | None:
    if k <= 0:
        return None
    return [{int(e[1]): float(e[0]) for e in (row or [])[:k]} for row in rows or []]


def _merge_stream(ids: list[int], lps: list[float], tops: list[dict[int, float]] | None,
                  new_ids: list[int], new_lps: list[Any], new_tops: Any, k: int, *,
                  incremental: bool) -> None:
    """Fold one streamed event into the running lists.

    SGLang's events are cumulative (all ids / logprobs so far) unless the server
    runs with ``--incremental-streaming-output``. Logprob lists are sliced by
    their own length, so a server that streams cumulative ids but incremental
    logprobs is handled too.
    """
    start = 0 if incremental else len(ids)
    ids.extend(int(t) for t in new_ids[start:])
    lp_start = len(lps) if len(new_lps) >= len(ids) and not incremental else 0
    lps.extend(float(x[0]) for x in new_lps[lp_start:])
    if tops is not None:
        rows = list(new_tops or [])
        t_start = len(tops) if len(rows) >= len(ids) and not incremental else 0
        tops.extend(_tops(rows[t_start:], k) or [])


def _stop_process(proc: subprocess.Popen, grace: float = 15.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
