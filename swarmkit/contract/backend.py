"""The inference-backend contract: token ids in, token ids and logprobs out.

A backend (kind ``backend``) subclasses :class:`InferenceBackend`. The server
builds it as ``cls(config=<backend group dict>, model=<model group dict>)``,
awaits :meth:`~InferenceBackend.start` in BOOTING and calls it concurrently
from many episodes. Imports nothing heavy.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from swarmkit.errors import EngineError

#: the episode an inference call belongs to, set by the server around every call: a backend made of
#: several engines (``backend.replicas``) routes all calls of one episode to the same engine with it
ROUTING_KEY: ContextVar[str | None] = ContextVar("swarmkit_routing_key", default=None)


@dataclass
class SamplingParams:
    """Sampling parameters of one generation request (OpenAI semantics).

    ``stop`` are stop *strings*: generation ends when the decoded text contains
    one, and the text is cut before it. ``stop_token_ids`` end generation on
    these ids (the tokenizer's EOS ids are always added by the backend).
    ``top_logprobs`` > 0 asks for that many alternatives per generated token.
    ``skip_special_tokens`` drops special tokens from the returned text; off by
    default, so the text holds every token the model generated (see
    :func:`decode_generated`) and a client that sends it back replays them.

    The fields after ``top_logprobs`` shape the sampling distribution further; a
    backend lists those it honours in :attr:`InferenceBackend.sampling_fields`
    (the server refuses a request that sets another to a non-default value):

    - ``top_k``: sample among the ``k`` most likely tokens (0: all);
    - ``min_p``: drop tokens less likely than ``min_p`` x the most likely one;
    - ``frequency_penalty`` / ``presence_penalty`` (OpenAI): subtract ``f x count``
      and ``p x (count > 0)`` from the logits of tokens already *generated*;
    - ``repetition_penalty`` (HF / vLLM): divide positive logits and multiply
      negative ones of tokens in the prompt or the generation;
    - ``logit_bias``: token id -> value added to its logit;
    - ``response_format``: constrained decoding, ``{"type": "json_object"}`` (any JSON
      object) or ``{"type": "json_schema", "schema": {...}}`` (JSON valid for the schema);
    - ``structural_tag``: constrained decoding in xgrammar's structural-tag format (``{"type":
      "structural_tag", "format": {...}}``, what vLLM's and SGLang's ``structural_tag`` take): the
      server sets it to force calls of ``strict`` tools to match their schema
      (:mod:`swarmkit.timelines.strict_tools`); never together with ``response_format``.

    Logprobs stay those of the raw distribution whatever these do (see
    :class:`GenerationOutput`).
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0
    skip_special_tokens: bool = False
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    response_format: dict[str, Any] | None = None
    structural_tag: dict[str, Any] | None = None
    #: the LoRA adapter to sample with, on an engine that serves several (``model.adapters``;
    #: :attr:`InferenceBackend.serves_adapters`); None: the one model
    adapter: str | None = None

    def check(self) -> None:
        """Raise ValueError naming the first field no sampler can compute (every backend calls it)."""
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.n < 1:
            raise ValueError("n must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0 or not 0 <= self.min_p <= 1 or self.repetition_penalty <= 0:
            raise ValueError("top_k must be >= 0, min_p in [0, 1], repetition_penalty > 0")
        if any(not math.isfinite(float(v)) for v in self.logit_bias.values()):
            raise ValueError("logit_bias values must be finite")
        if self.response_format is not None and self.structural_tag is not None:
            raise ValueError("response_format and structural_tag cannot both constrain one request")

    def greedy(self) -> bool:
        """Whether this request decodes greedily (a temperature below :data:`GREEDY_TEMPERATURE`)."""
        return self.temperature < GREEDY_TEMPERATURE

    def shaping(self) -> set[str]:
        """The distribution-shaping fields set to something other than their default."""
        return {name for name, default in SHAPING_DEFAULTS.items() if getattr(self, name) != default}


#: a temperature below this decodes greedily on every backend (as vLLM does): dividing logits by a
#: near-zero temperature overflows to inf, and the softmax of that is NaN
GREEDY_TEMPERATURE = 1e-5

#: the distribution-shaping fields of :class:`SamplingParams` and their no-op values
SHAPING_DEFAULTS: dict[str, object] = {"top_k": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                                       "repetition_penalty": 1.0, "logit_bias": {}, "response_format": None,
                                       "structural_tag": None}


def decode_generated(tokenizer: Any, token_ids: Sequence[int], params: SamplingParams) -> str:
    """The text of generated ``token_ids`` as a client receives it.

    Special tokens are kept unless ``params.skip_special_tokens`` and spaces are not
    cleaned up, so the text a client sends back in its history re-tokenizes to the
    tokens the model generated (a special token the model wrote mid-answer included)
    and the next turn extends the recorded timeline instead of starting a new one.
    The stop token that ended generation is the caller's to leave out.
    """
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=params.skip_special_tokens,
                                clean_up_tokenization_spaces=False))


