"""Replay generated turns as generated.

An agent framework sends the model's earlier turns back as JSON: content plus
``tool_calls`` whose arguments it may have re-serialised (compact, spaced,
keys reordered) and which the chat template may re-encode (``arguments |
tojson`` on a string double-encodes it). Rendering that JSON gives tokens the
model never produced, so prefix merging breaks at every tool turn and the
model would be trained on a format it did not write.

:class:`TurnMemory` remembers, per episode, each assistant turn the server
generated: its raw text and token ids, its tool-call ids and its parsed
(content, calls). :meth:`TurnMemory.substitute` finds those turns in a later
request's history — by the tool-call ids the server issued, or else by equal
content and equal calls after normalising the JSON — and rewrites each into
``{"role": "assistant", "content": <raw generated text>}``; the renderer then
reuses the remembered token ids (``ChatRenderer.render_prompt(generated=...)``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["GeneratedTurn", "TurnMemory"]


def _canonical_args(arguments: Any) -> Any:
    """Arguments as a comparable value: JSON strings parsed, anything else as is."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments.strip()
    return arguments


def _canonical_calls(calls: Any) -> tuple[str, ...] | None:
    """Tool calls as a tuple of canonical ``name(args)`` strings; None when malformed."""
    if not calls:
        return ()
    out = []
    for c in calls:
        if not isinstance(c, dict):
            return None
        f = c.get("function") if isinstance(c.get("function"), dict) else c
        name = f.get("name")
        if not isinstance(name, str):
            return None
        out.append(name + json.dumps(_canonical_args(f.get("arguments", {})), sort_keys=True, ensure_ascii=False))
    return tuple(out)


def _content(message: dict[str, Any]) -> str:
    """A normalised message's content, stripped (the server joined content parts already)."""
    content = message.get("content")
    return content.strip() if isinstance(content, str) else ""


@dataclass
class GeneratedTurn:
    """One assistant turn the model generated.

    :ivar text: the decoded generation (forced prefix included, the final EOS
        excluded): what the turn's content becomes on replay.
    :ivar token_ids: the turn's tokens as they were in the timeline (forced
        prefix + generated, EOS included when generated).
    :ivar content: the parsed content given to the client (stripped).
    :ivar calls: canonical tool calls (see ``_canonical_calls``).
    :ivar call_ids: the tool-call ids the server issued for them.
    """

    text: str
    token_ids: list[int]
    content: str
    calls: tuple[str, ...]
    call_ids: tuple[str, ...] = ()
    rendered: str = field(default="", repr=False)


class TurnMemory:
    """The generated assistant turns of one episode (bounded; newest first on lookup)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self.turns: list[GeneratedTurn] = []
        self._by_call_id: dict[str, GeneratedTurn] = {}
        #: how many history messages were replayed / left as sent (for metrics and tests)
        self.stats = {"replayed": 0, "by_id": 0, "by_content": 0, "not_found": 0}

    def remember(self, text: str, token_ids: Sequence[int], rendered: str, content: str | None,
                 calls: Sequence[dict[str, Any]]) -> GeneratedTurn:
        """Keep a generated turn: ``text`` without the EOS, ``rendered`` = decode(token_ids)."""
        turn = GeneratedTurn(text=text, token_ids=list(token_ids), content=(content or "").strip(),
                             calls=_canonical_calls(calls) or (), call_ids=tuple(c["id"] for c in calls if c.get("id")),
                             rendered=rendered)
        self.turns.append(turn)
        for cid in turn.call_ids:
            self._by_call_id[cid] = turn
        if len(self.turns) > self.limit:
            old = self.turns.pop(0)
            for cid in old.call_ids:
                self._by_call_id.pop(cid, None)
        return turn

    def find(self, message: dict[str, Any]) -> GeneratedTurn | None:
        """The remembered turn an assistant ``message`` carries back, if any."""
        calls = message.get("tool_calls") or []
        ids = [c.get("id") for c in calls if isinstance(c, dict)]
        if ids and all(isinstance(i, str) for i in ids):
            found = {id(self._by_call_id.get(i)) for i in ids}
            turn = self._by_call_id.get(ids[0])
            if turn is not None and len(found) == 1 and len(ids) == len(turn.call_ids):
                self.stats["by_id"] += 1
                return turn
        canon = _canonical_calls(calls)
        if canon is None:
            return None
        content = _content(message)
        for turn in reversed(self.turns):
            if turn.calls == canon and (turn.content == content or (not canon and turn.text.strip() == content)):
                self.stats["by_content"] += 1
                return turn
        return None

    def substitute(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, list[int]]]]:
        """(messages with remembered assistant turns replaced by their raw text, the ``generated``
        pairs for ``ChatRenderer.render_prompt``)."""
        if not self.turns:
            return messages, []
        out: list[dict[str, Any]] = []
        generated: list[tuple[str, list[int]]] = []
        for m in messages:
            turn = self.find(m) if m.get("role") == "assistant" else None
            if turn is None:
                if m.get("role") == "assistant":
                    self.stats["not_found"] += 1
                out.append(m)
                continue
            self.stats["replayed"] += 1
            out.append({"role": "assistant", "content": turn.text})
            generated.append((turn.rendered, turn.token_ids))
        return out, generated
