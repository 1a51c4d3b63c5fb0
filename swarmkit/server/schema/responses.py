"""The request model of OpenAI's Responses API: ``POST /v1/responses``.

The model declares every top-level field once. ``input`` and ``previous_response_id`` are only
passed on: the conversation they make needs the episode (its stored responses and items), so the
route translates them (:func:`swarmkit.server.protocols.responses.to_chat`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swarmkit.contract import SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server.chat_input import ToolChoice
from swarmkit.server.protocols.responses import read_tool_choice, read_tools
from swarmkit.server.schema.jsonschema import (
    ANY_OBJECT,
    BOOL,
    STRICT_TOOL,
    Schema,
    array,
    enum,
    nullable,
    obj,
    ref,
    string,
)
from swarmkit.server.schema.openai import (
    MAX_TOKENS,
    MAX_TOP_LOGPROBS,
    engine_shaping,
    read_response_format,
)
from swarmkit.server.schema.spec import (
    REFUSED,
    Custom,
    Flag,
    Ignored,
    Integer,
    Number,
    Passed,
    Refused,
    RequestModel,
    invalid,
    not_supported,
    spec,
)

#: the ``include`` that asks for logprobs
LOGPROBS_INCLUDE = "message.output_text.logprobs"
#: honoured as it stands: a reasoning item already carries its text in ``content``, which the server
#: restores when the item is sent back, so a stateless (``store: false``) client keeps its reasoning
#: (Codex sends it on every request)
REASONING_INCLUDE = "reasoning.encrypted_content"
#: where a structured-output request sits in a Responses body (the ``param`` of its errors)
FORMAT_PARAM = "text.format"


def _text(body: dict[str, Any], parsed: dict[str, Any]) -> dict[str, Any] | None:
    """``text``: its ``format`` (structured output, in the contract's form); a ``verbosity`` other than
    medium is refused."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"} or \
            text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, f"'text' = {json.dumps(text)[:80]}: only 'format' is supported ('verbosity' "
                       "other than medium is not)", "unsupported_field", param="text")
    return read_response_format(text.get("format"), FORMAT_PARAM)


def _reasoning(body: dict[str, Any], parsed: dict[str, Any]) -> None:
    reasoning = body.get("reasoning")
    if reasoning not in (None, {}) and not (isinstance(reasoning, dict)
                                            and all(v is None for v in reasoning.values())):
        raise ApiError(400, "'reasoning' is not supported by this server's model", "unsupported_field",
                       param="reasoning")


def _background(body: dict[str, Any], parsed: dict[str, Any]) -> None:
    if body.get("background"):
        raise ApiError(400, "'background' responses are not supported", "unsupported_field", param="background")


def _include(body: dict[str, Any], parsed: dict[str, Any]) -> bool:
    """``include``: the output logprobs (read as: logprobs wanted) and the reasoning to send back
    (``REASONING_INCLUDE``)."""
    include = body.get("include")
    if include not in (None, []) and (not isinstance(include, list)
                                      or any(x not in (LOGPROBS_INCLUDE, REASONING_INCLUDE) for x in include)):
        raise ApiError(400, f"'include' = {json.dumps(include)[:80]}: only '{LOGPROBS_INCLUDE}' and "
                       f"'{REASONING_INCLUDE}' are supported", "unsupported_field", param="include")
    return LOGPROBS_INCLUDE in (include or [])


def _instructions(body: dict[str, Any], parsed: dict[str, Any]) -> str | None:
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("'instructions' must be a string", "instructions")
    return instructions


def _tools(body: dict[str, Any], parsed: dict[str, Any]) -> list[dict[str, Any]] | None:
    return read_tools(body)


def _tool_choice(body: dict[str, Any], parsed: dict[str, Any]) -> ToolChoice:
    return read_tool_choice(body, parsed["tools"])


def _parallel(body: dict[str, Any], parsed: dict[str, Any]) -> bool:
    return parsed["tool_choice"].parallel  # read (and checked) with tool_choice


_PART = obj({"type": enum("input_text", "output_text", "text", "refusal"), "text": string(), "refusal": string()},
            ("type",))
