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


_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ToolCallStreamParser:
    """Incremental :func:`parse_tool_calls` for streamed text.

    ``feed(delta)`` returns the content that is safe to send now (text that is
    not, and cannot become, part of a ``<tool_call>``); ``finish()`` returns the
    remaining content and every tool call found.

    A call written as ``{"name": "f", "arguments": {...}}`` is also streamed as it
    is generated: once its name is known :attr:`events` gets ``("start", k, id,
    name)``, then ``("args", k, text)`` pieces whose concatenation is the call's
    ``arguments`` (the raw generated JSON, without the object's closing brace).
    A call in another shape is held until it closes, as a whole. :meth:`take_events`
    drains the events; :attr:`streamed` holds the ids of the calls announced.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls: list[dict[str, Any]] = []
        self.events: list[tuple[Any, ...]] = []
        self.streamed: set[str] = set()
        self._live: dict[str, Any] | None = None  # the call being streamed: id, name, head end, args sent

    @property
    def in_call(self) -> bool:
        """Inside an opened ``<tool_call>`` that has not closed yet."""
        return self._in_call

    def take_events(self) -> list[tuple[Any, ...]]:
        out, self.events = self.events, []
        return out

    def _stream_args(self) -> None:
        """Announce the open call once its name is known and send the argument text that cannot be
        the call's closing brace (held from the last ``}`` on)."""
        body = self._buf[len(OPEN):]
        live = self._live
        if live is None:
            m = _HEAD_RE.match(body)
            if m is None or len(body) <= m.end() or body[m.end()] != "{":
                return  # name not known yet, or arguments that are not an object: held whole
            try:
                name = json.loads(m.group(1))
            except ValueError:
                return
            live = self._live = {"id": new_call_id(), "name": name, "head": m.end(), "sent": ""}
            self.events.append(("start", len(self.calls), live["id"], name))
            self.streamed.add(live["id"])
        unsent = body[live["head"] + len(live["sent"]):]
        cut = unsent.rfind("}")
        safe = unsent[:cut] if cut >= 0 else unsent
        for k in range(min(len(CLOSE) - 1, len(safe)), 0, -1):  # never send what could begin </tool_call>
            if safe.endswith(CLOSE[:k]):
                safe = safe[:-k]
                break
        if safe:
            live["sent"] += safe
            self.events.append(("args", len(self.calls), safe))

    def _close_live(self, raw_body: str) -> dict[str, Any]:
        """The streamed call, complete: the rest of its arguments sent, its dict built."""
        live = self._live
        assert live is not None
        self._live = None
        rest = raw_body[live["head"] + len(live["sent"]):].rstrip()
        if rest.endswith("}"):
            rest = rest[:-1].rstrip()
        if rest:
            live["sent"] += rest
            self.events.append(("args", len(self.calls), rest))
        return {"id": live["id"], "type": "function", "function": {"name": live["name"], "arguments": live["sent"]}}

    def feed(self, delta: str) -> str:
        self._buf += delta
        out: list[str] = []
        while self._buf:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    self._stream_args()
                    return "".join(out)
                raw = self._buf[: end + len(CLOSE)]
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call = False
                if self._live is not None:  # announced: it stays a call whatever follows
                    self.calls.append(self._close_live(raw[len(OPEN) : -len(CLOSE)]))
                    continue
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
            if self._live is not None:  # cut before </tool_call>: the announced call ends here
                self.calls.append(self._close_live(rest[len(OPEN) :]))
                rest = ""
            else:
                call = _to_call(rest[len(OPEN) :])
                if call is not None:
                    self.calls.append(call)
                    rest = ""
        self._in_call = False
        return rest, self.calls
