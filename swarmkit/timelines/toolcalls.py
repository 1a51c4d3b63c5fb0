"""Tool calls in generated text → OpenAI ``tool_calls`` (Qwen / Hermes format).

The Qwen2.5/Qwen3, Hermes and SmolLM families (and the built-in tiny model's
chat template) write a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
:func:`parse_tool_calls` lifts every well-formed call out of the text; text
around it stays the message content; a malformed call is left in the content
untouched. :class:`ToolCallStreamParser` does the same incrementally for SSE:
it releases content as soon as it cannot be the start of a tool call.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_CALL_RE = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _to_call(payload: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated ``text`` into (content, tool_calls).

    ``content`` is ``None`` when nothing but tool calls was generated (the
    OpenAI convention); without any well-formed call it is ``text`` unchanged.
    """
    if OPEN not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    pieces: list[str] = []
    pos = 0
    for m in _CALL_RE.finditer(text):
        call = _to_call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        pieces.append(text[pos : m.start()])
        pos = m.end()
    if not calls:
        return text, []
    pieces.append(text[pos:])
    content = "".join(pieces).strip()
    return (content or None), calls


class ToolCallStreamParser:
    """Incremental :func:`parse_tool_calls` for streamed text.

    ``feed(delta)`` returns the content that is safe to send now (text that is
    not, and cannot become, part of a ``<tool_call>``); ``finish()`` returns the
    remaining content and every tool call found.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._held: list[str] = []  # raw tool-call segments, open tag included
        self.calls: list[dict[str, Any]] = []

    @property
    def in_call(self) -> bool:
        """Inside an opened ``<tool_call>`` that has not closed yet."""
        return self._in_call

    def feed(self, delta: str) -> str:
        self._buf += delta
        out: list[str] = []
        while self._buf:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    return "".join(out)
                raw = self._buf[: end + len(CLOSE)]
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call = False
                call = _to_call(raw[len(OPEN) : -len(CLOSE)])
                if call is None:
                    out.append(raw)  # malformed: it is content after all
                else:
                    self.calls.append(call)
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                out.append(self._buf[:start])
                self._buf = self._buf[start:]
                self._in_call = True
                continue
            # hold back a suffix that could be the beginning of OPEN
            keep = 0
            for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1):
                if self._buf.endswith(OPEN[:k]):
                    keep = k
                    break
            out.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return "".join(out)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        rest = self._buf
        self._buf = ""
        if self._in_call:
            call = _to_call(rest[len(OPEN) :])
            if call is not None:
                self.calls.append(call)
                rest = ""
        self._in_call = False
        return rest, self.calls
