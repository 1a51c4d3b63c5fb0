"""The built-in match strategies: keys on a block's text or its token ids, or none (no merging)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any


class TextMatch:
    """Two blocks match when their texts are equal."""

    name = "text"
    stable_keys = True  # absorption keeps a block's text
    key_field = "text"

    def key(self, block: Any) -> Hashable:
        return block.text


class TokenMatch:
    """Two blocks match when their token-id sequences are equal."""

    name = "token"
    stable_keys = True  # absorption copies token ids equal to the ones matched on
    key_field = "token_ids"

    def key(self, block: Any) -> Hashable:
        return tuple(block.token_ids)


class NoMatch:
    """No two blocks match: merging keeps every call as its own sample (an ablation baseline)."""

    name = "none"
    stable_keys = False
    key_field = None

    def key(self, block: Any) -> Hashable:
        return object()  # a fresh object is equal to nothing else


TEXT = TextMatch()
TOKEN = TokenMatch()
NONE = NoMatch()
