"""Anthropic Messages ⇄ the shared chat turn: pure translations, no I/O.

A request's ``system``, ``messages`` (``text`` / ``tool_use`` / ``tool_result``
blocks), ``tools`` and ``tool_choice`` become OpenAI-chat messages, function
tools and a :class:`ToolChoice` (read by the request models of
:mod:`swarmkit.server.schema.anthropic`); a finished turn becomes a ``message`` object,
or the SSE event sequence of a streamed one. Errors carry the Anthropic field
path as ``param``.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from swarmkit.errors import ApiError
from swarmkit.server.chat_input import ToolChoice, strict_schemas

__all__ = ["STOP_REASONS", "event", "message_object", "read_messages", "read_tool_choice", "read_tools",
           "tool_use_block"]

#: the turn's finish reason → Anthropic ``stop_reason``
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def _bad(msg: str, param: str) -> ApiError:
    return ApiError(400, msg, "invalid_value", param=param)


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _text_of(blocks: Any, where: str, *, allowed: tuple[str, ...] = ("text",)) -> str:
    """The joined text of a string or a list of text blocks (any other block: 400)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of content blocks", where)
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") not in allowed or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}[{j}] is a {kind!r} block; only text blocks are read here "
                       "(this server's model reads text only)", f"{where}[{j}]")
        out.append(b["text"])
    return "".join(out)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    tid = block.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise _bad(f"{where}.tool_use_id must be the id of the tool_use block it answers", f"{where}.tool_use_id")
    content = block.get("content", "")
    text = _text_of(content, f"{where}.content") if content is not None else ""
    if block.get("is_error"):
        text = f"Error: {text}" if text else "Error"
    return {"role": "tool", "tool_call_id": tid, "content": text}


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            name, tid, args = b.get("name"), b.get("id"), b.get("input", {})
            if not isinstance(name, str) or not isinstance(tid, str) or not isinstance(args, dict):
                raise _bad(f"{at} must be a tool_use block with a string id, a string name and an input object", at)
            calls.append({"id": tid, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thoughts.append(b["thinking"])  # the template decides whether history shows it
        elif kind == "redacted_thinking":
            raise _bad(f"{at} is a 'redacted_thinking' block; this server never writes one", at)
        else:
            raise _bad(f"{at} is a {kind!r} block; an assistant turn holds text and tool_use blocks", at)
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        msg["reasoning_content"] = "".join(thoughts)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: its tool results (as ``tool`` messages, first) and its text (a ``user`` message)."""
    results: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_result":
            results.append(_tool_result(b, at))
        elif kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        else:
            raise _bad(f"{at} is a {kind!r} block; a user turn holds text and tool_result blocks "
                       "(this server's model reads text only)", at)
    out = list(results)
    if texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def read_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = _text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise _bad(f"{where} must be an object with role 'user' or 'assistant'", f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            if m["role"] == "assistant":
                out.append(_assistant(content, f"{where}.content"))
            else:
                out.extend(_user(content, f"{where}.content"))
        else:
            raise _bad(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
    return out


def read_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools", "tools")
    out = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _bad(f"tools[{j}] must be an object with a name", f"tools[{j}]")
        kind = t.get("type", "custom")
        if kind not in ("custom", None) or "input_schema" not in t:
            raise ApiError(400, f"tools[{j}] ({t['name']!r}, type {kind!r}) is a server tool; only client tools "
                           "({name, description, input_schema}) are supported", "unsupported_field",
                           param=f"tools[{j}]")
        schema = t["input_schema"]
        if t.get("strict") not in (None, False, True):
            raise _bad(f"tools[{j}].strict must be true or false", f"tools[{j}].strict")
        if not isinstance(schema, dict):
            raise _bad(f"tools[{j}].input_schema must be a JSON schema object", f"tools[{j}].input_schema")
        fn: dict[str, Any] = {"name": t["name"]}  # OpenAI's key order: templates render tools as JSON
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = schema
        out.append({"type": "function", "function": fn})
    return out


def read_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    choice = body.get("tool_choice")
    strict = strict_schemas(body.get("tools")) if tools else {}
    if choice is None:
        return ToolChoice("auto" if tools else "none", strict=strict)
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise _bad("'tool_choice' must be {'type': 'auto' | 'any' | 'tool' | 'none'}", "tool_choice")
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice["type"]
    if kind == "none" or not tools:
        if kind in ("any", "tool"):
            raise _bad(f"'tool_choice' {kind!r} asks for a tool call but the request has no 'tools'", "tool_choice")
        return ToolChoice("none", parallel=parallel)
    if kind == "auto":
        return ToolChoice("auto", parallel=parallel, strict=strict)
    if kind == "any":
        return ToolChoice("required", parallel=parallel, strict=strict)
    names = [t["function"]["name"] for t in tools]
    name = choice.get("name")
    if name not in names:
        raise _bad(f"'tool_choice' names {name!r}, which is not in 'tools' ({', '.join(names)})", "tool_choice.name")
    return ToolChoice("named", name=name, parallel=parallel, strict=strict)


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A parsed OpenAI tool call as a ``tool_use`` block (arguments parsed to ``input``)."""
    f = call["function"]
    try:
        args = json.loads(f["arguments"]) if isinstance(f["arguments"], str) else f["arguments"]
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": call["id"], "name": f["name"], "input": args if isinstance(args, dict) else {}}


def thinking_block(reasoning: str) -> dict[str, Any]:
    """A thinking model's reasoning as a ``thinking`` block (no signature: nothing to verify here)."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def message_object(mid: str, model: str, content: str | None, calls: list[dict[str, Any]], finish_reason: str,
                   stop_sequence: str | None, input_tokens: int, output_tokens: int,
                   reasoning: str | None = None, parts: list[str | dict[str, Any]] | None = None) -> dict[str, Any]:
    """The ``message`` answer of a finished turn (a ``thinking`` block first when it reasoned): ``text`` and
    ``tool_use`` blocks in the order of ``parts`` (as streamed), else the text then the calls."""
    blocks: list[dict[str, Any]] = []
    if reasoning is not None:
        blocks.append(thinking_block(reasoning))
    if parts is None:
        parts = [*([content] if content else []), *calls]
    blocks.extend({"type": "text", "text": p} if isinstance(p, str) else tool_use_block(p) for p in parts if p)
    reason = "stop_sequence" if stop_sequence else STOP_REASONS.get(finish_reason, "end_turn")
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def event(name: str, data: dict[str, Any]) -> bytes:
    """One SSE event of Anthropic's stream (``event:`` line + JSON ``data:`` with its ``type``)."""
    payload = json.dumps({"type": name, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()
