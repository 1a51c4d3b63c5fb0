"""What each kind of component implements.

These are the contracts between the core and the plugins. They import nothing
heavy (no torch at import time), so listing and validating plugins stays cheap.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.timeline import Block


# --------------------------------------------------------------------------- backend
@dataclass
class SamplingParams:
    """Sampling parameters of one generation request (OpenAI semantics).

    ``stop`` are stop *strings*: generation ends when the decoded text contains
    one, and the text is cut before it. ``stop_token_ids`` end generation on
    these ids (the tokenizer's EOS ids are always added by the backend).
    ``top_logprobs`` > 0 asks for that many alternatives per generated token.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    top_logprobs: int = 0


@dataclass
class GenerationOutput:
    """One sampled continuation.

    ``logprobs[i]`` is log p(token_ids[i] | prefix) under the model's
    unmodified distribution (log-softmax of the raw logits, no temperature),
    which is what importance ratios in training are computed against.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str  # "stop" | "length"
    top_logprobs: list[dict[int, float]] | None = None
    policy_version: int = 0


@dataclass
class StreamChunk:
    """Tokens appended to one continuation since the previous chunk (``n == 1`` streams)."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None  # set on the last chunk
    top_logprobs: list[dict[int, float]] | None = None


class InferenceBackend(ABC):
    """An inference engine serving one model, token ids in and token ids out.

    Built by the server as ``cls(config=backend_cfg, model=model_cfg)`` where
    both are plain dicts of the ``backend`` and ``model`` config groups.
    Requests from many episodes arrive concurrently; a backend batches them.
    """

    #: policy version (optimizer step) of the weights now being served
    policy_version: int = 0

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

        Either ``named_tensors`` (full weights or, for LoRA, the merged weights)
        or ``path`` (a folder with safetensors / a peft adapter).
        """

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Free the engine."""


# --------------------------------------------------------------------------- match
@runtime_checkable
class MatchStrategy(Protocol):
    """Decides whether two timeline blocks are the same for merging.

    ``key(block)`` returns a hashable value; two blocks match exactly when
    their keys are equal. Keys let the fast merge hash block prefixes.
    """

    def key(self, block: Block) -> Hashable: ...


# --------------------------------------------------------------------------- batching
@dataclass
class PoolEpisode:
    """What a batching policy sees of one accepted training episode."""

    episode_id: str
    task_id: str
    reward: float
    client_id: str = ""
    task_family: str = ""
    policy_version: int = 0
    accepted_at: float = 0.0


@dataclass
class ClientState:
    """What a batching policy sees of one client."""

    client_id: str
    last_seen: float
    ready: bool = False


@dataclass
class Decision:
    """A policy's verdict on the pool.

    ``fill`` is progress towards the trigger (``current``/``target`` in the
    policy's own unit, e.g. complete tasks) for the status API.
    ``selected`` are the episode ids that form the batch when ``fire`` is true.
    """

    fire: bool
    current: float
    target: float
    unit: str
    selected: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


class BatchingPolicy(ABC):
    """Decides when the pool trains and which episodes form the batch.

    Built as ``cls(**config)`` from the ``batching`` config group (at least
    ``batch_size`` B and ``rollouts_per_task`` N).
    """

    def __init__(self, batch_size: int, rollouts_per_task: int, **options: Any):
        self.batch_size = batch_size
        self.rollouts_per_task = rollouts_per_task
        self.options = options

    @abstractmethod
    def decide(
        self, episodes: Sequence[PoolEpisode], clients: Mapping[str, ClientState], now: float
    ) -> Decision:
        """Look at the untrained episodes (oldest first) and the active clients."""


# --------------------------------------------------------------------------- algo / optim
class Algorithm(ABC):
    """An RL algorithm: advantages from rewards, and the loss of a micro-batch.

    Built as ``cls(**config)`` from the ``algo`` config group.
    """

    @abstractmethod
    def advantages(self, batch: Any) -> Any:
        """Per-token advantages for a training batch (see the trainer)."""

    @abstractmethod
    def loss(self, **tensors: Any) -> tuple[Any, dict[str, float]]:
        """Loss of a micro-batch and its scalar metrics."""


class OptimEngine(ABC):
    """Owns the trainable model, its optimizer and the distributed set-up."""

    @abstractmethod
    def train_step(self, batch: Any) -> dict[str, float]:
        """One optimizer step over ``batch``; returns metrics."""

    @abstractmethod
    def export_weights(self) -> Iterable[tuple[str, Any]]:
        """Full named tensors for the inference engine (gathered on rank 0)."""

    @abstractmethod
    def save_checkpoint(self, path: str) -> None: ...

    @abstractmethod
    def load_checkpoint(self, path: str) -> None: ...
