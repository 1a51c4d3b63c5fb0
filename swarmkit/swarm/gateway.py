"""The inference gateway: the model a server serves, and everything a call needs of it.

One object owns the engine (an :class:`~swarmkit.contract.InferenceBackend`), the chat renderers
(one per set of template variables), the context tracker that records what was generated, the
per-token text of logprob answers, and the context limit. The server loads it at boot and unloads
it at stop; the turn pipeline (:mod:`swarmkit.server.turn`) and the protocols read it. Episode
bookkeeping (who may call, in-flight counts, the state machine) stays with the server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from swarmkit.chat_templates import resolve_chat_template
from swarmkit.config.schema import ModelConfig
from swarmkit.contract import GenerationOutput, InferenceBackend, PromptScores, SamplingParams
from swarmkit.errors import ApiError, busy
from swarmkit.timelines.render import ChatRenderer, TokenText
from swarmkit.timelines.track import ContextTracker

#: set by the HTTP layer for the request being served: awaits until its client disconnects. A call whose
#: client is gone stops generating (work for a request nobody will read is cancelled)
CALLER_GONE: ContextVar[Callable[[], Awaitable[None]] | None] = ContextVar("swarmkit_caller_gone", default=None)

#: renderers kept per server: the default one and the newest sets of template variables
MAX_RENDERERS = 9


async def unless_caller_gone(work: Awaitable[Any]) -> Any:
    """Await ``work``; cancel it and answer 499 when the caller disconnects first."""
    gone = CALLER_GONE.get()
    if gone is None:
        return await work
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ApiError(499, "the client closed the connection; the generation was cancelled", "client_closed")
    return task.result()


class InferenceGateway:
    """The served model: engine, renderers, tracker, per-token text, context limit.

    :param renderer_factory: ``tokenizer -> renderer`` (keyword ``chat_template`` and
        ``template_kwargs`` when given); default :class:`~swarmkit.timelines.render.ChatRenderer`.
    """

    def __init__(self, renderer_factory: Callable[..., Any] | None = None):
        self.renderer_factory = renderer_factory or ChatRenderer
        self.backend: InferenceBackend | None = None
        #: the renderer of the served template (the one without extra template variables)
        self.renderer: Any = None
        self._renderers: dict[tuple[tuple[str, Any], ...], Any] = {}
        self._make_renderer: Callable[[dict[str, Any]], Any] | None = None
        self.tracker: ContextTracker | None = None
        #: cached per-token strings for logprob answers
        self.token_text: TokenText | None = None
        self.max_context: int | None = None
        self.model_name = "swarmkit"
        self.adapters: list[str] = []
        #: the longest vocabulary token in characters (bounds the text a context can hold); computed once
        self._longest_token: int | None = None
        #: renders running in the render worker (swarmkit.server.turn): while any does, the others queue there
        self.renders_in_pool = 0

    # ------------------------------------------------------------------ life cycle
    def load(self, backend: InferenceBackend, model: ModelConfig) -> None:
        """Serve ``backend`` (started) for ``model``: build its renderers, tracker and token text."""
        factory = self.renderer_factory
        template = resolve_chat_template(model.chat_template, model.path)
        tok = backend.tokenizer

        def make(kwargs: dict[str, Any]) -> Any:
            extra: dict[str, Any] = {"template_kwargs": kwargs} if kwargs else {}
            return factory(tok, chat_template=template, **extra) if template else factory(tok, **extra)

        self.renderer = make({})
        self._renderers = {(): self.renderer}
        self._make_renderer = make
        self.token_text = TokenText(tok)
        self.tracker = ContextTracker(self.renderer)
        self.model_name = model.name or "swarmkit"
        #: the LoRA adapters the engine serves over the base (model.adapters); [] = one model
        self.adapters = [s.name for s in model.adapter_specs()] if backend.serves_adapters else []
        self.max_context = backend.max_context or model.max_context
        self._longest_token = None  # this tokenizer's
        self.backend = backend

    def unload(self) -> InferenceBackend | None:
        """Stop serving; returns the engine for the caller to close."""
        backend, self.backend = self.backend, None
        return backend

    # ------------------------------------------------------------------ reading
    @property
    def tokenizer(self) -> Any:
        if self.backend is None:
            raise busy("no model is loaded (server is OFFLINE); configure and start it", 2.0, "server_offline")
        return self.backend.tokenizer

    def renderer_for(self, template_kwargs: dict[str, Any] | None) -> Any:
        """The renderer of the served template with these extra template variables (built once per
        set; the newest ones are kept)."""
        key = tuple(sorted((template_kwargs or {}).items()))
        found = self._renderers.get(key)
        if found is None:
            if self._make_renderer is None:
                return self.renderer
            found = self._renderers[key] = self._make_renderer(dict(key))
            while len(self._renderers) > MAX_RENDERERS:
                oldest = next(k for k in self._renderers if k != ())
                self._renderers.pop(oldest)
        return found

    def room_for(self, prompt_len: int) -> int:
        """Tokens left for generation after a prompt; 400 if none."""
        limit = self.max_context
        if not limit:
            return 1 << 20
        room = limit - prompt_len
        if room <= 0:
            raise ApiError(400, f"this prompt has {prompt_len} tokens; the model's context is {limit} tokens "
                           "(model.max_context)", "context_length_exceeded", param="messages")
        return room

    def max_prompt_chars(self) -> int | None:
        """The most characters a prompt that fits the context can hold: context x the longest token
        (in characters) of the vocabulary (None: no context limit)."""
        if not self.max_context:
            return None
        if self._longest_token is None:
            try:
                self._longest_token = max((len(t) for t in self.tokenizer.get_vocab()), default=16)
            except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary listing: a generous guess
                self._longest_token = 64
        return int(self.max_context) * self._longest_token

    def policy_version(self, default: int) -> int:
        """The weights version the engine serves (``default`` without an engine or a version)."""
        if self.backend is None:
            return default
        return int(getattr(self.backend, "policy_version", default))

    def engine_stats(self) -> dict[str, float]:
        """The engine's counters (``busy_s``...); {} without an engine or counters."""
        if self.backend is None:
            return {}
        try:
            return {k: float(v) for k, v in self.backend.engine_stats().items()}
        except Exception:  # noqa: BLE001 - the status must always answer
            return {}

    # ------------------------------------------------------------------ calling
    @contextmanager
    def rendering(self) -> Iterator[None]:
        """Counts a render in the render worker while the block runs (the others queue behind it)."""
        self.renders_in_pool += 1
        try:
            yield
        finally:
            self.renders_in_pool -= 1

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        """Generate with the served engine; cancelled (499) when the caller disconnects, 400 for what the
        engine refuses."""
        backend = self.backend
        if backend is None:
            raise busy("the server stopped", 2.0, "server_offline")
        try:
            outputs: list[GenerationOutput] = await unless_caller_gone(backend.generate(prompt_ids, params))
        except ApiError:
            raise
        except ValueError as exc:
            raise ApiError(400, f"the backend refused this request: {exc}", "invalid_request") from None
        return outputs

    async def score_prompt(self, prompt_ids: list[int], top_logprobs: int = 0) -> PromptScores:
        """The prompt's own logprobs from the served engine (``echo``); 400 when the engine cannot score
        prompts or refuses this one, 499 when the caller disconnects."""
        backend = self.backend
        if backend is None:
            raise busy("the server stopped", 2.0, "server_offline")
        if not backend.scores_prompts:
            raise ApiError(400, f"'echo' needs prompt logprobs, which this server's engine "
                           f"({type(backend).__name__}) cannot compute (backend=hf and backend=vllm can)",
                           "unsupported_value", param="echo")
        try:
            scores: PromptScores = await unless_caller_gone(backend.score_prompt(prompt_ids, top_logprobs))
        except ApiError:
            raise
        except ValueError as exc:
            raise ApiError(400, f"the backend refused this request: {exc}", "invalid_request") from None
        return scores
