"""The match-strategy contract: when two timeline blocks count as the same for merging."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol, runtime_checkable


class MatchedBlock(Protocol):
    """What a strategy may read of a block (:class:`swarmkit.timelines.Block`)."""

    author: str
    text: str
    token_ids: list[int]


@runtime_checkable
class MatchStrategy(Protocol):
    """Decides whether two timeline blocks are the same for merging.

    ``key(block)`` returns a hashable value; two blocks match exactly when
    their keys are equal. Keys let the fast merge hash block prefixes.

    ``stable_keys`` declares that absorbing a generated block never changes
    a block's key (the updated block keeps its text and takes token ids equal
    to the ones it matched on). The merge then skips re-checking keys after
    every update. A strategy whose key reads the author, the logprobs or
    anything absorption rewrites must leave it ``False``.

    ``key_field`` names the block attribute the key is made of (``"text"``, or
    ``"token_ids"`` with the key ``tuple(block.token_ids)``), or is ``None``.
    When set, the merge compares that attribute directly instead of calling
    :meth:`key` (the built-in strategies' fast path).
    """

    stable_keys: bool
    key_field: str | None

    def key(self, block: MatchedBlock) -> Hashable: ...
