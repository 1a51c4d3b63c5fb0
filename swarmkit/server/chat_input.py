"""Validate and normalise what agent frameworks send to ``/v1/chat/completions``.

Frameworks differ in small ways that a chat template does not forgive:

- ``content`` as a list of parts (AgentScope, smolagents, the OpenAI SDK's
  typed messages): text parts are joined, as vLLM and SGLang do; any other
  part (image, audio, file) is refused with a 400 naming it;
- ``content: null`` beside ``tool_calls`` (the OpenAI SDK, LangChain, the
  Agents SDK, pydantic-ai, AutoGen...): becomes ``""``;
- the ``developer`` role (newer OpenAI clients): sent as ``system`` when the
  template has no developer role of its own (Qwen-style templates would drop it);
- ``tool_choice`` and ``parallel_tool_calls``: parsed into :class:`ToolChoice`;
- ``strict`` on a tool (CrewAI always sends ``true``, the Agents SDK ``false``): the
  flag is kept out of the prompt; a strict tool's schema goes into
  :attr:`ToolChoice.strict`. Its calls are constrained to the schema while decoding
  where the engine can (``server.strict_tools``, :mod:`swarmkit.timelines.strict_tools`)
  and every call of it is checked against the schema once generated
  (:func:`strict_violations`): a violation is reported with the answer, not refused.
- ``response_format`` (JSON, or JSON of a schema): the answer is checked the same way once generated
  (:func:`format_violations`) and a violation reported the same way: the engine constrains decoding,
  but a grammar may let through what ``json.loads`` refuses (raw control characters inside a string),
  and a token limit cuts an answer short.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmkit.errors import ApiError
from swarmkit.timelines.render import TemplateError

__all__ = ["ToolChoice", "check_tools_rendered", "format_violations", "normalize_messages", "parse_template_kwargs",
           "parse_tool_choice", "parse_tools", "strict_schemas", "strict_violations", "template_error"]

ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PARTS = ("text", "input_text", "output_text")


def _bad(msg: str, param: str) -> ApiError:
    return ApiError(400, msg, "invalid_value", param=param)


def _join_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise _bad(f"{where}[{j}] must be a content part object", f"{where}[{j}]")
        kind = part.get("type", "text")
        if kind in _TEXT_PARTS or (kind == "refusal" and isinstance(part.get("refusal"), str)):
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise _bad(f"{where}[{j}] is a {kind!r} part without a string 'text'", f"{where}[{j}].text")
            texts.append(text)
        else:
            raise _bad(f"{where}[{j}] is a {kind!r} part; this server's model reads text only "
                       "(content parts of type 'text' are joined)", f"{where}[{j}].type")
    return "".join(texts)


def _check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise _bad(f"{where} must be a list", where)
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad(f"{where}[{j}] must be an object with function.name", f"{where}[{j}]")
        if not isinstance(f.get("arguments", ""), (str, dict)):
            raise _bad(f"{where}[{j}].function.arguments must be a JSON string", f"{where}[{j}].function.arguments")
    return calls


def normalize_messages(messages: Any, *, developer_role: bool) -> list[dict[str, Any]]:
    """Checked messages with string content (new dicts; the input is not changed).

    :param developer_role: the template knows ``developer``; otherwise it becomes ``system``.
    :raises ApiError: 400 naming the message and field.
    """
    if messages is None:
        raise ApiError(400, "missing required field 'messages' (a list of chat messages)", "missing_field",
                       param="messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty list of chat messages", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"{where} must be an object with a string 'role'", where)
        role = m["role"]
        if role not in ROLES:
            raise _bad(f"{where}.role '{role}' is not one of {', '.join(ROLES)}", f"{where}.role")
        msg = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            msg["content"] = _join_parts(content, f"{where}.content")
        elif content is None:
            if role != "assistant":
                raise _bad(f"{where}.content is null; only an assistant message (with tool_calls) may omit "
                           "its content", f"{where}.content")
            msg["content"] = ""
        elif not isinstance(content, str):
            raise _bad(f"{where}.content must be a string, a list of parts or null", f"{where}.content")
        if "tool_calls" in m:
            if m["tool_calls"] is None or m["tool_calls"] == []:
                msg.pop("tool_calls")
            elif role != "assistant":
                raise _bad(f"{where} has tool_calls but role '{role}'", f"{where}.tool_calls")
            else:
                _check_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "developer" and not developer_role:
            msg["role"] = "system"
        out.append(msg)
    return out


def parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """``tools`` for the template (None when absent or empty); ``strict`` is dropped (the prompt is the
    same with it or without it): :func:`strict_schemas` reads it."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("'tools' must be a list of tool objects", "tools")
    out = []
    for j, t in enumerate(tools):
        f = t.get("function")
        if t.get("type", "function") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise _bad(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                       f"tools[{j}]")
        if "strict" in f:
            if f["strict"] not in (None, False, True):
                raise _bad(f"tools[{j}].function.strict must be true or false", f"tools[{j}].function.strict")
            if f["strict"] and not isinstance(f.get("parameters", {}), dict):
                raise _bad(f"tools[{j}].function.strict needs 'parameters' to be a JSON schema object",
                           f"tools[{j}].function.parameters")
            # the Agents SDK (false) and CrewAI (true) send it with every tool: the template never sees it
            t = {**t, "function": {k: v for k, v in f.items() if k != "strict"}}
        out.append(t)
    return out


