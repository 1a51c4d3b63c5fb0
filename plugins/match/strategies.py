"""The built-in match strategies: keys on a block's text or its token ids."""

from __future__ import annotations

from collections.abc import Hashable


class TextMatch:
    """Two blocks match when their texts are equal."""

    name = "text"

    def key(self, block) -> Hashable:
        return block.text


class TokenMatch:
    """Two blocks match when their token-id sequences are equal."""

    name = "token"

    def key(self, block) -> Hashable:
        return tuple(block.token_ids)


TEXT = TextMatch()
TOKEN = TokenMatch()
