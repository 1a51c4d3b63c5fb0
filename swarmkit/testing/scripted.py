"""A zero-compute inference backend for tests and the proxy benchmark.

:class:`ScriptedBackend` answers from a script instead of a model: each call
takes the next reply text from ``replies`` (cycling), or a function of the
prompt ids; it tokenizes it with the real tokenizer and gives every token the
logprob ``-0.5`` (also when it scores a prompt: ``echo``). It honours ``max_tokens``, ``n`` and ``stop`` strings, and
streams token by token, so every path of the proxy can run without torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from swarmkit.contract import (
    GenerationOutput,
    InferenceBackend,
    PromptScores,
    SamplingParams,
    StreamChunk,
    decode_generated,
)

LOGPROB = -0.5


class ScriptedBackend(InferenceBackend):
    """Replies from a script; no model. Scores every prompt token ``-0.5`` (``echo``).

    :param tokenizer: a Hugging Face tokenizer (default: the built-in tiny one).
    :param replies: reply texts used in turn, or ``prompt_ids -> text``.
    :param delay_s: seconds each call (and each streamed token) waits.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        replies: Sequence[str] | Callable[[Sequence[int]], str] = ("Hello from the script.",),
        delay_s: float = 0.0,
        config: dict[str, Any] | None = None,
        model: dict[str, Any] | None = None,
    ):
        self._tokenizer = tokenizer
        self.replies = replies
        self.delay_s = delay_s
        self.calls = 0
        self.prompts: list[list[int]] = []
        self.policy_version = 0
        self.max_context = (model or {}).get("max_context")
        self._reply_cache: dict[str, list[int]] = {}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from swarmkit.models import build_tiny_tokenizer

            self._tokenizer = build_tiny_tokenizer()
        return self._tokenizer

    async def start(self) -> None:
        _ = self.tokenizer

    def _reply(self, prompt_ids: Sequence[int], k: int) -> str:
        if callable(self.replies):
            return self.replies(prompt_ids)
        return self.replies[(self.calls + k) % len(self.replies)]

    def _ids(self, text: str) -> list[int]:
        ids = self._reply_cache.get(text)
        if ids is None:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._reply_cache[text] = ids
        return ids

    def _sample(self, prompt_ids: Sequence[int], params: SamplingParams, k: int) -> GenerationOutput:
        text = self._reply(prompt_ids, k)
        ids = self._ids(text)
        finish = "stop"
        hit = False
        for s in params.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
                ids = self._ids(text) + self._ids(s)
                hit = True
        if len(ids) > params.max_tokens:
            ids = ids[: params.max_tokens]
            text = self.tokenizer.decode(ids)
            finish = "length"
        eos = self.tokenizer.eos_token_id
        if finish == "stop" and not hit and eos is not None:  # a stop string ends the turn before the EOS
            ids = ids + [eos]
        tops = None
        if params.top_logprobs:
            tops = [{t: LOGPROB} for t in ids]
        return GenerationOutput(token_ids=list(ids), logprobs=[LOGPROB] * len(ids), text=text,
                                finish_reason=finish, top_logprobs=tops, policy_version=self.policy_version)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.prompts.append(list(prompt_ids))
        outs = [self._sample(prompt_ids, params, k) for k in range(params.n)]
        self.calls += 1
        return outs

    scores_prompts = True

    async def score_prompt(self, prompt_ids: Sequence[int], top_logprobs: int = 0) -> PromptScores:
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        rest = [int(t) for t in prompt_ids[1:]]
        tops: list[dict[int, float] | None] | None = [None, *({t: LOGPROB} for t in rest)] if top_logprobs else None
        return PromptScores(logprobs=[None, *([LOGPROB] * len(rest))], top_logprobs=tops,
                            policy_version=self.policy_version)

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StreamChunk]:
        self.prompts.append(list(prompt_ids))
        out = self._sample(prompt_ids, params, 0)
        self.calls += 1
        sent = ""
        for k, tok in enumerate(out.token_ids):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            else:
                await asyncio.sleep(0)
            last = k == len(out.token_ids) - 1
            upto = decode_generated(self.tokenizer, out.token_ids[: k + 1], params)
            if not out.text.startswith(upto):
                upto = out.text if last else sent
            delta, sent = upto[len(sent):], upto
            if last and sent != out.text:
                delta += out.text[len(sent):]
            yield StreamChunk(token_ids=[tok], logprobs=[LOGPROB], text=delta,
                              finish_reason=out.finish_reason if last else None,
                              top_logprobs=[out.top_logprobs[k]] if out.top_logprobs else None)

    async def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | None = None, *, path: str | None = None, version: int
    ) -> None:
        self.policy_version = int(version)