def strict_schemas(tools: Any) -> dict[str, dict[str, Any]]:
    """Tool name -> parameters schema of the ``strict: true`` tools of a request's raw ``tools`` (Chat's
    ``{"function": {...}}`` or the flat Responses / Anthropic shape; checked by the caller's parser)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools if isinstance(tools, list) else []:
        f = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if isinstance(f, dict) and f.get("strict") is True and isinstance(f.get("name"), str):
            schema = f.get("parameters", f.get("input_schema", {}))
            out[f["name"]] = schema if isinstance(schema, dict) else {}
    return out


def _schema_errors(value: Any, schema: dict[str, Any], where: str) -> list[str]:
    """``value`` against a JSON schema: one line per problem (at most 8), the path in ``value`` after ``where``."""
    # the server's dependency, imported when a schema is checked
    from jsonschema import validators

    cls = validators.validator_for(schema)
    try:
        cls.check_schema(schema)
    except Exception as exc:  # noqa: BLE001 - jsonschema's SchemaError: the client's schema, not ours
        return [f"{where}: the schema is invalid ({str(exc).splitlines()[0]})"]
    out = []
    for err in sorted(cls(schema).iter_errors(value), key=lambda e: list(e.absolute_path))[:8]:
        path = "".join(f"[{p!r}]" for p in err.absolute_path) or " (top level)"
        out.append(f"{where}{path}: {err.message}")
    return out


def format_violations(content: str | None, response_format: Mapping[str, Any] | None) -> list[str]:
    """How an answer breaks the ``response_format`` its request asked for (the contract's form: ``{"type":
    "json_object"}`` or ``{"type": "json_schema", "schema": ...}``): not JSON (``json_object``: not a JSON
    object), or against the schema; empty when it conforms or nothing was asked."""
    if not response_format:
        return []
    try:
        value = json.loads(content or "")
    except ValueError as exc:
        return [f"response_format: the answer is not JSON ({exc})"]
    if response_format.get("type") == "json_object":
        return [] if isinstance(value, dict) else ["response_format: the answer is not a JSON object"]
    schema = response_format.get("schema")
    return _schema_errors(value, schema, "response_format: answer") if isinstance(schema, dict) else []


def strict_violations(calls: list[dict[str, Any]], strict: Mapping[str, dict[str, Any]]) -> list[str]:
    """How the generated ``calls`` of strict tools break their schema: one line per problem, naming the
    call (its index and tool) and the path in its arguments; empty when they all conform."""
    if not strict:
        return []
    out = []
    for k, call in enumerate(calls):
        name = call["function"]["name"]
        if name not in strict:
            continue
        try:
            args = json.loads(call["function"]["arguments"] or "{}")
        except ValueError as exc:
            out.append(f"tool_calls[{k}] ({name}): arguments are not JSON ({exc})")
            continue
        out += _schema_errors(args, strict[name], f"tool_calls[{k}] ({name}): arguments")
    return out


@dataclass(frozen=True)
class ToolChoice:
    """What the request asks of tool calls.

    :ivar mode: ``none`` (no tools offered or calls not parsed), ``auto``,
        ``required`` (the reply must call a tool) or ``named`` (must call ``name``).
    :ivar parallel: several calls in one reply are allowed.
    :ivar strict: tool name -> parameters schema of the tools sent with ``strict: true``: their calls'
        arguments are checked against it (:func:`strict_violations`).
    """

    mode: str = "none"
    name: str | None = None
    parallel: bool = True
    strict: Mapping[str, dict[str, Any]] = field(default_factory=dict, hash=False, compare=False)

    @property
    def parse(self) -> bool:
        """Whether tool calls are lifted out of the generated text."""
        return self.mode != "none"

    @property
    def forced(self) -> bool:
        """Whether the reply must start with a tool call."""
        return self.mode in ("required", "named")


def parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice`` / ``parallel_tool_calls`` of a request, checked against ``tools``."""
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice in ("none", "auto"):
            return ToolChoice("none", parallel=parallel)
        raise _bad("'tool_choice' asks for a tool call but the request has no 'tools'", "tool_choice")
    strict = strict_schemas(body.get("tools"))
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad(f"'tool_choice' {choice!r} is not one of none, auto, required, or "
                       "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        return ToolChoice(choice, parallel=parallel, strict=strict)
    if isinstance(choice, dict):
        f = choice.get("function") if isinstance(choice.get("function"), dict) else choice
        name = f.get("name")
        names = [t["function"]["name"] for t in tools]
        if not isinstance(name, str):
            raise _bad("'tool_choice' must name a function: {'type': 'function', 'function': {'name': ...}}",
                       "tool_choice")
        if name not in names:
            raise _bad(f"'tool_choice' names {name!r}, which is not in 'tools' ({', '.join(names)})", "tool_choice")
        return ToolChoice("named", name=name, parallel=parallel, strict=strict)
    raise _bad("'tool_choice' must be a string or an object", "tool_choice")


def check_tools_rendered(renderer: Any, tools: list[dict[str, Any]] | None) -> None:
    """400 when the chat template would drop ``tools`` silently."""
    if tools is not None and renderer.ignores_tools(tools):
        raise ApiError(400, "this model's chat template ignores 'tools' (it renders the same prompt without them), "
                       "so the model would never see them; set model.chat_template to a tool-aware template "
                       "(builtin:smollm2_tools, a .jinja file, or the template text; see docs/agents.md)",
                       "tools_unsupported", param="tools")


def template_error(exc: TemplateError) -> ApiError:
    """The 400 of a ``TemplateError``: the refused message as ``param``, the template's reason in the text."""
    param = f"messages[{exc.index}]" if exc.index is not None else "messages"
    return ApiError(400, str(exc), "invalid_messages", param=param)


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """``chat_template_kwargs`` (vLLM's field: extra variables for the chat template, such as
    Qwen3's ``enable_thinking``): at most 16 names with JSON scalar values."""
    value = body.get("chat_template_kwargs")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and k.isidentifier() and (v is None or isinstance(v, (bool, int, float, str)))
            for k, v in value.items()):
        raise _bad("'chat_template_kwargs' must be an object of at most 16 names (identifiers) with scalar values",
                   "chat_template_kwargs")
    reserved = {"messages", "tools", "add_generation_prompt", "documents"} & set(value)
    if reserved:
        raise _bad(f"'chat_template_kwargs' may not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    return dict(value)
