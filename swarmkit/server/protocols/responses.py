"""OpenAI Responses ⇄ the shared chat turn: pure translations, no I/O.

``input`` (a string, or items: messages, ``function_call``,
``function_call_output``, ``item_reference``) and ``instructions`` become
OpenAI-chat messages; function ``tools`` and ``tool_choice`` become Chat's function
tools and a :class:`ToolChoice` (read for the request model,
:mod:`swarmkit.server.schema.responses`); a finished turn becomes a ``response`` object with
``message`` and ``function_call`` output items, or the streamed event sequence.
``previous_response_id`` continues a stored conversation of the same episode.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from swarmkit.errors import ApiError
from swarmkit.server.chat_input import ToolChoice, parse_tool_choice, parse_tools

__all__ = ["output_items", "response_object", "to_chat"]

_TEXT_PARTS = ("input_text", "output_text", "text")


def _bad(msg: str, param: str) -> ApiError:
    return ApiError(400, msg, "invalid_value", param=param)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append(part["refusal"])
        else:
            raise _bad(f"{where}[{j}] is a {kind!r} part; this server's model reads text only "
                       "(input_text / output_text parts are joined)", f"{where}[{j}]")
    return "".join(out)


def _items(items: Any) -> list[dict[str, Any]]:
    """Chat messages of ``input`` items; consecutive function calls join one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    out: list[dict[str, Any]] = []
    thought: str | None = None  # a reasoning item's text, for the assistant turn that follows it

    def assistant(text: str) -> dict[str, Any]:
        nonlocal thought
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thought is not None:
            msg["reasoning_content"], thought = thought, None
        return msg

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
            text = _text(item.get("content", ""), f"{where}.content")
            if role == "assistant" and out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls") \
                    and thought is None:
                out[-1]["content"] += text  # several output_text messages of one turn
            else:
                out.append(assistant(text) if role == "assistant" else {"role": role, "content": text})
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
                raise _bad(f"{where} must have a string name, call_id and arguments", where)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and thought is None:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({**assistant(""), "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id must be the call_id of the function_call it answers", f"{where}.call_id")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output", ""),
                                                                                 f"{where}.output")})
        elif kind == "reasoning":  # a thinking model's reasoning, sent back: kept for the next assistant turn
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _bad(f"{where}.content must be a list of reasoning_text parts", f"{where}.content")
            thought = (thought or "") + "".join(p["text"] for p in parts)
        else:
            raise _bad(f"{where} is a {kind!r} item; supported: message, function_call, function_call_output, "
                       "item_reference", f"{where}.type")
    return out


def resolve_references(items: Any, find_item: Callable[[str], dict[str, Any] | None]) -> Any:
    """``input`` with each ``item_reference`` replaced by the stored item it names (400 if unknown)."""
    if not isinstance(items, list):
        return items
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            ref = find_item(str(item.get("id")))
            if ref is None:
                raise _bad(f"input[{i}] references item {item.get('id')!r}, which this episode has not stored",
                           f"input[{i}].id")
            item = ref
        out.append(item)
    return out


def read_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools``: function tools only (a built-in tool is a 400 naming it), as Chat's function tools."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of tools", "tools")
    chat_tools = []
    for j, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"tools[{j}] is a {kind!r} tool; only function tools are supported "
                           "({'type': 'function', 'name': ..., 'parameters': ...})", "unsupported_field",
                           param=f"tools[{j}]")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}
        chat_tools.append({"type": "function", "function": fn})
    return parse_tools({"tools": chat_tools})


def read_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice`` (and ``parallel_tool_calls``), checked against the function tools."""
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise ApiError(400, f"'tool_choice' of type {choice.get('type')!r} is not supported "
                           "(none, auto, required, or {'type': 'function', 'name': ...})", "unsupported_field",
                           param="tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return parse_tool_choice({"tool_choice": choice, "parallel_tool_calls": body.get("parallel_tool_calls"),
                              "tools": body.get("tools")}, tools)


def to_chat(items: Any, instructions: str | None, history: list[dict[str, Any]],
            find_item: Callable[[str], dict[str, Any] | None]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(messages to render, the conversation to store) of a request's ``input`` and ``instructions``
    (its other fields are read by :class:`~swarmkit.server.schema.responses.ResponsesRequest`).

    ``history``: the stored conversation of ``previous_response_id`` (``instructions`` are not
    carried over, as in OpenAI's API); ``find_item``: a stored item by id (``item_reference``).
    """
    conversation = [*history, *_items(resolve_references(items, find_item))]
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    if not messages:
        raise _bad("'input' is empty", "input")
    return messages, conversation


def message_item(text: str, *, item_id: str, status: str = "completed",
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(call: dict[str, Any], *, item_id: str, status: str = "completed") -> dict[str, Any]:
    f = call["function"]
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": f["name"],
            "arguments": f["arguments"], "status": status}


def reasoning_item(text: str, *, item_id: str, status: str = "completed") -> dict[str, Any]:
    """A thinking model's reasoning as a ``reasoning`` output item."""
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def output_items(content: str | None, calls: list[dict[str, Any]],
                 logprobs: list[dict[str, Any]] | None = None, reasoning: str | None = None,
                 parts: list[str | dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The output items of a finished turn: its reasoning, then a message item per text piece and a
    ``function_call`` item per call in the order of ``parts`` (as streamed; without: the text, then the
    calls). The logprobs (of the whole turn) go with the first message item."""
    items = []
    if reasoning is not None:
        items.append(reasoning_item(reasoning, item_id=new_id("rs")))
    if parts is None:
        parts = [*([content] if content else []), *calls]
    for p in parts:
        if isinstance(p, str):
            if p:
                items.append(message_item(p, item_id=new_id("msg"), logprobs=logprobs))
                logprobs = None
        else:
            items.append(call_item(p, item_id=new_id("fc")))
    return items


def assistant_message(content: str | None, calls: list[dict[str, Any]],
                      reasoning: str | None = None) -> dict[str, Any]:
    """The turn as a chat message (what the stored conversation keeps)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = calls
    return msg


def response_object(rid: str, body: dict[str, Any], model: str, *, status: str, output: list[dict[str, Any]],
                    input_tokens: int, output_tokens: int, created_at: float | None = None,
                    finish_reason: str | None = None) -> dict[str, Any]:
    """The ``response`` object (``status``: in_progress, completed or incomplete)."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {
        "id": rid, "object": "response", "created_at": int(created_at or time.time()), "status": status,
        "model": model, "output": output, "error": None,
        "incomplete_details": incomplete if status == "incomplete" else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": body.get("previous_response_id"),
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "text": body.get("text") if isinstance(body.get("text"), dict) and body["text"].get("format")
        else {"format": {"type": "text"}}, "truncation": "disabled", "reasoning": None,
        "store": body.get("store") is not False, "user": body.get("user"),
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                  "total_tokens": input_tokens + output_tokens,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        if status != "in_progress" else None,
    }
