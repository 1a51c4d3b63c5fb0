"""Timelines: what one intercepted LLM call produced, as ordered message blocks.

A *timeline* is the prompt of one proxied call, split into message blocks,
followed by the completion block. Authors of a block:

``"llm"``       tokens the model generated in this call (the only trainable author).
``"user"``      system / user messages.
``"env"``       tool results (environment observations).
``"history"``   an assistant message re-rendered inside a later prompt; not
                trainable by itself, but turns ``"llm"`` when the timeline of the
                call that generated it is absorbed (it then carries the tokens and
                logprobs the model really produced).
``"template"``  chat-template glue (role headers, generation prompt, trailing newlines).

Only ``"llm"`` blocks may have a non-zero loss mask. :class:`Timeline` is a
small class with a ``.blocks`` list plus ``role`` and ``meta``; the merge
also accepts a plain ``list[Block]`` wherever a timeline is expected.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["AUTHORS", "Block", "Timeline", "TimelineLike"]

#: every allowed block author; only ``"llm"`` is trainable
AUTHORS: tuple[str, ...] = ("llm", "env", "user", "history", "template")
_AUTHOR_SET = frozenset(AUTHORS)


@dataclass
class Block:
    """One message-level piece of a timeline.

    :param author: one of :data:`AUTHORS`.
    :param text: the block's text; what the ``text`` match strategy compares.
        For prompt blocks it is the rendered text (for an assistant history block:
        the text the model generated, see :mod:`swarmkit.timelines.render`); for ``llm``
        blocks the decoded completion.
    :param token_ids: ``[T]`` token ids.
    :param logprobs: ``[T]`` log p of each token under the sampling policy
        (0.0 for prompt tokens). Default: zeros.
    :param loss_mask: ``[T]`` of 0/1, 1 only on trainable (``llm``) tokens.
        Default: ones for ``llm`` blocks, zeros otherwise.
    :param versions: ``[T]`` the policy version that sampled each token of a
        generated block (a partial rollout spans a weight swap: two versions in
        one block); None where unknown (prompt blocks, demonstrations, records
        written before versions were kept: the episode's ``policy_version`` then).
    :raises ValueError: unknown author, lengths that differ, a mask value other
        than 0/1, or a non-zero mask on a non-``llm`` block.
    """

    author: str
    text: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    loss_mask: list[int] | None = None
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        if self.author not in _AUTHOR_SET:
            raise ValueError(f"unknown block author {self.author!r}; expected one of {AUTHORS}")
        if not isinstance(self.text, str):
            raise ValueError(f"block text must be a str, got {type(self.text).__name__}")
        if type(self.token_ids) is not list:
            self.token_ids = list(self.token_ids)
        n = len(self.token_ids)
        if self.logprobs is None:
            self.logprobs = [0.0] * n
        elif type(self.logprobs) is not list:
            self.logprobs = list(self.logprobs)
        if self.loss_mask is None:
            self.loss_mask = [1 if self.author == "llm" else 0] * n
        elif type(self.loss_mask) is not list:
            self.loss_mask = list(self.loss_mask)
        if self.versions is not None and type(self.versions) is not list:
            self.versions = list(self.versions)
        if len(self.logprobs) != n or len(self.loss_mask) != n or (self.versions is not None and len(self.versions) != n):
            raise ValueError(
                f"block lengths differ: {n} token ids, {len(self.logprobs)} logprobs, "
                f"{len(self.loss_mask)} loss-mask entries"
                + (f", {len(self.versions)} versions" if self.versions is not None else "")
            )
        if n:
            if not set(self.loss_mask) <= {0, 1}:
                raise ValueError("loss_mask entries must be 0 or 1")
            if self.author != "llm" and any(self.loss_mask):
                raise ValueError(f"only 'llm' blocks may have a non-zero loss mask (author {self.author!r})")

    @classmethod
    def prompt(cls, author: str, text: str, token_ids: list[int]) -> Block:
        """A prompt block (logprobs 0.0, loss mask 0) built without the checks: for the renderer,
        which makes thousands per second from ids it owns (``token_ids`` is taken, not copied)."""
        if author not in _AUTHOR_SET or author == "llm":
            raise ValueError(f"a prompt block's author is one of {AUTHORS[1:]}, got {author!r}")
        block = cls.__new__(cls)
        n = len(token_ids)
        block.author, block.text, block.token_ids = author, text, token_ids
        block.logprobs, block.loss_mask, block.versions = [0.0] * n, [0] * n, None
        return block

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def trainable(self) -> bool:
        """True for ``llm`` blocks."""
        return self.author == "llm"

    def copy(self) -> Block:
        """A copy with its own lists."""
        return Block(self.author, self.text, list(self.token_ids), list(self.logprobs), list(self.loss_mask),
                     None if self.versions is None else list(self.versions))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (lists of ints / floats); ``versions`` only when known."""
        out: dict[str, Any] = {
            "author": self.author,
            "text": self.text,
            "token_ids": list(self.token_ids),
            "logprobs": [float(x) for x in self.logprobs],
            "loss_mask": list(self.loss_mask),
        }
        if self.versions is not None:
            out["versions"] = list(self.versions)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Block:
        """Inverse of :meth:`to_dict`."""
        return cls(
            author=data["author"],
            text=data["text"],
            token_ids=[int(x) for x in data["token_ids"]],
            logprobs=[float(x) for x in data.get("logprobs") or [0.0] * len(data["token_ids"])],
            loss_mask=None if data.get("loss_mask") is None else [int(x) for x in data["loss_mask"]],
            versions=None if data.get("versions") is None else [int(x) for x in data["versions"]],
        )


class Timeline:
    """An ordered list of blocks from one LLM call.

    :param blocks: the blocks, prompt first, completion last.
    :param role: optional label of the calling agent (swarm role), e.g. ``"planner"``.
    :param meta: free JSON-safe metadata (episode id, call index, policy version ...).
    """

    __slots__ = ("blocks", "role", "meta")

    def __init__(self, blocks: Sequence[Block] | None = None, role: str | None = None,
                 meta: dict[str, Any] | None = None):
        self.blocks: list[Block] = list(blocks or [])
        self.role: str | None = role
        self.meta: dict[str, Any] = dict(meta or {})

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks)

    def __getitem__(self, k: int) -> Block:
        return self.blocks[k]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Timeline):
            return NotImplemented
        return self.blocks == other.blocks and self.role == other.role and self.meta == other.meta

    def __repr__(self) -> str:
        return f"Timeline(blocks={len(self.blocks)}, tokens={self.num_tokens()}, role={self.role!r})"

    def token_ids(self) -> list[int]:
        """``[T_total]`` all token ids, blocks concatenated."""
        return [t for b in self.blocks for t in b.token_ids]

    def logprobs(self) -> list[float]:
        """``[T_total]`` per-token logprobs, blocks concatenated."""
        return [x for b in self.blocks for x in b.logprobs]

    def loss_mask(self) -> list[int]:
        """``[T_total]`` per-token loss mask, blocks concatenated."""
        return [x for b in self.blocks for x in b.loss_mask]

    def versions(self, default: int = 0) -> list[int]:
        """``[T_total]`` per-token policy versions; ``default`` where a block has none."""
        return [x for b in self.blocks for x in (b.versions if b.versions is not None else [default] * len(b))]

    def num_tokens(self) -> int:
        """Total number of tokens."""
        return sum(len(b.token_ids) for b in self.blocks)

    def num_trainable_tokens(self) -> int:
        """Number of tokens with loss mask 1."""
        return sum(sum(b.loss_mask) for b in self.blocks)

    def copy(self) -> Timeline:
        """A deep copy (own blocks and lists)."""
        return Timeline([b.copy() for b in self.blocks], self.role, dict(self.meta))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: ``{"blocks": [...], "role": ..., "meta": {...}}``."""
        return {"blocks": [b.to_dict() for b in self.blocks], "role": self.role, "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timeline:
        """Inverse of :meth:`to_dict`."""
        return cls([Block.from_dict(b) for b in data.get("blocks", [])], data.get("role"), data.get("meta"))


TimelineLike = Timeline | Sequence[Block]