@dataclass
class GenerationOutput:
    """One sampled continuation.

    ``logprobs[i]`` is log p(token_ids[i] | prefix) under the model's
    unmodified distribution (log-softmax of the raw logits, no temperature),
    which is what importance ratios in training are computed against.
    ``policy_version`` is the version of the weights the continuation started
    with; ``token_versions[i]`` the version of the weights that sampled token
    ``i`` (a *partial rollout* spans a weight swap and has tokens of two
    versions). None means every token has ``policy_version``.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    top_logprobs: list[dict[int, float]] | None = None
    policy_version: int = 0
    token_versions: list[int] | None = None

    def versions(self) -> list[int]:
        """``[T]`` the policy version of every generated token."""
        if self.token_versions is None:
            return [int(self.policy_version)] * len(self.token_ids)
        if len(self.token_versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_versions)} token versions for {len(self.token_ids)} tokens")
        return [int(v) for v in self.token_versions]


@dataclass
class PromptScores:
    """The logprobs of a prompt's own tokens under the served weights (``echo`` of ``/v1/completions``).

    ``logprobs[i]`` is log p(prompt_ids[i] | prompt_ids[:i]) of the unmodified distribution (as
    :class:`GenerationOutput`'s) for ``i >= 1``; ``logprobs[0]`` is None (the first token has no
    prefix). ``top_logprobs[i]`` (when asked for) holds the ``k`` most likely tokens at position
    ``i`` (None at 0). ``policy_version``: the weights that scored it.
    """

    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None] | None = None
    policy_version: int = 0


@dataclass
class StreamChunk:
    """Tokens appended to one continuation since the previous chunk (``n == 1`` streams)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None  # set on the last chunk
    top_logprobs: list[dict[int, float]] | None = None
    #: the policy version that sampled each token (None: the version the stream started with)
    token_versions: list[int] | None = None

    def versions(self, default: int) -> list[int]:
        """``[T]`` the policy version of each token of the chunk (``default`` when not reported)."""
        if self.token_versions is None:
            return [int(default)] * len(self.token_ids)
        return [int(v) for v in self.token_versions]


class EngineFailure:
    """Why an engine died, once it has, and the error each later call then raises.

    A backend whose engine can die keeps one (``EngineFailure("hf")``), answers
    :meth:`InferenceBackend.failure` with :attr:`why`, calls :meth:`check` before taking work and
    :meth:`record` where the engine gives up; every error names the engine and the cause.
    """

    def __init__(self, engine: str) -> None:
        self.engine = engine
        #: the cause (``"KeyError: ..."``, ``"weight reload failed: ..."``); None while the engine serves
        self.why: str | None = None

    def record(self, why: str) -> EngineError:
        """Mark the engine dead for ``why``; returns the error to fail its pending requests with."""
        self.why = why
        return self.error()

    def error(self) -> EngineError:
        """The error (``dead=True``) that every request of the dead engine fails with."""
        return EngineError(f"the {self.engine} engine failed and serves no more requests: {self.why}", dead=True)

    def check(self) -> None:
        """Raise :meth:`error` if the engine died; nothing while it serves."""
        if self.why is not None:
            raise self.error()