_CONTENT: Schema = {"anyOf": [string(), array(_PART)]}
_REASONING_TEXT = array(obj({"type": string(), "text": string()}, ("text",)))
_ITEM: Schema = {"anyOf": [
    obj({"type": enum("message"), "role": enum("user", "system", "developer", "assistant"), "content": _CONTENT},
        ("role",)),
    obj({"type": enum("function_call"), "call_id": string(), "name": string(), "arguments": string()},
        ("type", "call_id", "name")),
    obj({"type": enum("function_call_output"), "call_id": string(), "output": _CONTENT}, ("type", "call_id")),
    obj({"type": enum("item_reference"), "id": string()}, ("type", "id")),
    obj({"type": enum("reasoning"), "content": _REASONING_TEXT, "summary": _REASONING_TEXT}, ("type",)),
]}
_TOOL = obj({"type": enum("function"), "name": string(), "description": string(), "parameters": ANY_OBJECT,
             "strict": nullable({"type": "boolean", "description": STRICT_TOOL})}, ("type", "name"),
            description="a function tool (built-in tools are refused with 400)")
_TOOL_CHOICE: Schema = {"anyOf": [enum("none", "auto", "required"),
                                  obj({"type": enum("function"), "name": string()}, ("type", "name"))]}
_TEXT = obj({"format": nullable(ref("ResponseFormat")), "verbosity": nullable(enum("medium"))}, closed=True)
_REASONING = nullable({"type": "object", "additionalProperties": {"type": "null"},
                       "description": "refused (400) unless every value is null"})
_BACKGROUND: Schema = {"anyOf": [{"const": False}, {"type": "null"}],
                       "description": "background responses are refused (400)"}


@dataclass
class ResponsesRequest(RequestModel):
    """``POST /v1/responses``: every top-level field it honours, refuses or ignores, in the order they are
    checked."""

    endpoint = "/v1/responses"

    model: str | None = spec(Passed(string("accepted and ignored")))
    # refused unless their no-op value
    text: dict[str, Any] | None = spec(Custom(_text, _TEXT))  # read as its format (structured output)
    reasoning: None = spec(Custom(_reasoning, _REASONING, role=REFUSED))
    truncation: None = spec(Refused(("disabled",), "not supported", enum("disabled"), nullable=True,
                                    message="'truncation' 'auto' is not supported (a prompt longer than the "
                                            "context is refused)"))
    conversation: None = spec(not_supported("conversation"))
    prompt: None = spec(not_supported("prompt"))
    context_management: None = spec(not_supported("context_management"))
    background: None = spec(Custom(_background, _BACKGROUND, role=REFUSED))
    max_tool_calls: None = spec(Refused((), "not supported", message="'max_tool_calls' is not supported"))
    include: bool = spec(Custom(_include, nullable(array(enum(LOGPROBS_INCLUDE, REASONING_INCLUDE)))))  # read as: logprobs wanted
    # the conversation (translated by the route: it needs the episode)
    input: Any = spec(Passed({"anyOf": [string(), array(_ITEM)]}, required=True))
    instructions: str | None = spec(Custom(_instructions, nullable(string())))
    previous_response_id: str | None = spec(Passed(nullable(string())))
    tools: list[dict[str, Any]] | None = spec(Custom(_tools, nullable(array(_TOOL))))
    tool_choice: ToolChoice = spec(Custom(_tool_choice, _TOOL_CHOICE))
    parallel_tool_calls: bool = spec(Custom(_parallel, nullable(BOOL)))
    # sampling
    stream: bool = spec(Flag(nullable=True))
    stream_options: None = spec(Passed(ANY_OBJECT))
    max_output_tokens: int | None = spec(Integer(1, MAX_TOKENS, None, nullable=True))
    top_logprobs: int = spec(Integer(0, MAX_TOP_LOGPROBS, 0, nullable=True))
    temperature: float = spec(Number(0, 2, 1.0, nullable=True))
    top_p: float = spec(Number(0, 1, 1.0, nullable=True))
    # metadata (store: false also keeps the response out of this episode's store)
    store: None = spec(Ignored(nullable(BOOL)))
    metadata: None = spec(Ignored(ANY_OBJECT))
    user: None = spec(Ignored(string()))
    service_tier: None = spec(Ignored(string()))
    prompt_cache_key: None = spec(Ignored(string()))
    prompt_cache_retention: None = spec(Ignored(string()))
    prompt_cache_options: None = spec(Ignored(ANY_OBJECT))
    safety_identifier: None = spec(Ignored(string()))

    @property
    def logprobs(self) -> bool:
        """Whether the answer carries logprobs (``top_logprobs``, or ``include`` asking for them)."""
        return bool(self.top_logprobs) or self.include

    def to_sampling_params(self, max_new: int, backend: Any) -> SamplingParams:
        """The engine's sampling of this request, within ``max_new`` tokens (the context left)."""
        return SamplingParams(
            max_tokens=min(self.max_output_tokens or max_new, max_new), temperature=self.temperature,
            top_p=self.top_p or 1e-9, top_logprobs=self.top_logprobs,
            **engine_shaping(backend, response_format=self.text, aliases={"response_format": FORMAT_PARAM}))
