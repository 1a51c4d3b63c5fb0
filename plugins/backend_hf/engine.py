"""The ``hf`` inference backend: a transformers model behind a continuous-batching decode loop.

How it works
------------
One background worker thread owns the model. Requests (from any number of
asyncio callers) are queued; at every step boundary the worker admits waiting
requests (up to ``max_batch_size`` sequences in flight, one request at most half
of them while others wait), gives each the lowest free slot of a preallocated KV
cache (:mod:`.slots`) and prefills them together as one left-padded batch into
their slots (continuous batching: a new request never waits for the current batch
to finish). Each decode step feeds the last sampled token of every active
sequence in one forward pass (a replayed CUDA graph on CUDA, :mod:`.runner`) and
samples all rows on the device (:mod:`.sampler`). A finished sequence frees its
slot at once; nothing is copied. With ``backend.pipeline`` on (by default where
CUDA graphs run) a step whose rows all sample plainly (temperature or greedy, no
filter, shaping or top logprobs) is one *fused* graph (forward and sampling), and
the worker launches step ``t + 1`` before it processes step ``t``: the rows
continue from the tokens the device fed back, the host uploads only each row's
temperature and uniform draw, and the GPU computes while the host does the
bookkeeping of the previous step (:meth:`HFBackend._pipelined_step`). When the
worker
was idle, the first request waits for others to batch with: the window stays open
while requests keep arriving less than ``batch_wait_s`` apart, for at most
``batch_wait_max_s``.

Results go back to the caller's event loop with ``loop.call_soon_threadsafe``;
``stream()`` receives a chunk after every decode step (real streaming).

Semantics
---------
- ``logprobs[i]`` is the log-softmax of the *raw* logits (no temperature, no
  top-p) at the sampled token; ``top_logprobs`` come from the same distribution.
- ``top_k``, ``min_p``, ``frequency_penalty`` / ``presence_penalty`` (over the generated
  tokens), ``repetition_penalty`` (over prompt and generation) and ``logit_bias`` shape
  the distribution sampled from (and the argmax of greedy decoding); the logprobs stay
  the raw ones, as with temperature and top-p.
- ``temperature`` below ``GREEDY_TEMPERATURE`` (1e-5) is greedy (argmax). ``seed`` makes sampling reproducible
  and independent of what else is in the batch (each sequence draws its uniforms from its own
  ``random.Random``; continuation ``i`` of ``n`` uses ``seed + i``).
- Stop token ids (``stop_token_ids`` plus the tokenizer's / generation config's
  EOS ids): the stop token *is* in ``token_ids`` / ``logprobs`` (the model
  generated it and training needs it) but not in ``text``.
- Stop strings: ``text`` is cut before the first occurrence of the earliest
  stop string; ``token_ids`` run up to and including the token that completed
  the stop string (so the ids may decode to a little more than ``text``).
- ``finish_reason`` is ``"stop"`` (stop id or string) or ``"length"``
  (``max_tokens`` or the model's ``max_context``).
- Streaming: every chunk carries the new token ids and logprobs; text is held
  back while it could still be the start of a stop string or ends in an
  incomplete UTF-8 character, so the chunks' texts concatenate exactly to the
  final text and their token ids to the final ids.

Weights
-------
``update_weights`` runs between two decode steps (a lock), copies tensors into
the live parameters (no reload) and sets ``policy_version``. Sequences in flight
keep their KV cache (computed by the old weights) and go on with the new ones: an
output's ``policy_version`` is the version it started with, ``token_versions``
the version that sampled each token.
``path`` may be a folder of ``*.safetensors`` (full or partial weights) or a peft
LoRA adapter folder (``adapter_config.json``): the adapter is merged into the
weights (``W = W_base + scale * B @ A``); the base values of the touched
weights are kept, so loading the next adapter replaces the previous one instead
of stacking on it. ``unload_lora()`` restores the base.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
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
from swarmkit.contract.streaming import StreamTextBuffer, cut_at_stop
from swarmkit.errors import EngineError
from swarmkit.models import resolve_model_path
from swarmkit.training.lora import adapter_deltas
from swarmkit_plugins.backend_hf import grammar
from swarmkit_plugins.backend_hf.budget import (
    MIN_CAPACITY,
    available_ram,
    budget_bytes,
    cache_shape,
    human_bytes,
    kv_bytes_per_token,
    longest_sequence,
    parse_memory,
)
from swarmkit_plugins.backend_hf.fused import fuse_projections
from swarmkit_plugins.backend_hf.multi_lora import MultiLora
from swarmkit_plugins.backend_hf.runner import MIN_WINDOW, SlotRunner
from swarmkit_plugins.backend_hf.sampler import RowSampling, sample, to_host
from swarmkit_plugins.backend_hf.schema import PIPELINE_CHOICES, HFBackendConfig
from swarmkit_plugins.backend_hf.slots import SlotCache, register_attention

log = logging.getLogger(__name__)

#: a generation step that raises fails the requests in it, then a check step (a short prefill and one decode
#: step) decides whether the engine goes on; after this many failed steps in a row it is given up anyway
MAX_FAILED_STEPS = 3

_STRIP_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")


class SequenceError(ValueError):
    """One request's sequence could not be sampled; the batch and the engine go on."""


def torch_tensor(values: list[int], device: Any) -> Any:
    import torch

    return torch.tensor(values, dtype=torch.long, device=device)


# --------------------------------------------------------------------------- request state
@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    params: SamplingParams
    seqs: list[_Seq] = field(default_factory=list)
    future: asyncio.Future | None = None
    queue: asyncio.Queue | None = None
    cancelled: bool = False
    done_count: int = 0
    delivered: bool = False