class InferenceBackend(ABC):
    """An inference engine serving one model, token ids in and token ids out.

    Built by the server as ``cls(config=backend_cfg, model=model_cfg)`` where
    both are plain dicts of the ``backend`` and ``model`` config groups.
    Requests from many episodes arrive concurrently; a backend batches them.
    Stop strings and streamed text follow :mod:`swarmkit.contract.streaming`.
    """

    #: policy version (optimizer step) of the weights now being served
    policy_version: int = 0
    #: the longest prompt + generation the engine serves (None: ``model.max_context``)
    max_context: int | None = None
    #: the distribution-shaping fields of :class:`SamplingParams` this backend honours
    #: (``top_k``, ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``,
    #: ``logit_bias``, ``response_format``, ``structural_tag``); the server refuses a request that needs another
    #: (none by default); with ``structural_tag`` it constrains calls of ``strict`` tools (``server.strict_tools``)
    sampling_fields: frozenset[str] = frozenset()
    #: why an engine that could take ``structural_tag`` does not now (e.g. a missing package to install);
    #: ``server.strict_tools: constrain`` says it when the server refuses to start
    structural_tag_hint: str | None = None
    #: whether outputs label each token with the version that sampled it (``token_versions``) when
    #: weights are swapped mid-generation; otherwise every token is labelled with the version its
    #: request started with, which over-states the staleness of a partial rollout (safe, not exact)
    reports_token_versions: bool = False
    #: whether several instances may serve side by side in one process (``backend.replicas`` > 1)
    replicable: bool = True
    #: whether the engine serves the trained model's weights; False for one without a model (``scripted``):
    #: the training cycle then runs its steps without a trainer (no model loaded, no weights changed), each
    #: step only moving the policy version on
    trainable: bool = True
    #: whether :meth:`score_prompt` is implemented (``echo`` with prompt logprobs; the server refuses
    #: an ``echo`` request on a backend without it)
    scores_prompts: bool = False
    #: whether the engine serves several named LoRA adapters over one base (``model.adapters``): it samples
    #: each request with ``SamplingParams.adapter``, labels tokens with that adapter's version and takes
    #: :meth:`update_adapter`
    serves_adapters: bool = False

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (with chat template) of the served model."""

    @abstractmethod
    async def start(self) -> None:
        """Load the model and make the engine ready (the server's BOOTING)."""

    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        """Sample ``params.n`` continuations of ``prompt_ids``."""

    @abstractmethod
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StreamChunk]:
        """Sample one continuation, yielding tokens as they are generated."""

    @abstractmethod
    async def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | None = None, *, path: str | None = None,
        version: int,
    ) -> None:
        """Replace the served weights in place (no restart) and set ``policy_version``.

        Called while requests run (asynchronous training): a backend swaps between two
        engine steps, and continuations in flight go on with the new weights, their
        tokens labelled with the version that sampled them (``token_versions``).

        Either ``named_tensors`` (full weights or, for LoRA, the merged weights)
        or ``path`` (a folder with safetensors / a peft adapter).
        """

    async def update_adapter(self, name: str, lora: Sequence[tuple[str, Any, Any, float]], *, version: int,
                             policy_version: int | None = None) -> None:
        """Replace adapter ``name`` (``(module, A [r, in], B [out, r], scale)`` for every adapted module) in
        place, at that adapter's ``version``; ``policy_version`` sets the engine's own too. Only for an
        engine that :attr:`serves_adapters`."""
        raise NotImplementedError(f"{type(self).__name__} does not serve several adapters")

    async def add_adapter(self, name: str) -> None:
        """Serve adapter ``name`` too from now on, at version 0 and equal to the base until
        :meth:`update_adapter` fills it (a server's ``POST /api/v1/admin/adapters``); ValueError when the
        engine has no room for it. Only for an engine that :attr:`serves_adapters`."""
        raise NotImplementedError(f"{type(self).__name__} does not add adapters at run time")

    async def score_prompt(self, prompt_ids: Sequence[int], top_logprobs: int = 0) -> PromptScores:
        """The logprob of every token of ``prompt_ids`` given the ones before it (one forward over the
        prompt, nothing generated), with the ``top_logprobs`` most likely tokens at each position.

        Optional: a backend that implements it sets ``scores_prompts = True``. Raise ValueError for a
        prompt the engine refuses (the server answers 400).
        """
        raise NotImplementedError(f"{type(self).__name__} does not score prompts")

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Free the engine."""

    def engine_stats(self) -> dict[str, float]:
        """Counters of the engine since it started (optional; none by default).

        ``busy_s``: seconds the engine spent computing (prefill, decode steps); over a
        wall-clock window, ``1 - Δbusy_s / Δwall`` is the share of time it sat idle.
        ``tokens_generated``: tokens sampled.
        """
        return {}

    def failure(self) -> str | None:
        """Why this engine can serve no more requests (it died: its worker thread, its device), else None.

        The server checks it a few times a second and stops with this as its ``last_error`` (a main job
        then exits non-zero); the engine fails every pending and later request with
        :class:`swarmkit.errors.EngineError` (``dead=True``) at once, never leaving one waiting. A failure
        of one request only (the engine goes on) is an ``EngineError`` of that request, not this.
        """
        return None
