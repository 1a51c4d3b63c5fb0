"""Reasoning (``<think>…</think>``) split from a thinking model's reply.

Thinking models (Qwen3, DeepSeek-R1, QwQ…) write their reasoning first, between
``<think>`` and ``</think>``, then the answer. The server answers the two apart
(``reasoning_content`` in Chat, ``thinking`` blocks in Messages, ``reasoning``
items in Responses) while the timeline keeps every generated token. A reply is
reasoning only when it *starts* with ``<think>`` (after whitespace), or when the
generation prompt already opened one (``started``: templates that end the
generation prompt with ``<think>``), so a model that never thinks is untouched.

:func:`split_reasoning` splits a whole reply; :class:`ReasoningStreamSplitter`
does the same for streamed text and gives the same result for any chunking.
"""

from __future__ import annotations

__all__ = ["THINK_CLOSE", "THINK_OPEN", "ReasoningStreamSplitter", "opens_reasoning", "split_reasoning"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def opens_reasoning(generation_prompt: str) -> bool:
    """Whether a generation prompt leaves the model inside ``<think>`` (the reply starts as reasoning)."""
    tail = generation_prompt.rstrip()
    return tail.endswith(THINK_OPEN)


def split_reasoning(text: str, *, started: bool = False) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a reply; ``(None, text)`` when it does not reason.

    The reasoning loses the newlines just inside its tags, the answer its leading
    newlines (``<think>\\nR\\n</think>\\n\\nA`` → ``("R", "A")``); a reply cut before
    ``</think>`` is all reasoning.
    """
    if not started:
        stripped = text.lstrip()
        if not stripped.startswith(THINK_OPEN):
            return None, text
        text = stripped[len(THINK_OPEN):]
    end = text.find(THINK_CLOSE)
    if end < 0:
        return text.strip("\n"), ""
    return text[:end].strip("\n"), text[end + len(THINK_CLOSE):].lstrip("\n")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStreamSplitter:
    """:func:`split_reasoning` for streamed text.

    ``feed(delta)`` returns ``(reasoning, answer)`` text that is safe to send now;
    ``finish()`` the rest. Joined, the pieces equal :func:`split_reasoning` of the
    whole text (``None`` reasoning becomes ``""``); :attr:`reasoned` says whether
    the reply reasoned at all.
    """

    def __init__(self, *, started: bool = False):
        self._state = "reasoning" if started else "start"
        self._buf = ""
        self._answer_begun = False  # leading newlines of the answer are dropped until this
        self._reasoning_begun = False
        self.reasoned = started

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning: list[str] = []
        answer: list[str] = []
        while True:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buf = stripped[len(THINK_OPEN):]
                    self._state, self.reasoned = "reasoning", True
                    continue
                if THINK_OPEN.startswith(stripped):  # still undecided (whitespace or a partial tag)
                    break
                self._state = "plain"
                continue
            if self._state == "plain":
                answer.append(self._buf)
                self._buf = ""
                break
            if self._state == "reasoning":
                end = self._buf.find(THINK_CLOSE)
                if end >= 0:
                    reasoning.append(self._reasoning_piece(self._buf[:end].rstrip("\n")))
                    self._buf = self._buf[end + len(THINK_CLOSE):]
                    self._state = "answer"
                    continue
                # hold back a partial closing tag and trailing newlines (they may precede it)
                keep = _partial_suffix(self._buf, THINK_CLOSE)
                body = self._buf[: len(self._buf) - keep]
                safe = body.rstrip("\n")
                reasoning.append(self._reasoning_piece(safe))
                self._buf = self._buf[len(safe):]
                break
            # answer
            if not self._answer_begun:
                self._buf = self._buf.lstrip("\n")
                if not self._buf:
                    break
                self._answer_begun = True
            answer.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(answer)

    def _reasoning_piece(self, text: str) -> str:
        if not self._reasoning_begun:
            text = text.lstrip("\n")
            if not text:
                return ""
            self._reasoning_begun = True
        return text

    def finish(self) -> tuple[str, str]:
        """The held-back text: ``(reasoning, answer)``."""
        rest, self._buf = self._buf, ""
        if self._state in ("start", "plain"):
            return "", rest
        if self._state == "reasoning":  # cut before </think>: all reasoning
            return self._reasoning_piece(rest.rstrip("\n")), ""
        if not self._answer_begun:
            rest = rest.lstrip("\n")
        return "", rest
