"""The context tracker: every model call of an episode becomes timelines.

One call with ``n`` choices yields ``n`` timelines, each the call's prompt
blocks (as the chat renderer split them: ``user``/``env`` blocks with loss
mask 0, earlier assistant turns as ``llm`` blocks re-tokenized by the
template) followed by one ``llm`` completion block holding the tokens the
model really generated, their logprobs, and loss mask 1. The role of the
call's key is kept on every timeline.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from swarmkit.contract.backend import GenerationOutput
from swarmkit.timelines.block import Block, Timeline


class Recording(Protocol):
    """What the tracker writes to: an episode's identity, call counter and timelines."""

    id: str
    task_id: str
    n_calls: int
    timelines: list[Timeline]


class ContextTracker:
    """Turns (prompt blocks, generated outputs) into timelines on an episode.

    :param renderer: the server's ``ChatRenderer`` (owns the tokenizer and
        its caches); used for completion blocks and raw prompt blocks.
    """

    def __init__(self, renderer: Any):
        self.renderer = renderer
        self.calls = 0
        self.tokens_generated = 0

    def prompt_block(self, text: str, token_ids: Sequence[int]) -> Block:
        """A raw-prompt block for ``/v1/completions`` (author ``user``, loss mask 0)."""
        ids = list(token_ids)
        return Block(author="user", text=text, token_ids=ids, logprobs=[0.0] * len(ids), loss_mask=[0] * len(ids))

    def record(
        self,
        episode: Recording,
        role: str | None,
        prompt_blocks: Sequence[Block],
        outputs: Sequence[GenerationOutput],
        *,
        endpoint: str,
        meta: dict[str, Any] | None = None,
        forced: Sequence[int] = (),
    ) -> list[Timeline]:
        """Append one timeline per output to ``episode.timelines``; returns them.

        ``forced``: tokens the server prefilled at the start of every choice's turn
        (kept in the completion block with loss mask 0, see ``completion_block``).
        """
        call_index = episode.n_calls
        episode.n_calls += 1
        self.calls += 1
        now = time.time()
        made = []
        for choice, out in enumerate(outputs):
            # forced tokens: the version the call started with; generated ones: the version that sampled each
            versions = [int(out.policy_version)] * len(forced) + out.versions()
            completion = self.renderer.completion_block(list(out.token_ids), list(out.logprobs), forced, versions)
            self.tokens_generated += len(out.token_ids)
            info = {
                "episode_id": episode.id,
                "task_id": episode.task_id,
                "call": call_index,
                "choice": choice,
                "endpoint": endpoint,
                "finish_reason": out.finish_reason,
                "policy_version": out.policy_version,
                "time": now,
            }
            if meta:
                info.update(meta)
            tl = Timeline(blocks=[*prompt_blocks, completion], role=role, meta=info)
            episode.timelines.append(tl)
            made.append(tl)
        return made
