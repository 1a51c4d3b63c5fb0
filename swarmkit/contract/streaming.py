"""Stop-string and streaming-text rules shared by the inference backends.

Every backend (``hf``, ``vllm``, ``sglang``) decodes the generated ids into text
itself and applies the same contract (see ``plugins/backend_hf/engine.py``):

- ``text`` is cut before the first occurrence of the *earliest* stop string
  (empty stop strings are ignored);
- while streaming, text is held back as long as it could still turn out to be
  the start of a stop string, or ends in U+FFFD (the replacement character a
  tokenizer produces for a UTF-8 sequence whose remaining bytes are in tokens
  not generated yet). That way the chunks' texts concatenate exactly to the
  final text, and no chunk ever shows a stop string or a half-decoded character.

This module holds those rules once, as pure functions and one small class. It
uses only the standard library: ``swarmkit.client`` must stay free of torch and
other heavy imports.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"

# A split UTF-8 character can decode to up to 3 replacement chars (one per byte
# seen so far) that collapse into a single char once the rest arrives.
_MAX_PENDING_UTF8 = 3


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int | None:
    """Index of the earliest occurrence of any non-empty stop string in ``text[start:]``.

    Returns ``None`` when there is none. Empty stop strings never match (they
    would otherwise cut every text to nothing).
    """
    hits = [i for i in (text.find(s, start) for s in stops if s) if i >= 0]
    return min(hits) if hits else None


def cut_at_stop(text: str, stops: Sequence[str], *, checked: int = 0) -> tuple[str, bool]:
    """Cut ``text`` before its earliest stop string; return ``(text, hit)``.

    ``checked`` supports the incremental scan of a stream re-decoded after each
    token: it is the length of an earlier decode of the same stream that had no
    stop string. The scan then starts that far back minus the longest stop
    string and the few replacement chars of a split UTF-8 character, so it still
    finds a stop string that straddles the old end or that appears only once
    such trailing replacement chars resolve, without rescanning the whole text.
    With the default ``checked=0`` the whole text is scanned.
    """
    if not stops:
        return text, False
    longest = max((len(s) for s in stops), default=0)
    start = max(0, checked - longest - _MAX_PENDING_UTF8)
    cut = find_stop(text, stops, start)
    if cut is None:
        return text, False
    return text[:cut], True


class StreamTextBuffer:
    """How much of a growing decoded text a stream may emit, chunk by chunk.

    The caller re-decodes the whole output after each step and passes the full
    text to :meth:`push`, which returns the new part that is safe to show now:
    trailing replacement chars (an incomplete UTF-8 character) are held back,
    and so are the last ``max(len(stop)) - 1`` chars, which could be the start
    of a stop string completed by a later token. The hold is deliberately
    unconditional (it does not check whether the tail actually matches a stop
    prefix), so chunk boundaries depend only on the text length and the stops.
    When the sequence ends, :meth:`finish` gets the final text (already cut at
    its stop string) and returns everything not sent yet.

    ``sent`` is the number of chars emitted so far; it never decreases.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.hold = max(0, max((len(s) for s in stops), default=1) - 1)
        self.sent = 0

    def push(self, text: str) -> str:
        """The part of ``text`` (the full text so far) that can be emitted now; marks it sent."""
        end = len(text)
        while end > self.sent and text[end - 1] == REPLACEMENT_CHAR:
            end -= 1
        end = max(self.sent, end - self.hold)
        delta = text[self.sent:end]
        self.sent = end
        return delta

    def finish(self, text: str) -> str:
        """Everything of the final ``text`` not emitted yet (nothing is held back any more)."""
        delta = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return delta
