"""Tool calls in generated text → OpenAI ``tool_calls`` (Qwen / Hermes format).

The Qwen2.5/Qwen3, Hermes and SmolLM families (and the built-in tiny model's
chat template) write a call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
:class:`ToolCallStreamParser` lifts every call out of streamed text: text around
it stays the message content, a malformed call is left in the content untouched,
and content is released as soon as it cannot be part of a tool call.
:func:`parse_tool_calls` runs the very same parser over a whole text, so a
streamed answer and a non-streamed one are equal by construction:

- ``arguments`` are the model's JSON text verbatim (its spacing and key order),
  never re-serialised: what the client gets, and sends back, is what the model
  produced, so the turn replays token for token and a streamed call (sent as
  generated) equals a non-streamed one;
- whitespace next to a call is not content: a stretch of only whitespace before,
  between or after calls is dropped, as is the whitespace that ends the text
  before a call, that starts the content after a call (when no content came
  before it) and that ends the content of a reply with calls. So
  ``<tool_call>..</tool_call>\n<tool_call>..</tool_call>`` has ``content: null``,
  streamed or not.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_KEY_RE = re.compile(r'"(arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def _verbatim(payload: str, key: str, value: Any) -> str | None:
    """The text of ``key``'s ``value`` in the JSON object ``payload`` as the model wrote it (None: not found)."""
    for m in _KEY_RE.finditer(payload):
        if m.group(1) != key:
            continue
        try:
            found, end = _DECODER.raw_decode(payload, m.end())
        except ValueError:
            continue
        if found == value:  # a nested key of that name cannot hold the whole value: this is the top-level one
            return payload[m.end():end]
    return None


