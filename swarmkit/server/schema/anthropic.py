"""The request models of Anthropic's Messages API: ``/v1/messages`` and ``/v1/messages/count_tokens``.

The content blocks themselves are translated (and checked, with their field path as ``param``) by
:mod:`swarmkit.server.protocols.anthropic`; the models declare every top-level field once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmkit.contract import SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server.chat_input import ToolChoice
from swarmkit.server.protocols.anthropic import read_messages, read_tool_choice, read_tools
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
    engine_shaping,
    read_response_format,
    read_stop,
)
from swarmkit.server.schema.spec import (
    Custom,
    Flag,
    Ignored,
    Integer,
    Number,
    Passed,
    RequestModel,
    invalid,
    not_supported,
    spec,
)

_TEXT_BLOCK = obj({"type": enum("text"), "text": string()}, ("type", "text"))
_BLOCK: Schema = {"anyOf": [
    _TEXT_BLOCK,
    obj({"type": enum("tool_use"), "id": string(), "name": string(), "input": ANY_OBJECT}, ("type", "id", "name")),
    obj({"type": enum("tool_result"), "tool_use_id": string(min_length=1),
         "content": {"anyOf": [string(), array(_TEXT_BLOCK), {"type": "null"}]}, "is_error": BOOL},
        ("type", "tool_use_id")),
    obj({"type": enum("thinking"), "thinking": string(), "signature": string()}, ("type", "thinking")),
]}
_MESSAGE = obj({"role": enum("user", "assistant"), "content": {"anyOf": [string(), array(_BLOCK)]}},
               ("role", "content"))
_TOOL = obj({"name": string(), "description": string(), "input_schema": ANY_OBJECT, "type": enum("custom"),
             "strict": nullable({"type": "boolean", "description": STRICT_TOOL})},
            ("name", "input_schema"), description="a client tool (server tools are refused with 400)")


def _thinking(body: dict[str, Any], parsed: dict[str, Any]) -> dict[str, Any] | None:
    """``thinking``: ``adaptive`` or ``disabled`` (a budget is refused); ``disabled`` becomes the chat
    template's ``enable_thinking=False`` (a thinking template then prefills an empty think block)."""
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") in ("disabled", "adaptive")):
        raise ApiError(400, "'thinking' with a token budget is not supported: a thinking model reasons as its chat "
                       "template lets it (send {'type': 'adaptive'} or leave it out; the reasoning comes back as "
                       "thinking blocks)", "unsupported_field", param="thinking")
    return {"enable_thinking": False} if isinstance(thinking, dict) and thinking.get("type") == "disabled" else None


def _output_config(body: dict[str, Any], parsed: dict[str, Any]) -> Any:
    """``output_config``: only its ``format`` (structured output, read with the sampling); ``effort`` is refused."""
    output = body.get("output_config")
    if output is not None and (not isinstance(output, dict) or set(output) - {"format", "effort"}
                               or output.get("effort") is not None):
        raise ApiError(400, "'output_config': only 'format' (structured output) is supported; 'effort' is not",
                       "unsupported_field", param="output_config")
    return output.get("format") if isinstance(output, dict) else None


def _tools(body: dict[str, Any], parsed: dict[str, Any]) -> list[dict[str, Any]] | None:
    return read_tools(body)


def _messages(body: dict[str, Any], parsed: dict[str, Any]) -> list[dict[str, Any]]:
    return read_messages(body)  # the system prompt first, then the messages, as OpenAI chat messages


def _tool_choice(body: dict[str, Any], parsed: dict[str, Any]) -> ToolChoice:
    return read_tool_choice(body, parsed["tools"])


def _stop_sequences(body: dict[str, Any], parsed: dict[str, Any]) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("'stop_sequences' must be a list of strings", "stop_sequences")
    return read_stop(stops, "stop_sequences")


_MESSAGES_MISSING = "'messages' must be a non-empty list of {role, content} objects"
MODEL = Passed(string("accepted and ignored"))
THINKING = Custom(_thinking, obj({"type": enum("adaptive", "disabled")}, ("type",),
                                 description="a thinking budget (enabled) is refused"))
OUTPUT_CONFIG = Custom(_output_config, obj({"format": ref("ResponseFormat")}, closed=True,
                                           description="structured output (vllm); effort is refused"))
TOOLS = Custom(_tools, array(_TOOL), nullable=True)
MESSAGES = Custom(_messages, array(_MESSAGE, min_items=1), required=True, missing=_MESSAGES_MISSING,
                  missing_code="invalid_value")
SYSTEM = Passed({"anyOf": [string(), array(_TEXT_BLOCK)]})  # read with the messages
TOOL_CHOICE = Custom(_tool_choice, obj({"type": enum("auto", "any", "tool", "none"), "name": string(),
                                        "disable_parallel_tool_use": BOOL}, ("type",)))
_UNTOUCHED = ("cache_control", "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id")


@dataclass
class _Conversation(RequestModel):
    """The fields both Messages endpoints read, in the order they are checked."""

    model: str | None = spec(MODEL)
    thinking: dict[str, Any] | None = spec(THINKING)  # read as the template's variables
    output_config: Any = spec(OUTPUT_CONFIG)  # read as its format
    container: None = spec(not_supported("container"))
    mcp_servers: None = spec(not_supported("mcp_servers"))
    context_management: None = spec(not_supported("context_management"))
    tools: list[dict[str, Any]] | None = spec(TOOLS)
    messages: list[dict[str, Any]] = spec(MESSAGES)
    system: Any = spec(SYSTEM)
    tool_choice: ToolChoice = spec(TOOL_CHOICE)
    cache_control: None = spec(Ignored(ANY_OBJECT))
    diagnostics: None = spec(Ignored({}))
    inference_geo: None = spec(Ignored(string()))
    speed: None = spec(Ignored(string()))
    user_profile_id: None = spec(Ignored(string()))
    workspace_id: None = spec(Ignored(string()))

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        return self.thinking


@dataclass
class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    endpoint = "/v1/messages"

    stream: bool = spec(Flag())
    max_tokens: int = spec(Integer(1, MAX_TOKENS, None, required=True))
    temperature: float = spec(Number(0, 1, 1.0))
    top_p: float = spec(Number(0, 1, 1.0))
    top_k: int = spec(Integer(-1, 10**6, 0))
    stop_sequences: list[str] = spec(Custom(_stop_sequences, array(string())))
    metadata: None = spec(Ignored(ANY_OBJECT))
    service_tier: None = spec(Ignored(string()))

    def to_sampling_params(self, max_new: int, backend: Any) -> SamplingParams:
        """The engine's sampling of this request, within ``max_new`` tokens (the context left)."""
        fmt = read_response_format(self.output_config, "output_config.format")
        return SamplingParams(
            max_tokens=min(self.max_tokens, max_new), temperature=self.temperature, top_p=self.top_p or 1e-9,
            stop=self.stop_sequences,
            **engine_shaping(backend, top_k=self.top_k, response_format=fmt,
                             aliases={"response_format": "output_config.format"}))


@dataclass
class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the conversation only (``container`` is refused, not listed)."""

    endpoint = "/v1/messages/count_tokens"

    container: None = spec(not_supported("container"), listed=False)  # checked, not in this table