@dataclass
class _Job:
    """Work the decode loop runs between two steps under the weights lock (prompt scoring)."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    run: Any  # () -> result, on the worker thread

    def settle(self, result: Any = None, error: BaseException | None = None) -> None:
        def done(fut: asyncio.Future = self.future) -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)
        with contextlib.suppress(RuntimeError):  # the caller's loop is gone
            self.loop.call_soon_threadsafe(done)


#: logits one scoring chunk may hold (positions x vocabulary), so a long prompt never holds them all
SCORE_CHUNK_ELEMENTS = 32 * 1024 * 1024


@dataclass
class _Seq:
    req: _Request
    index: int
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int]
    rng: random.Random | None  # a seeded request's own uniforms, else None (the engine's)
    version: int
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    out_ver: list[int] = field(default_factory=list)  # the policy version that sampled each token
    out_top: list[dict[int, float]] | None = None
    shaped: bool = False  # the request sets a distribution-shaping field (known once, at submit)
    text: str = ""
    text_len_checked: int = 0
    finish: str | None = None
    hide_last: bool = False
    sent_tokens: int = 0
    text_out: StreamTextBuffer = field(init=False)
    slot: int = -1  # the KV-cache slot the sequence owns while it runs
    adapter: str | None = None  # the LoRA adapter it is sampled with (model.adapters); None: the base
    adapter_index: int = 0  # its row index in the stacked adapters (0: none)
    matcher: Any = None  # its grammar matcher under SamplingParams.structural_tag (grammar.py)

    def __post_init__(self) -> None:
        self.text_out = StreamTextBuffer(self.req.params.stop)

    @property
    def need(self) -> int:
        """Cache positions the sequence holds at most (its prompt and ``max_tokens``): reserved at admission."""
        return len(self.prompt) + self.max_tokens


@dataclass
class _Flight:
    """A fused decode step launched and not processed yet (``backend.pipeline``)."""

    seqs: list[_Seq]
    rows: list[int]  # each sequence's row (slot) in the step
    versions: list[int]  # each sequence's policy version at launch: the weights that compute its token
    out: Any  # [rows, 3] float64 host tensor: token, logprob, bad; complete once `event` has completed
    event: Any  # a CUDA event, or None (the CPU computed the step at launch)


# --------------------------------------------------------------------------- backend
class HFBackend(InferenceBackend):
    """transformers inference with continuous batching on a worker thread (CPU or GPU).

    Built as ``HFBackend(config=backend_cfg, model=model_cfg)``; ``model["path"]``
    goes through :func:`swarmkit.models.resolve_model_path`. Call ``await start()``
    before generating and ``await close()`` at the end.
    """

    reports_token_versions = True
    scores_prompts = True
    sampling_fields = frozenset({"top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                                 "logit_bias"})

    def __init__(self, config: Mapping[str, Any] | None = None, model: Mapping[str, Any] | None = None):
        if not model or "path" not in model:
            raise ValueError("hf backend: the model config needs a 'path'")
        self.cfg = HFBackendConfig(**dict(config or {}))
        self.model_cfg = ModelConfig.of(model)
        self.model_name: str = self.model_cfg.name or self.model_cfg.path
        self.max_context: int | None = self.model_cfg.max_context
        self.max_batch_size = int(self.cfg.max_batch_size)
        self.batch_wait_s = float(self.cfg.batch_wait_s)
        self.batch_wait_max_s = max(self.batch_wait_s, float(self.cfg.batch_wait_max_s))
        self.max_prefill_tokens = int(self.cfg.max_prefill_tokens)
        self.kv_memory = parse_memory(self.cfg.kv_cache_memory)  # ValueError now, before any model is loaded
        #: the KV cache's budget: bytes, cached positions (a slot takes capacity + 1), the longest sequence
        self.kv_budget_bytes = 0
        self._kv_positions = 0
        self._kv_longest: int | None = None
        if self.cfg.pipeline not in PIPELINE_CHOICES:
            raise ValueError(f"hf backend: pipeline must be one of {PIPELINE_CHOICES}, not {self.cfg.pipeline!r}")
        #: one fused step in flight while the host processes the previous one (set once the runner exists)
        self.pipelined = False
        self.fused_groups = 0  # projection groups fused at load (fuse_projections)
        self._flight: _Flight | None = None
        self.policy_version = 0
        #: several LoRA adapters served per row over the one base (model.adapters; :mod:`.multi_lora`)
        self.adapter_specs = self.model_cfg.adapter_specs()
        self.serves_adapters = bool(self.adapter_specs)
        #: each adapter's policy version (its trainer's optimizer steps); tokens are labelled with it
        self.adapter_versions: dict[str, int] = {s.name: 0 for s in self.adapter_specs}
        self._lora: MultiLora | None = None
        self.model_dir: Path | None = None
        self.device: Any = None
        self.dtype: Any = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._worker_tok: Any = None
        self._eos_ids: frozenset[int] = frozenset()
        self._pad_id = 0
        self._logits_to_keep = False
        self._cv = threading.Condition()
        self._weights_lock = threading.Lock()
        #: a weight swap waits for the lock: the decode loop lets it in before its next step
        #: (a plain Lock is not fair, and a busy loop would re-take it at once, step after step)
        self._swap_waiting = threading.Event()
        self._pending: deque[_Seq] = deque()
        self._jobs: deque[_Job] = deque()
        self._active: list[_Seq] = []
        self._cache: Any = None
        self._runner: Any = None
        self._free: list[int] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        #: why the engine died (its worker: see _die), and the error each later call raises
        self._dead = EngineFailure("hf")
        self._lora_base: dict[str, Any] = {}
        self._rng: random.Random | None = None
        self.stats: dict[str, float] = {}
        self.reset_stats()
        # calls of strict tools are constrained with xgrammar when installed (the grammar extra; grammar.py)
        self._grammars: grammar.Grammars | None = None
        if grammar.available():
            self.sampling_fields = self.sampling_fields | {"structural_tag"}
        else:
            self.structural_tag_hint = grammar.HINT

    # ------------------------------------------------------------------ public
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            raise RuntimeError("hf backend not started: await backend.start() first")
        return self._tokenizer

    @property
    def model(self) -> Any:
        """The live ``transformers`` model (read it under :meth:`weights_lock` if in use)."""
        return self._model

    def reset_stats(self) -> None:
        """Zero the counters in ``stats``."""
        self.stats = {
            "forward_passes": 0, "prefill_passes": 0, "decode_steps": 0,
            "sequences": 0, "tokens_generated": 0, "max_batch_seen": 0,
            "decode_rows": 0, "prefill_tokens": 0, "weight_updates": 0, "busy_s": 0.0,
            "fused_steps": 0,  # decode steps launched as one fused graph, one step in flight (backend.pipeline)
        }

    def engine_stats(self) -> dict[str, float]:
        cache = self._cache
        out = {"busy_s": float(self.stats["busy_s"]), "tokens_generated": float(self.stats["tokens_generated"]),
               "kv_cache_bytes": float(cache.nbytes() if cache is not None else 0),
               "kv_budget_bytes": float(self.kv_budget_bytes),
               "waiting_sequences": float(len(self._pending))}
        if self.device is not None and self.device.type == "cuda":  # the process's peak (engine and trainer)
            import torch

            out["cuda_max_allocated_bytes"] = float(torch.cuda.max_memory_allocated(self.device))
        return out

    async def start(self) -> None:
        if self._model is not None:
            return
        await asyncio.to_thread(self._load)
        self._closed = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._thread = threading.Thread(target=self._worker, name="hf-backend-decode", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._ready.wait)
        if self._start_error is not None:
            self._thread = None
            raise self._start_error

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        loop = asyncio.get_running_loop()
        req = _Request(loop=loop, params=params, future=loop.create_future())
        self._submit(req, prompt_ids)
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True
            raise

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StreamChunk]:
        if params.n != 1:
            raise ValueError("stream() samples one continuation: n must be 1")
        loop = asyncio.get_running_loop()
        req = _Request(loop=loop, params=params, queue=asyncio.Queue())
        self._submit(req, prompt_ids)
        try:
            while True:
                item = await req.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            req.cancelled = True  # no-op when finished; frees the slot when the consumer left early

    async def score_prompt(self, prompt_ids: Sequence[int], top_logprobs: int = 0) -> PromptScores:
        """The prompt's own logprobs: one plain forward over it on the decode thread, between two decode
        steps (so under the weights being served, never across a swap)."""
        self._require_started()
        if self._lora is not None:
            raise ValueError("prompt scoring (echo) with model.adapters is not supported yet")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        vocab = self._model.get_input_embeddings().num_embeddings
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_ids must be in [0, {vocab})")
        if self.max_context and len(prompt) > int(self.max_context):
            raise ValueError(f"prompt of {len(prompt)} tokens is longer than the context of {self.max_context}")
        if top_logprobs < 0:
            raise ValueError("top_logprobs must be >= 0")
        loop = asyncio.get_running_loop()
        job = _Job(loop, loop.create_future(), lambda: self._score(prompt, int(top_logprobs)))
        with self._cv:
            self._check_open()
            self._jobs.append(job)
            self._cv.notify_all()
        result: PromptScores = await job.future
        return result

    def _score(self, prompt: list[int], k: int) -> PromptScores:
        """Log-softmax of the model's logits at every prompt position, read at the next prompt token; the
        LM head runs over chunks of positions (memory O(chunk x vocab), not O(prompt x vocab))."""
        import torch

        model = self._model
        ids = torch.tensor([prompt], device=self.device)
        head = model.get_output_embeddings()
        try:
            decoder = model.get_decoder()
        except (AttributeError, NotImplementedError):
            decoder = None
        if decoder is None or head is None:
            logits = model(input_ids=ids).logits[0, :-1].float()
            chunks = [(0, logits)]
        else:
            hidden = decoder(input_ids=ids).last_hidden_state[0, :-1]
            step = max(1, SCORE_CHUNK_ELEMENTS // int(head.weight.shape[0]))
            chunks = [(a, None) for a in range(0, hidden.shape[0], step)]
        lps: list[float | None] = [None]
        tops: list[dict[int, float] | None] | None = [None] if k > 0 else None
        targets = torch.tensor(prompt[1:], device=self.device)
        for a, logits in chunks:
            if logits is None:
                logits = head(hidden[a:a + step]).float()
            logp = torch.log_softmax(logits, dim=-1)
            n = logp.shape[0]
            lps.extend(logp.gather(1, targets[a:a + n, None])[:, 0].tolist())
            if tops is not None:
                vals, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
                tops.extend({int(i): float(v) for i, v in zip(ri, rv, strict=True)}
                            for ri, rv in zip(idx.tolist(), vals.tolist(), strict=True))
        self.stats["forward_passes"] += 1
        self.stats["scored_tokens"] = self.stats.get("scored_tokens", 0) + len(prompt)
        return PromptScores(logprobs=lps, top_logprobs=tops, policy_version=self.policy_version)

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | None = None, *, path: str | None = None,
        version: int,
    ) -> None:
        if (named_tensors is None) == (path is None):
            raise ValueError("update_weights needs exactly one of named_tensors or path")
        self._require_started()
        await asyncio.to_thread(self._update_weights_sync, named_tensors, path, version)

    def _version_of(self, adapter: str | None) -> int:
        """The policy version a token sampled with ``adapter`` gets: the adapter's own (None: the engine's)."""
        return self.adapter_versions[adapter] if adapter is not None else self.policy_version

    async def update_adapter(self, name: str, lora: Sequence[tuple[str, Any, Any, float]], *, version: int,
                             policy_version: int | None = None) -> None:
        """Serve ``lora`` (``(module, A, B, scale)`` per adapted module) as adapter ``name`` from the next
        decode step on, at that adapter's ``version``; the other adapters and the base are untouched.
        ``policy_version``: the engine's version too (the server's step counter)."""
        self._require_started()
        if self._lora is None:
            raise ValueError("update_adapter: this engine serves no adapters (model.adapters is empty)")

        def run() -> None:
            with self._swapping():
                assert self._lora is not None
                self._lora.load(name, lora)
                self.adapter_versions[name] = int(version)
                if policy_version is not None:
                    self.policy_version = int(policy_version)
                self.stats["weight_updates"] += 1
        await asyncio.to_thread(run)

    async def add_adapter(self, name: str) -> None:
        """Serve adapter ``name`` too, at version 0 (the base until :meth:`update_adapter` fills it), in one of
        the slots ``model.max_adapters`` keeps; the others and requests in flight are untouched."""
        self._require_started()
        if self._lora is None:
            raise ValueError("add_adapter: this engine serves no adapters (start it with model.adapters)")

        def run() -> None:
            with self._swapping():
                assert self._lora is not None
                self._lora.add(name)
                self.adapter_versions[name] = 0
        await asyncio.to_thread(run)

    async def unload_lora(self, version: int | None = None) -> None:
        """Undo a merged LoRA adapter (restore the base weights)."""
        def run() -> None:
            with self._swapping():
                self._restore_lora_base()
                if version is not None:
                    self.policy_version = version
        await asyncio.to_thread(run)

    @contextlib.contextmanager
    def _swapping(self) -> Iterator[None]:
        """Hold the weights lock for a swap, taken between two decode steps even under load."""
        self._swap_waiting.set()
        try:
            with self._weights_lock:
                self._swap_waiting.clear()
                yield
        finally:
            self._swap_waiting.clear()

    def weights_lock(self) -> threading.Lock:
        """Lock held by the decode loop during each forward pass and by weight updates."""
        return self._weights_lock

    async def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None
        err = RuntimeError("hf backend closed")
        for seq in list(self._pending) + self._active:
            self._fail(seq.req, err)
        for job in self._jobs:
            job.settle(error=err)
        self._jobs.clear()
        self._pending.clear()
        self._active = []
        self._flight = None
        self._cache = self._runner = None
        self._model = None

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        self.model_dir = resolve_model_path(self.model_cfg.path)
        dev = str(self.cfg.device)
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        dt = str(self.cfg.dtype)
        if dt == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = getattr(torch, dt)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._worker_tok = AutoTokenizer.from_pretrained(self.model_dir)  # decode off the caller's copy
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype,
                                                     attn_implementation=register_attention())
        model.to(self.device).eval()
        model.requires_grad_(False)
        #: q/k/v and gate/up projections as one matmul each (fewer kernels per decode step; fused.py)
        self.fused_groups = fuse_projections(model) if self.cfg.fuse_projections else 0
        self._model = model
        eos: set[int] = set()
        for src in (getattr(model.generation_config, "eos_token_id", None), self._tokenizer.eos_token_id):
            if isinstance(src, int):
                eos.add(src)
            elif isinstance(src, (list, tuple)):
                eos.update(int(x) for x in src)
        self._eos_ids = frozenset(eos)
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else (min(eos) if eos else 0))
        if self.max_context is None:
            self.max_context = getattr(model.config, "max_position_embeddings", None)
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        if self.adapter_specs:
            self._lora = MultiLora(model, [a.name for a in self.adapter_specs], self.model_cfg.lora_rank,
                                   self.model_cfg.lora_target_modules, rows=self.max_batch_size,
                                   capacity=self.model_cfg.adapter_capacity())
        self._rng = random.Random()  # unseeded requests' uniforms (seeded from the OS)
        self.load_time_s = time.perf_counter() - t0
        log.info("hf backend: loaded %s on %s (%s) in %.1fs", self.model_dir, self.device,
                 self.dtype, self.load_time_s)

    def _require_started(self) -> None:
        self._dead.check()
        if self._model is None or self._thread is None:
            raise RuntimeError("hf backend not started: await backend.start() first")

    def _check_open(self) -> None:
        """Refuse new work on a closed or dead engine (caller holds ``_cv``)."""
        self._dead.check()
        if self._closed:
            raise RuntimeError("hf backend closed")

    def failure(self) -> str | None:
        return self._dead.why

    # ------------------------------------------------------------------ submission
    def _submit(self, req: _Request, prompt_ids: Sequence[int]) -> None:
        self._require_started()
        p = req.params
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        p.check()
        vocab = self._model.get_input_embeddings().num_embeddings
        if any(not 0 <= t < vocab for t in p.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt_ids must be in [0, {vocab})")
        max_tokens = p.max_tokens
        if self.max_context:
            room = int(self.max_context) - len(prompt)
            if room < 1:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens leaves no room in the context of {self.max_context}")
            max_tokens = min(max_tokens, room)
        if self._kv_longest is not None:
            if len(prompt) + 1 > self._kv_longest:
                raise ValueError(
                    f"prompt of {len(prompt)} tokens cannot fit the KV cache: backend.kv_cache_memory="
                    f"{self.cfg.kv_cache_memory} ({human_bytes(self.kv_budget_bytes)}) holds {self._kv_longest} "
                    f"tokens of one sequence ({human_bytes(self._cache.bytes_per_token())} each); raise "
                    "backend.kv_cache_memory or send a shorter prompt")
            max_tokens = min(max_tokens, self._kv_longest - len(prompt))

        stop_ids = frozenset(self._eos_ids | {int(t) for t in p.stop_token_ids})
        adapter = p.adapter
        if adapter is not None and adapter not in self.adapter_versions:
            raise ValueError(f"adapter {adapter!r} is not served here; adapters: {sorted(self.adapter_versions) or 'none'}")
        for i in range(p.n):
            rng = None
            if p.seed is not None and not p.greedy():
                rng = random.Random(int(p.seed) + i)  # any integer seed
            req.seqs.append(_Seq(req=req, index=i, prompt=prompt, max_tokens=max_tokens,
                                 stop_ids=stop_ids, rng=rng, version=self._version_of(adapter),
                                 out_top=[] if p.top_logprobs > 0 else None, shaped=bool(p.shaping()),
                                 adapter=adapter, adapter_index=self._lora.index[adapter] if adapter else 0))
        with self._cv:
            self._check_open()
            self._pending.extend(req.seqs)
            self._cv.notify_all()

    # ------------------------------------------------------------------ worker
    def _build_slots(self) -> None:
        """The slot cache and its runner, built on the worker thread: on a CPU, a thread that runs torch
        operations gets its own OpenMP team, and idle teams of other threads slow the decode loop down."""
        cfg = self._model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        import torch

        heads = int(cfg.num_attention_heads)
        layers = int(cfg.num_hidden_layers)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        per_token = kv_bytes_per_token(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                                       element_size=torch.empty((), dtype=self.dtype).element_size())
        cuda = self.device.type == "cuda"
        free = int(torch.cuda.mem_get_info(self.device)[0]) if cuda else available_ram()
        self.kv_budget_bytes = budget_bytes(self.kv_memory, cuda=cuda, free_bytes=free)
        self._kv_positions = self.kv_budget_bytes // per_token
        self._kv_longest = longest_sequence(self._kv_positions)
        if self._kv_longest < MIN_WINDOW:
            raise ValueError(
                f"backend.kv_cache_memory={self.cfg.kv_cache_memory} gives the KV cache "
                f"{human_bytes(self.kv_budget_bytes)}: {self._kv_positions} positions of "
                f"{human_bytes(per_token)}; it needs at least {MIN_WINDOW + 1} ({human_bytes((MIN_WINDOW + 1) * per_token)})")
        shape = None
        count = self.max_batch_size
        while shape is None:  # today's start (every slot, MIN_CAPACITY positions), or as many slots as fit
            shape = cache_shape(count, min(MIN_CAPACITY, self._kv_longest), positions=self._kv_positions,
                                max_slots=self.max_batch_size, limit=MIN_CAPACITY)
            count = max(count // 2, 1)
        log.info("hf backend: KV cache budget %s (backend.kv_cache_memory=%s), %d tokens of %s; the cache "
                 "starts at %d slots x %d", human_bytes(self.kv_budget_bytes), self.cfg.kv_cache_memory,
                 self._kv_positions, human_bytes(per_token), shape[0], shape[1])
        self._cache = SlotCache(layers=layers, slots=shape[0], capacity=shape[1], kv_heads=kv_heads,
                                head_dim=head_dim, dtype=self.dtype, device=self.device)
        self._free = list(range(shape[0]))
        self._runner = SlotRunner(self._model, self._cache, graphs=bool(self.cfg.cuda_graphs),
                                  logits_to_keep=self._logits_to_keep)
        self.pipelined = {"on": True, "off": False}.get(self.cfg.pipeline, self._runner.use_graphs)
        self._probe()

    def _probe(self) -> None:
        """Check once that the slot path computes what the model's own forward does (an architecture whose
        attention or mask does not go through the slot cache would otherwise decode garbage silently)."""
        import torch

        vocab = self._model.get_input_embeddings().num_embeddings
        ids = [(7 * i + 3) % vocab for i in range(12)]
        with torch.inference_mode():
            slot = torch.log_softmax(self._runner.prefill([ids], [0], self._pad_id).float(), -1)
            plain = torch.log_softmax(self._model(input_ids=torch.tensor([ids], device=self.device)).logits[:, -1]
                                      .float(), -1)
        # KL(plain || slot) of the next-token distributions: ~1e-9 in float32, small in bf16 (rounding), and
        # far above 1 when the mask or the cache is bypassed (the max |d logprob| of a bf16 vocabulary is not
        # a usable test: some of 150k rare tokens move by rounding alone)
        kl = float((plain.exp() * (plain - slot)).sum())
        tol = 1e-3 if self.dtype == torch.float32 else 0.1
        if not kl <= tol:
            raise RuntimeError(
                f"hf backend: the slot-cache forward of {type(self._model).__name__} differs from its plain "
                f"forward (KL {kl:.3g} > {tol}); this architecture's attention does not go through swarmkit's "
                "slot attention: use backend=vllm for it")

    def _worker(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        try:
            self._build_slots()
        except BaseException as exc:  # noqa: BLE001 - start() reports it
            self._start_error = exc
            return
        finally:
            self._ready.set()
        try:
            self._serve()
        except BaseException as exc:  # noqa: BLE001 - nothing may wait for a worker that is gone
            self._die(exc)
            if not isinstance(exc, Exception):
                raise

    def _serve(self) -> None:
        """The decode loop, until :meth:`close`; raises when the engine cannot go on (see :meth:`_step_failed`)."""
        import torch

        failed = 0
        while True:
            with self._cv:
                while (not self._closed and not self._pending and not self._active and not self._jobs
                       and self._flight is None):
                    self._cv.wait()
                if self._closed:
                    return
                if not self._active and self._pending and self.batch_wait_s > 0:
                    self._gather_burst()
                self._reap()
                joiners = self._take_joiners()
                jobs = list(self._jobs)
                self._jobs.clear()
            try:
                if self._swap_waiting.is_set():
                    self._drain()  # a weight swap goes between two steps, none in flight
                while self._swap_waiting.is_set():
                    time.sleep(0.0005)
                with self._weights_lock, torch.inference_mode():
                    t0 = time.perf_counter()
                    if jobs or joiners or not self._active:
                        self._drain()  # scoring, a prefill into freed slots: nothing in flight
                    self._run_jobs(jobs)  # never raises: each job gets its own result or error
                    if joiners:
                        self._prefill(joiners)
                        self._reap()
                    if self._active:
                        self._decode_step()
                    self.stats["busy_s"] += time.perf_counter() - t0
                failed = 0
            except Exception as exc:  # noqa: BLE001 - the forward itself failed
                failed += 1
                self._step_failed(exc, joiners, failed)

    def _step_failed(self, exc: Exception, joiners: list[_Seq], failed: int) -> None:
        """A step raised: fail the requests that were in it (the others keep waiting), then check that a short
        prefill and decode step still run; raise (the engine is dead) if not, or after ``MAX_FAILED_STEPS``."""
        log.exception("hf backend: a generation step failed (%d in a row)", failed)
        err = EngineError(f"the hf engine failed on this request: {type(exc).__name__}: {exc}")
        for seq in {id(s): s for s in joiners + self._active}.values():
            seq.req.cancelled = True  # its other continuations (n > 1) still waiting are dropped
            self._fail(seq.req, err)
        self._flight = None  # a step in flight belonged to the failed ones
        self._active = []
        self._free = list(range(self._cache.slots))
        self.stats["failed_steps"] = self.stats.get("failed_steps", 0) + 1
        if failed >= MAX_FAILED_STEPS:
            raise RuntimeError(f"{failed} generation steps in a row failed; the last: {type(exc).__name__}: {exc}")
        why = self._check_step()
        if why is not None:
            raise RuntimeError(f"a generation step failed ({type(exc).__name__}: {exc}) and so does a check step "
                               f"after it ({why})")

    def _check_step(self) -> str | None:
        """Run a short prefill into slot 0 and one decode step (every slot is free); why they fail, or None."""
        import torch

        vocab = self._model.get_input_embeddings().num_embeddings
        ids = [(7 * i + 3) % vocab for i in range(8)]
        try:
            with self._weights_lock, torch.inference_mode():
                if self._lora is not None:
                    self._lora.set_rows([0])
                self._runner.prefill([ids], [0], self._pad_id)
                self._runner.decode([ids[-1]], [len(ids)])
        except Exception as exc:  # noqa: BLE001 - the answer is the message
            return f"{type(exc).__name__}: {exc}"
        return None

    def _die(self, exc: BaseException) -> None:
        """The engine cannot go on: record why (:meth:`failure`), fail every pending, running and queued request
        and job with it at once, and refuse every later one (:meth:`_check_open`)."""
        why = f"{type(exc).__name__}: {exc}"
        log.error("hf backend: the engine is dead and fails every request from now on: %s", why,
                  exc_info=(type(exc), exc, exc.__traceback__))
        with self._cv:
            err = self._dead.record(why)
            seqs = list(self._pending) + list(self._active)
            jobs = list(self._jobs)
            self._pending.clear()
            self._jobs.clear()
            self._active = []
            self._flight = None
        for seq in seqs:
            self._fail(seq.req, err)
        for job in jobs:
            job.settle(error=err)

    def _run_jobs(self, jobs: list[_Job]) -> None:
        """Run queued jobs (caller holds the weights lock); a job that fails fails alone."""
        for job in jobs:
            try:
                job.settle(job.run())
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                log.exception("hf backend: a scoring job failed")
                job.settle(error=exc)

    def _gather_burst(self) -> None:
        """Idle worker, first request in: wait while requests keep arriving (caller holds ``_cv``).

        The window closes ``batch_wait_s`` after the latest arrival, ``batch_wait_max_s`` after
        the first at the latest, or when a full batch is waiting, so a burst of calls that reach
        the server a few milliseconds apart (HTTP parsing, templating) is prefilled as one batch.
        """
        start = last = time.monotonic()
        seen = len(self._pending)
        while len(self._pending) < self.max_batch_size and not self._closed:
            now = time.monotonic()
            if len(self._pending) != seen:
                seen, last = len(self._pending), now
            left = min(last + self.batch_wait_s, start + self.batch_wait_max_s) - now
            if left <= 0:
                return
            self._cv.wait(left)

    def _take_joiners(self) -> list[_Seq]:
        """Waiting sequences to admit now, in arrival order, within the free slots and the prefill budget.

        Fair share: while sequences of more than one request wait, a request holds at most half the slots
        (its other continuations wait for its own to finish), so one ``n: 128`` request cannot make every
        later call wait for all of its tokens."""
        room = self.max_batch_size - len(self._active)
        if not self._pending or room <= 0:
            return []
        reqs = {id(s.req) for s in self._pending if not s.req.cancelled}
        share = max(1, self.max_batch_size // 2) if len(reqs) > 1 else self.max_batch_size
        held: dict[int, int] = {}
        for s in self._active:
            held[id(s.req)] = held.get(id(s.req), 0) + 1
        out: list[_Seq] = []
        later: deque[_Seq] = deque()
        longest = 0
        count, reach = len(self._active), max((s.need for s in self._active), default=0)
        while self._pending:
            seq = self._pending.popleft()
            if seq.req.cancelled:
                continue
            if len(out) >= room:
                later.append(seq)
                break
            if held.get(id(seq.req), 0) >= share:
                later.append(seq)
                continue
            longest2 = max(longest, len(seq.prompt))
            if out and longest2 * (len(out) + 1) > self.max_prefill_tokens:
                later.append(seq)
                break
            if not self._fits(count + 1, max(reach, seq.need)):  # waits for running sequences to finish
                later.append(seq)
                self.stats["kv_waits"] = self.stats.get("kv_waits", 0) + 1
                break
            count, reach = count + 1, max(reach, seq.need)
            longest = longest2
            held[id(seq.req)] = held.get(id(seq.req), 0) + 1
            out.append(seq)
        later.extend(self._pending)
        self._pending = later
        return out

    # ------------------------------------------------------------------ slots
    def _reap(self) -> None:
        """Free the slots of finished and cancelled sequences (nothing is copied)."""
        keep: list[_Seq] = []
        for seq in self._active:
            if seq.finish is None and not seq.req.cancelled:
                keep.append(seq)
            else:
                heapq.heappush(self._free, seq.slot)
                seq.slot = -1
        self._active = keep

    def _fits(self, count: int, longest: int) -> bool:
        """Whether ``count`` sequences of at most ``longest`` positions fit: the cache as it is, or a shape the
        KV budget holds."""
        cache = self._cache
        if count <= cache.slots and longest <= cache.capacity:
            return True
        return self._shape_for(count, longest) is not None

    def _shape_for(self, count: int, longest: int) -> tuple[int, int] | None:
        return cache_shape(count, longest, positions=self._kv_positions, max_slots=self.max_batch_size,
                           limit=int(self.max_context or longest), current=(self._cache.slots, self._cache.capacity))

    def _reserve(self, joiners: list[_Seq]) -> None:
        """Give each joiner the lowest free slot (decode batches stay as narrow as possible); reshape the cache
        first when the running sequences and the joiners do not fit it (admission checked that the budget
        holds them): the running ones move to slots ``0..k-1`` with what they have cached."""
        cache = self._cache
        count = len(self._active) + len(joiners)
        longest = max(s.need for s in (*self._active, *joiners))
        if count > cache.slots or longest > cache.capacity:
            shape = self._shape_for(count, longest)
            if shape is None:
                raise RuntimeError(f"hf backend: {count} sequences of up to {longest} tokens do not fit the KV "
                                   f"cache budget ({human_bytes(self.kv_budget_bytes)})")
            running = sorted(self._active, key=lambda s: s.slot)
            moves = {s.slot: i for i, s in enumerate(running)}
            written = max((len(s.prompt) + len(s.out_ids) for s in running), default=0)
            t0 = time.perf_counter()
            self._runner.reshape(shape[0], shape[1], moves, written)
            for s in running:
                s.slot = moves[s.slot]
            self._free = list(range(len(running), shape[0]))  # ascending: a heap
            self.stats["kv_reshapes"] = self.stats.get("kv_reshapes", 0) + 1
            log.debug("hf backend: KV cache reshaped to %d slots x %d (%s) in %.3fs", shape[0], shape[1],
                      human_bytes(self._cache.nbytes()), time.perf_counter() - t0)
        for seq in joiners:
            seq.slot = heapq.heappop(self._free)

    def _prefill(self, joiners: list[_Seq]) -> None:
        """Prefill the joiners' prompts into their slots (a request's ``n`` continuations share one pass)
        and sample each one's first token."""
        self._reserve(joiners)
        uniq: dict[int, _Seq] = {}
        for seq in joiners:
            seq.version = self._version_of(seq.adapter)
            uniq.setdefault(id(seq.req), seq)
        firsts = list(uniq.values())
        if self._lora is not None:
            self._lora.set_rows([s.adapter_index for s in firsts])
        logits = self._runner.prefill([s.prompt for s in firsts], [s.slot for s in firsts], self._pad_id)
        self.stats["forward_passes"] += 1
        self.stats["prefill_passes"] += 1
        self.stats["prefill_tokens"] += sum(len(s.prompt) for s in firsts)
        self.stats["sequences"] += len(joiners)
        if len(firsts) < len(joiners):
            row = {id(s.req): i for i, s in enumerate(firsts)}
            for first in firsts:
                others = [s.slot for s in joiners if s.req is first.req and s is not first]
                if others:
                    self._cache.copy_slot(first.slot, others, len(first.prompt))
            logits = logits.index_select(0, torch_tensor([row[id(s.req)] for s in joiners], logits.device))
        self._active.extend(joiners)
        self._sample_and_append(joiners, logits)

    def _decode_step(self) -> None:
        """One token for every active sequence: rows are slots ``0..max slot``."""
        if self.pipelined and self._pipelined_step():
            return
        seqs = self._active
        width = max(s.slot for s in seqs) + 1
        ids = [self._pad_id] * width
        pos = [0] * width
        for s in seqs:
            ids[s.slot] = s.out_ids[-1]
            pos[s.slot] = len(s.prompt) + len(s.out_ids) - 1
        self._set_lora_rows(seqs, width)
        logits = self._runner.decode(ids, pos)
        slots = [s.slot for s in seqs]
        if slots != list(range(width)):
            logits = logits.index_select(0, torch_tensor(slots, logits.device))
        self._count_decode(len(seqs))
        self._sample_and_append(seqs, logits)

    def _set_lora_rows(self, seqs: list[_Seq], width: int) -> None:
        """Each row's adapter for the coming decode forward (rows are slots; free rows: no adapter)."""
        if self._lora is not None:
            rows = [0] * width
            for s in seqs:
                rows[s.slot] = s.adapter_index
            self._lora.set_rows(rows)

    def _count_decode(self, rows: int) -> None:
        self.stats["forward_passes"] += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += rows
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], rows)

    # ------------------------------------------------------------------ one step in flight
    def _plain(self, seq: _Seq) -> bool:
        """Whether the fused step can sample ``seq``'s row (:func:`~.sampler.sample_plain`): temperature or
        greedy only; no top_p/top_k/min_p filter, no logit shaping, no top logprobs."""
        return not seq.shaped and seq.out_top is None and seq.req.params.top_p >= 1.0

    def _pipelined_step(self) -> bool:
        """Launch the next fused step, then process the one in flight (their work overlaps on a GPU).

        False (nothing in flight then): a row needs the sampler's other paths (or the fused step could not
        be captured), so the caller runs this step the serial way. The step in flight is drained first when
        the next step cannot continue from it: a non-plain row, or a shape whose graph is not captured yet
        (a capture needs every row's input from the host)."""
        seqs = self._active
        prev = self._flight
        carried = {id(s) for s in prev.seqs} if prev is not None else set()
        fusable = self._runner.fused_ok and all(self._plain(s) for s in seqs)
        if fusable and prev is not None:
            width = max(s.slot for s in seqs) + 1
            max_pos = max(len(s.prompt) + len(s.out_ids) - (id(s) not in carried) for s in seqs)  # as _launch
            fusable = self._runner.step_ready(width, max_pos)
        if not fusable:
            if prev is None:
                return False
            self._drain()
            self._reap()
            return not self._active or self._pipelined_step()
        self._flight = self._launch(seqs, carried)
        if prev is not None:
            self._land(prev)
        return True

    def _launch(self, seqs: list[_Seq], carried: set[int]) -> _Flight:
        """Launch one fused step for ``seqs`` (rows = slots). A sequence in ``carried`` (ids of those in the
        step in flight) continues from the device's feedback at the next position (its token there is not
        known yet); the others, and free rows (a finished sequence's: the pad token at position 0), take
        their input from the host. Each sequence draws its uniform now, in order, as the serial path does
        (so seeded tokens do not change)."""
        width = max(s.slot for s in seqs) + 1
        ids: list[float] = [self._pad_id] * width  # ints and floats: one float64 tensor
        pos: list[float] = [0] * width
        temp, draw, host = [0.0] * width, [0.5] * width, [1.0] * width
        versions: list[int] = []
        max_pos = 0
        rng = self._rng
        for s in seqs:
            r = s.slot
            p = len(s.prompt) + len(s.out_ids) - 1
            if id(s) in carried:
                p += 1
                host[r] = 0.0
            else:
                ids[r] = s.out_ids[-1]
            pos[r] = p
            if p > max_pos:
                max_pos = p
            temp[r] = s.req.params.temperature
            draw[r] = _uniform(s.rng or rng)
            versions.append(self._version_of(s.adapter))
        self._set_lora_rows(seqs, width)
        out, event = self._runner.step([ids, pos, temp, draw, host], max_pos)
        self._count_decode(len(seqs))
        self.stats["fused_steps"] += 1
        return _Flight(list(seqs), [s.slot for s in seqs], versions, out, event)

    def _await_flight(self, flight: _Flight) -> list[list[float]]:
        """Wait until ``flight``'s output has landed on the host; its rows as lists."""
        if flight.event is not None:
            flight.event.synchronize()
        out: list[list[float]] = flight.out.tolist()
        return out

    def _land(self, flight: _Flight) -> None:
        """Process a launched step: append each sequence's token (a sequence that finished meanwhile had a
        wasted row: skipped), labelled with the version at launch."""
        vals = self._await_flight(flight)
        rows = [vals[r] for r in flight.rows]
        self._append_rows(flight.seqs, [int(v[0]) for v in rows], [float(v[1]) for v in rows],
                          [v[2] > 0.5 for v in rows], None, flight.versions)

    def _drain(self) -> None:
        """Process the step in flight, if any."""
        flight, self._flight = self._flight, None
        if flight is not None:
            self._land(flight)

    # ------------------------------------------------------------------ sampling
    def _sample_and_append(self, seqs: list[_Seq], logits: Any) -> None:
        """Sample every row on the device (one host copy), then append; a row the sampler cannot handle
        fails its own sequence only."""
        try:
            toks, lps, bad, tops = self._sample(seqs, logits)
        except Exception:  # noqa: BLE001 - find the rows at fault, one at a time
            log.exception("hf backend: batched sampling failed; sampling row by row")
            toks, lps, bad, tops = [], [], [], []
            for row, seq in enumerate(seqs):
                try:
                    t, lp, b, tp = self._sample([seq], logits[row:row + 1])
                except Exception as exc:  # noqa: BLE001
                    seq.finish, seq.req.cancelled = "error", True
                    self._fail(seq.req, SequenceError(f"sampling failed for this request: {exc}"))
                    t, lp, b, tp = [0], [0.0], [True], None
                toks += t
                lps += lp
                bad += b
                tops.append(tp[0] if tp else [])
        self._append_rows(seqs, toks, lps, bad, tops)

    def _append_rows(self, seqs: list[_Seq], toks: list[int], lps: list[float], bad: list[bool], tops: Any,
                     versions: list[int] | None = None) -> None:
        """Append row ``r``'s token to ``seqs[r]`` (finished sequences skipped; non-finite rows fail their
        request); ``versions``: each token's policy version (None: the current one)."""
        for row, seq in enumerate(seqs):
            if seq.finish is not None:
                continue
            if bad[row]:
                seq.finish, seq.req.cancelled = "error", True
                self._fail(seq.req, RuntimeError("the model produced non-finite logits for this sequence"))
                continue
            top = None
            if tops is not None and seq.out_top is not None:
                kk = seq.req.params.top_logprobs
                top = dict(tops[row][:kk])
            self._append(seq, toks[row], lps[row], top, None if versions is None else versions[row])

    def _sample(self, seqs: list[_Seq], logits: Any) -> tuple[list[int], list[float], list[bool], Any]:
        shaped = logits
        rows_shaped = [r for r, s in enumerate(seqs) if s.shaped]
        if rows_shaped:
            shaped = logits.float().clone()
            for r in rows_shaped:
                shaped[r] = _shaped(shaped[r], seqs[r].req.params, seqs[r])
        ruled = [r for r in rows_shaped if seqs[r].req.params.structural_tag is not None]
        if ruled:
            self._grammars = self._grammars or grammar.Grammars(self._worker_tok, logits.shape[-1], self._eos_ids)
            for r in ruled:
                seqs[r].matcher = seqs[r].matcher or self._grammars.matcher(seqs[r].req.params.structural_tag)
            self._grammars.mask(shaped, ruled, [seqs[r].matcher for r in ruled])
        rows = [RowSampling(temperature=s.req.params.temperature, top_p=s.req.params.top_p,
                            top_k=s.req.params.top_k, min_p=s.req.params.min_p,
                            draw=_uniform(s.rng or self._rng))
                for s in seqs]  # the sampler decodes greedily below GREEDY_TEMPERATURE
        k = max((s.req.params.top_logprobs for s in seqs), default=0)
        out = to_host(sample(logits, shaped, rows, top_logprobs=k))
        if ruled:
            grammar.Grammars.accept([seqs[r].matcher for r in ruled], [out[0][r] for r in ruled])
        return out

    def _decode_text(self, seq: _Seq) -> str:
        ids = seq.out_ids[:-1] if seq.hide_last else seq.out_ids
        return decode_generated(self._worker_tok, ids, seq.req.params)

    def _append(self, seq: _Seq, tok: int, lp: float, top: dict[int, float] | None,
                version: int | None = None) -> None:
        if seq.req.cancelled:
            seq.finish = "abort"
            self._finish_request(seq)
            return
        seq.out_ids.append(tok)
        seq.out_lp.append(lp)
        # constant within a step: swaps hold the weights lock (a launched step's: its version at launch)
        seq.out_ver.append(self._version_of(seq.adapter) if version is None else version)
        if seq.out_top is not None:
            seq.out_top.append(top or {})
        self.stats["tokens_generated"] += 1
        p = seq.req.params
        streaming = seq.req.queue is not None
        if tok in seq.stop_ids:
            seq.finish, seq.hide_last = "stop", True
        if p.stop or streaming or seq.finish is not None:
            seq.text = self._decode_text(seq)
        if seq.finish is None and p.stop:
            # re-scan the tail: a stop string may end in the new text, and trailing
            # replacement chars of a split UTF-8 character may have been resolved
            seq.text, hit = cut_at_stop(seq.text, p.stop, checked=seq.text_len_checked)
            if hit:
                seq.finish = "stop"
            seq.text_len_checked = len(seq.text)
        if seq.finish is None and len(seq.out_ids) >= seq.max_tokens:
            seq.finish = "length"
        if seq.finish is not None and not (p.stop or streaming):
            seq.text = self._decode_text(seq)
        if streaming:
            self._emit_chunk(seq)
        if seq.finish is not None:
            self._finish_request(seq)

    def _emit_chunk(self, seq: _Seq) -> None:
        out = seq.text_out
        chunk = StreamChunk(
            token_ids=seq.out_ids[seq.sent_tokens:],
            logprobs=seq.out_lp[seq.sent_tokens:],
            text=out.push(seq.text) if seq.finish is None else out.finish(seq.text),
            finish_reason=seq.finish,
            top_logprobs=seq.out_top[seq.sent_tokens:] if seq.out_top is not None else None,
            token_versions=seq.out_ver[seq.sent_tokens:],
        )
        seq.sent_tokens = len(seq.out_ids)
        self._deliver(seq.req, lambda q=seq.req.queue, c=chunk: q.put_nowait(c))

    def _finish_request(self, seq: _Seq) -> None:
        req = seq.req
        req.done_count += 1
        if req.future is None or req.done_count < len(req.seqs) or req.cancelled:
            return
        req.delivered = True
        outs = [
            GenerationOutput(token_ids=list(s.out_ids), logprobs=list(s.out_lp), text=s.text,
                             finish_reason=s.finish or "length", top_logprobs=s.out_top,
                             policy_version=s.version, token_versions=list(s.out_ver))
            for s in req.seqs
        ]

        def done(fut: asyncio.Future = req.future) -> None:
            if not fut.done():
                fut.set_result(outs)
        self._deliver(req, done)

    def _deliver(self, req: _Request, fn: Any) -> None:
        try:
            req.loop.call_soon_threadsafe(fn)
        except RuntimeError:  # the caller's loop is gone
            req.cancelled = True

    def _fail(self, req: _Request, exc: BaseException) -> None:
        if req.delivered:
            return
        req.delivered = True
        if req.future is not None:
            def fail(fut: asyncio.Future = req.future) -> None:
                if not fut.done():
                    fut.set_exception(exc)
            self._deliver(req, fail)
        elif req.queue is not None:
            self._deliver(req, lambda q=req.queue: q.put_nowait(exc))

    # ------------------------------------------------------------------ weights
    def _update_weights_sync(self, named_tensors: Iterable[tuple[str, Any]] | None,
                             path: str | None, version: int) -> None:
        with self._swapping():
            if path is not None:
                folder = Path(path)
                if (folder / "adapter_config.json").exists():
                    self._merge_lora(folder)
                else:
                    self._copy_tensors(_iter_folder_tensors(folder))
            else:
                self._copy_tensors(named_tensors or ())
            self.policy_version = int(version)
            self.stats["weight_updates"] += 1

    def _state(self) -> dict[str, Any]:
        return dict(self._model.state_dict(keep_vars=True))

    def _resolve_name(self, name: str, state: dict[str, Any]) -> str | None:
        cand = name
        while True:
            if cand in state:
                return cand
            for pre in _STRIP_PREFIXES:
                if cand.startswith(pre):
                    cand = cand[len(pre):]
                    break
            else:
                return None

    def _copy_tensors(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy named tensors into the served weights: checks first, then one batched copy.

        Tied weights (e.g. ``lm_head`` and ``embed_tokens``) share storage and are
        copied once; the state dict is built once per model (names are stable).
        """
        import torch

        if getattr(self, "_state_cache", None) is None or self._state_cache[0] is not self._model:
            self._state_cache = (self._model, self._state(), {})
        state, resolved = self._state_cache[1], self._state_cache[2]
        unknown: list[str] = []
        dsts: list[Any] = []
        srcs: list[Any] = []
        seen: set[int] = set()
        for name, tensor in named_tensors:
            key = resolved.get(name, "")
            if key == "":  # names are stable from sync to sync: resolve each once
                key = resolved[name] = self._resolve_name(name, state)
            if key is None:
                if "lora_" in name:
                    raise ValueError(
                        f"'{name}' is a LoRA tensor: pass merged weights, or the adapter folder as path=")
                unknown.append(name)
                continue
            dst = state[key]
            src = torch.as_tensor(tensor)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"weight '{name}': shape {tuple(src.shape)} != served {tuple(dst.shape)}")
            self._lora_base.pop(key, None)  # new base value: nothing to restore
            ptr = dst.data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            dsts.append(dst.data)
            srcs.append(src)
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} unknown weight name(s), e.g. {unknown[:3]}")
        with torch.no_grad():
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        log.debug("hf backend: copied %d tensors", len(dsts))

    def _restore_lora_base(self) -> None:
        import torch

        state = self._state()
        with torch.no_grad():
            for key, base in self._lora_base.items():
                state[key].data.copy_(base.to(state[key].device))
        self._lora_base.clear()

    def _merge_lora(self, folder: Path) -> None:
        """Serve ``base + adapter`` (the one merge, :func:`swarmkit.training.lora.adapter_deltas`);
        a later adapter replaces this one, ``unload_lora`` restores the base."""
        import torch

        deltas, replaced = adapter_deltas(folder)
        self._restore_lora_base()
        state = self._state()
        with torch.no_grad():
            for module, delta in deltas.items():
                key = self._resolve_name(module + ".weight", state)
                if key is None:
                    raise KeyError(f"LoRA module '{module}' is not in the served model")
                dst = state[key]
                if tuple(delta.shape) != tuple(dst.shape):
                    raise ValueError(f"LoRA delta for '{module}' has shape {tuple(delta.shape)}, "
                                     f"weight has {tuple(dst.shape)}")
                self._lora_base[key] = dst.detach().to("cpu", copy=True)
                dst.data.copy_((dst.float() + delta.to(dst.device)).to(dst.dtype))
            for name, t in replaced.items():
                key = self._resolve_name(name, state)
                if key is None:
                    raise KeyError(f"adapter tensor '{name}' is not in the served model")
                self._lora_base.setdefault(key, state[key].detach().to("cpu", copy=True))
                state[key].data.copy_(t.to(device=state[key].device, dtype=state[key].dtype))
        log.info("hf backend: merged LoRA adapter %s (%d modules)", folder, len(deltas))


def _uniform(rng: random.Random) -> float:
    """A uniform number in the open interval (0, 1) (``random()`` may return 0.0)."""
    u = rng.random()
    while u <= 0.0:
        u = rng.random()
    return u


def _iter_folder_tensors(folder: Path, adapter: bool = False) -> Iterable[tuple[str, Any]]:
    """Named tensors of the safetensors (or torch .bin) files of a folder."""
    from safetensors import safe_open

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"weights folder '{folder}' does not exist")
    files = sorted(folder.glob("adapter_model*.safetensors" if adapter else "*.safetensors"))
    if files:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118
                    yield name, fh.get_tensor(name)
        return
    bins = sorted(folder.glob("adapter_model*.bin" if adapter else "*.bin"))
    if not bins:
        raise FileNotFoundError(f"no safetensors/bin weights in '{folder}'")
    import torch

    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def _shaped(logits: Any, p: SamplingParams, seq: _Seq) -> Any:
    """``logits`` (one row) after the logit bias and the penalties of ``p`` (a new tensor)."""
    import torch

    x = logits.clone()
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=x.device)
        x[ids] += torch.tensor(list(p.logit_bias.values()), device=x.device, dtype=x.dtype)
    if (p.frequency_penalty or p.presence_penalty) and seq.out_ids:
        out = torch.tensor(seq.out_ids, device=x.device)
        counts = torch.bincount(out, minlength=x.shape[-1])[: x.shape[-1]].to(x.dtype)
        x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt) | set(seq.out_ids)), device=x.device)
        v = x[seen]
        x[seen] = torch.where(v > 0, v / p.repetition_penalty, v * p.repetition_penalty)
    return x