def _to_call(payload: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = "arguments" if "arguments" in obj else "parameters"
    args = obj.get(key, {})
    if not isinstance(args, str):  # a JSON-string value is the arguments text itself
        args = (_verbatim(payload, key, args) if key in obj else None) or json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated ``text`` into (content, tool_calls): :class:`ToolCallStreamParser` fed the whole text.

    ``content`` is ``None`` when nothing but tool calls (and whitespace) was generated (the
    OpenAI convention); without any tool call it is ``text`` unchanged.
    """
    if OPEN not in text:
        return text, []
    content, calls, _ = parse_tool_parts(text)
    return (content if calls else text), calls


def parse_tool_parts(text: str) -> tuple[str | None, list[dict[str, Any]], list[str | dict[str, Any]]]:
    """:func:`parse_tool_calls` plus the reply's parts in the order generated (content text and calls:
    the blocks of protocols that interleave them, Anthropic Messages and OpenAI Responses)."""
    parser = ToolCallStreamParser()
    content = parser.feed(text)
    rest, calls = parser.finish()
    content += rest
    return (content or None) if calls else content, calls, parser.parts


_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


class ToolCallStreamParser:
    """The tool-call parser of generated text, fed as it is generated (:func:`parse_tool_calls` feeds it
    a whole text at once).

    ``feed(delta)`` returns the content that is safe to send now (text that is
    not, and cannot become, part of a ``<tool_call>``, nor whitespace that may
    turn out to sit next to a call: held until text follows); ``finish()``
    returns the remaining content and every tool call found.

    A call written as ``{"name": "f", "arguments": {...}}`` is also streamed as it
    is generated: once its name is known :attr:`events` gets ``("start", k, id,
    name)``, then ``("args", k, text)`` pieces whose concatenation is the call's
    ``arguments`` (the raw generated JSON, without the object's closing brace).
    Once announced it stays a call, whatever follows. A call in another shape is
    held until it closes, as a whole. :meth:`take_events` drains the events;
    :attr:`streamed` holds the ids of the calls announced; :attr:`parts` the content
    released and the calls, in the order generated.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self.calls: list[dict[str, Any]] = []
        self.events: list[tuple[Any, ...]] = []
        self.streamed: set[str] = set()
        self.parts: list[str | dict[str, Any]] = []
        self._live: dict[str, Any] | None = None  # the call being streamed: id, name, head end, args sent
        self._ws = ""  # whitespace of the content held back (it may sit right before a call)
        self._sent = False  # some content was released

    @property
    def in_call(self) -> bool:
        """Inside an opened ``<tool_call>`` that has not closed yet."""
        return self._in_call

    def take_events(self) -> list[tuple[Any, ...]]:
        out, self.events = self.events, []
        return out

    def _content(self, text: str) -> str:
        """What of the content ``text`` goes out now: its trailing whitespace is held (dropped if a call
        follows); the leading whitespace of the first content after a call is dropped."""
        if not text:
            return ""
        text = self._ws + text
        body = text.rstrip()
        self._ws = text[len(body):]
        if body and not self._sent and self.calls:
            body = body.lstrip()
        if body:
            self._sent = True
            if self.parts and isinstance(self.parts[-1], str):
                self.parts[-1] += body
            else:
                self.parts.append(body)
        return body

    def _add_call(self, call: dict[str, Any]) -> None:
        self.calls.append(call)
        self.parts.append(call)

    def _stream_args(self, body: str) -> None:
        """Announce the open call (its text after ``<tool_call>`` so far: ``body``) once its name is
        known and send the argument text that cannot be the call's closing brace (held from the last
        ``}`` on). Whether a call is announced depends on its text only, never on how it was cut into
        deltas: a whole text parses as its deltas do."""
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
            self._ws = ""  # a call for sure: the whitespace before it is not content
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

    def _whole_call(self, payload: str) -> bool:
        """Take a call held whole (False: ``payload`` is not a call)."""
        call = _to_call(payload)
        if call is None:
            return False
        self._ws = ""
        self._add_call(call)
        return True

    def feed(self, delta: str) -> str:
        self._buf += delta
        out: list[str] = []
        while self._buf:
            if self._in_call:
                end = self._buf.find(CLOSE)
                if end < 0:
                    self._stream_args(self._buf[len(OPEN):])
                    return "".join(out)
                raw = self._buf[: end + len(CLOSE)]
                self._buf = self._buf[end + len(CLOSE) :]
                self._in_call = False
                if self._live is None:
                    self._stream_args(raw[len(OPEN) : -len(CLOSE)])
                if self._live is not None:  # announced: it stays a call whatever follows
                    self._add_call(self._close_live(raw[len(OPEN) : -len(CLOSE)]))
                elif not self._whole_call(raw[len(OPEN) : -len(CLOSE)]):
                    out.append(self._content(raw))  # malformed: it is content after all
                continue
            start = self._buf.find(OPEN)
            if start >= 0:
                out.append(self._content(self._buf[:start]))
                self._buf = self._buf[start:]
                self._in_call = True
                continue
            # hold back a suffix that could be the beginning of OPEN
            keep = 0
            for k in range(min(len(OPEN) - 1, len(self._buf)), 0, -1):
                if self._buf.endswith(OPEN[:k]):
                    keep = k
                    break
            out.append(self._content(self._buf[: len(self._buf) - keep]))
            self._buf = self._buf[len(self._buf) - keep :]
            break
        return "".join(out)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content still held (the whitespace that ends a reply with calls is dropped) and every call."""
        rest = self._buf
        self._buf = ""
        if self._in_call:
            if self._live is None:
                self._stream_args(rest[len(OPEN) :])
            if self._live is not None:  # cut before </tool_call>: the announced call ends here
                self._add_call(self._close_live(rest[len(OPEN) :]))
                rest = ""
            elif self._whole_call(rest[len(OPEN) :]):
                rest = ""
        self._in_call = False
        out = self._content(rest)
        if not self.calls and self._ws:  # no call: the text as generated, its whitespace included
            out += self._ws
            if self.parts and isinstance(self.parts[-1], str):
                self.parts[-1] += self._ws
            else:
                self.parts.append(self._ws)
        self._ws = ""
        return out, self.calls
