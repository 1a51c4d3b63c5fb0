"""The request models of OpenAI's Chat Completions and Completions endpoints.

Each field is declared once, with how it is checked, what it means to the field table and its
JSON schema (:mod:`.spec`); ``to_sampling_params`` is the one translation of a request into the
engine's :class:`~swarmkit.contract.SamplingParams`. The shared sampling fields are the
constants below; the chat messages themselves are checked where the template is known
(:func:`swarmkit.server.chat_input.normalize_messages`, when the turn is prepared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmkit.contract import SamplingParams
from swarmkit.contract.backend import SHAPING_DEFAULTS
from swarmkit.errors import ApiError
from swarmkit.server.chat_input import (
    ToolChoice,
    parse_template_kwargs,
    parse_tool_choice,
    parse_tools,
)
from swarmkit.server.schema.jsonschema import ANY_OBJECT, BOOL, array, integer, obj, ref, string
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
    spec,
)

#: the largest max_tokens / max_output_tokens a request may name
MAX_TOKENS = 10**7
MAX_TOP_LOGPROBS = 20
#: the most stop strings a request may send
MAX_STOPS = 16


# --------------------------------------------------------------------------- readers of structured fields
def read_stop(value: Any, param: str = "stop") -> list[str]:
    """``stop``: a string or a list of at most 16 strings (empty ones dropped)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value) and len(value) <= MAX_STOPS:
        return [s for s in value if s]
    raise invalid(f"'{param}' must be a string or a list of at most {MAX_STOPS} strings", param)


def read_logit_bias(value: Any, param: str = "logit_bias") -> dict[Any, float]:
    """``logit_bias``: token id -> bias in [-100, 100]; the ids are checked against the vocabulary
    by :func:`engine_shaping` (the engine knows it)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid(f"'{param}' must be an object of token id -> bias", param)
    for v in value.values():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise invalid(f"'{param}' values must be numbers in [-100, 100], got {v!r}", param)
    return {k: float(v) for k, v in value.items()}


def read_response_format(value: Any, param: str = "response_format") -> dict[str, Any] | None:
    """A checked structured-output request in the contract's form (None: plain text).

    Takes Chat's ``{"type": "json_object"}`` / ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}`` and the flat ``{"type": "json_schema", "schema": ...}``
    of Responses and Messages.
    """
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        inner = value.get("json_schema") if isinstance(value.get("json_schema"), dict) else value
        schema = inner.get("schema")
        if not isinstance(schema, dict):
            raise invalid(f"'{param}' of type json_schema needs a 'schema' object", param)
        return {"type": "json_schema", "schema": schema}
    raise invalid(f"'{param}' must be of type text, json_object or json_schema", param)


def engine_shaping(backend: Any, *, top_k: int = 0, min_p: float = 0.0, frequency_penalty: float = 0.0,
                   presence_penalty: float = 0.0, repetition_penalty: float = 1.0,
                   logit_bias: dict[Any, float] | None = None, response_format: dict[str, Any] | None = None,
                   aliases: dict[str, str] | None = None) -> dict[str, Any]:
    """The distribution-shaping fields of :class:`SamplingParams`, checked against what ``backend``
    honours (``aliases``: the protocol's own name of a field, for the error) and its vocabulary."""
    aliases = aliases or {}
    vocab = len(backend.tokenizer) if backend is not None else None
    bias: dict[int, float] = {}
    for k, v in (logit_bias or {}).items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            tid = -1
        if tid < 0 or (vocab is not None and tid >= vocab):
            param = aliases.get("logit_bias", "logit_bias")
            raise invalid(f"'{param}' key {k!r} is not a token id of this model (0 <= id < {vocab})", param)
        bias[tid] = v
    fields = {"top_k": max(top_k, 0), "min_p": min_p, "frequency_penalty": frequency_penalty,
              "presence_penalty": presence_penalty, "repetition_penalty": repetition_penalty, "logit_bias": bias,
              "response_format": response_format}
    supported = getattr(backend, "sampling_fields", frozenset())
    for name, default in SHAPING_DEFAULTS.items():
        if fields.get(name, default) != default and name not in supported:
            kind = type(backend).__name__ if backend is not None else "no"
            hint = " (structured output needs an engine with guided decoding: backend=vllm)" \
                if name == "response_format" else ""
            field = aliases.get(name, name)
            raise ApiError(400, f"'{field}' is not supported by this server's engine ({kind} honours "
                           f"{', '.join(sorted(supported)) or 'none of the sampling-shaping fields'}){hint}",
                           "unsupported_field", param=field)
    return fields


# --------------------------------------------------------------------------- the shared field specs
def _stop(body: dict[str, Any], parsed: dict[str, Any]) -> list[str]:
    return read_stop(body.get("stop"))


def _logit_bias(body: dict[str, Any], parsed: dict[str, Any]) -> dict[Any, float]:
    return read_logit_bias(body.get("logit_bias"))


def _response_format(body: dict[str, Any], parsed: dict[str, Any]) -> dict[str, Any] | None:
    return read_response_format(body.get("response_format"))


def _include_usage(body: dict[str, Any], parsed: dict[str, Any]) -> bool:
    opts = body.get("stream_options") or {}
    return bool(isinstance(opts, dict) and opts.get("include_usage"))


MODEL = Passed(string("accepted and ignored: the server serves one model"))
TEMPERATURE = Number(0, 2, 1.0, "below 1e-5: greedy (as 0)")
TOP_P = Number(0, 1, 1.0)
N = Integer(1, 128, 1)
STOP = Custom(_stop, ref("Stop"))
SEED = Integer(-(2**63), 2**63 - 1, None)  # a 64-bit integer, as every engine takes it
#: stream: any true value streams (as it always has here; Messages and Responses refuse a non-boolean)
STREAM = Passed(BOOL)
STREAM_OPTIONS = Custom(_include_usage, obj({"include_usage": BOOL}))
LOGIT_BIAS = Custom(_logit_bias, ref("LogitBias"))
FREQUENCY_PENALTY = Number(-2, 2, 0.0)
PRESENCE_PENALTY = Number(-2, 2, 0.0)
TOP_K = Integer(-1, 10**6, 0)
MIN_P = Number(0, 1, 0.0)
REPETITION_PENALTY = Number(1e-6, 10, 1.0)
SKIP_SPECIAL_TOKENS = Flag("drop special tokens from the returned text (default false: the text keeps every "
                           "generated token, so sent back it replays them)")
RESPONSE_FORMAT = Custom(_response_format, ref("ResponseFormat"), nullable=True)
USER = Ignored(string("ignored"))

#: fields that change what is generated and that this server cannot honour: refused (400) when set to
#: anything but their no-op value, never silently ignored (docs/agents.md has the table)
FUNCTIONS = Refused(([],), "the legacy 'functions' field is not supported; send 'tools'")
FUNCTION_CALL = Refused(("none", "auto"), "the legacy 'function_call' field is not supported; send 'tool_choice'")
MODALITIES = Refused((["text"],), "only text output is supported")
AUDIO = Refused((), "audio output is not supported")
PREDICTION = Refused((), "predicted outputs are not supported")
BEST_OF = Refused((1,), "best_of is not supported (only 1); use n")
ECHO = Refused((False,), "echo is not supported")
SUFFIX = Refused(("",), "suffix (insertion) is not supported")
REASONING_EFFORT = Refused((), "this model has no reasoning-effort setting",
                           {"description": "refused (400): this model has no reasoning-effort setting"})
WEB_SEARCH_OPTIONS = Refused((), "web search is not supported")


# --------------------------------------------------------------------------- /v1/chat/completions
def _messages(body: dict[str, Any], parsed: dict[str, Any]) -> list[Any]:
    messages = body["messages"]
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of chat messages", "messages")
    return messages  # each message is checked when the turn is prepared (it needs the template)


def _tools(body: dict[str, Any], parsed: dict[str, Any]) -> list[dict[str, Any]] | None:
    return parse_tools(body)


def _tool_choice(body: dict[str, Any], parsed: dict[str, Any]) -> ToolChoice:
    return parse_tool_choice(body, parsed["tools"])


def _parallel(body: dict[str, Any], parsed: dict[str, Any]) -> bool:
    return parsed["tool_choice"].parallel  # read (and checked) with tool_choice


def _template_kwargs(body: dict[str, Any], parsed: dict[str, Any]) -> dict[str, Any] | None:
    return parse_template_kwargs(body)


#: a chat's messages (each checked when the turn is prepared) and its function tools (also read by the
#: demonstration body of the control API)
MESSAGES = Custom(_messages, array(ref("ChatMessage"), min_items=1), required=True,
                  missing="missing required field 'messages' (a list of chat messages)")
TOOLS = Custom(_tools, array(ref("ChatTool")), nullable=True)

_TEMPLATE_KWARGS_SCHEMA = {"type": "object", "maxProperties": 16,
                           "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                           "additionalProperties": {"type": ["string", "number", "boolean", "null"]},
                           "description": "extra chat template variables (e.g. enable_thinking)"}


@dataclass
class ChatRequest(RequestModel):
    """``POST /v1/chat/completions``: every field it honours, refuses or ignores, in the order they are checked."""

    endpoint = "/v1/chat/completions"

    model: str | None = spec(MODEL)
    messages: list[Any] = spec(MESSAGES)
    tools: list[dict[str, Any]] | None = spec(TOOLS)
    tool_choice: ToolChoice = spec(Custom(_tool_choice, ref("ChatToolChoice")))
    parallel_tool_calls: bool = spec(Custom(_parallel, BOOL, nullable=True))
    chat_template_kwargs: dict[str, Any] | None = spec(Custom(_template_kwargs, _TEMPLATE_KWARGS_SCHEMA,
                                                              nullable=True))
    # refused unless their no-op value
    functions: None = spec(FUNCTIONS)
    function_call: None = spec(FUNCTION_CALL)
    modalities: None = spec(MODALITIES)
    audio: None = spec(AUDIO)
    prediction: None = spec(PREDICTION)
    best_of: None = spec(BEST_OF, listed=False)  # Completions' fields, refused here too (not in Chat's table)
    echo: None = spec(ECHO, listed=False)
    suffix: None = spec(SUFFIX, listed=False)
    reasoning_effort: None = spec(REASONING_EFFORT)
    web_search_options: None = spec(WEB_SEARCH_OPTIONS)
    # sampling
    max_completion_tokens: int | None = spec(Integer(1, MAX_TOKENS, None))
    max_tokens: int | None = spec(Integer(1, MAX_TOKENS, None, "clipped to the context left"))
    stop: list[str] = spec(STOP)
    seed: int | None = spec(SEED)
    logprobs: bool = spec(Flag(nullable=True))
    top_logprobs: int = spec(Integer(0, MAX_TOP_LOGPROBS, 0, "needs logprobs: true"))
    temperature: float = spec(TEMPERATURE)
    top_p: float = spec(TOP_P)
    n: int = spec(N)
    skip_special_tokens: bool = spec(SKIP_SPECIAL_TOKENS)
    top_k: int = spec(TOP_K)
    min_p: float = spec(MIN_P)
    frequency_penalty: float = spec(FREQUENCY_PENALTY)
    presence_penalty: float = spec(PRESENCE_PENALTY)
    repetition_penalty: float = spec(REPETITION_PENALTY)
    logit_bias: dict[Any, float] = spec(LOGIT_BIAS)
    response_format: dict[str, Any] | None = spec(RESPONSE_FORMAT)
    stream: Any = spec(STREAM)
    stream_options: bool = spec(STREAM_OPTIONS)  # read as include_usage
    # metadata
    user: None = spec(USER)
    metadata: None = spec(Ignored(ANY_OBJECT))
    store: None = spec(Ignored(BOOL))
    service_tier: None = spec(Ignored(string()))
    prompt_cache_key: None = spec(Ignored(string()))
    prompt_cache_retention: None = spec(Ignored(string()))
    safety_identifier: None = spec(Ignored(string()))

    def check(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options)

    def to_sampling_params(self, max_new: int, backend: Any) -> SamplingParams:
        """The engine's sampling of this request, within ``max_new`` tokens (the context left)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or max_new
        return SamplingParams(
            max_tokens=min(max_tokens, max_new), temperature=self.temperature, top_p=self.top_p or 1e-9, n=self.n,
            stop=self.stop, seed=self.seed, top_logprobs=self.top_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            **engine_shaping(backend, top_k=self.top_k, min_p=self.min_p, frequency_penalty=self.frequency_penalty,
                             presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                             logit_bias=self.logit_bias, response_format=self.response_format))


# --------------------------------------------------------------------------- /v1/completions
#: the most prompts one /v1/completions request may batch
MAX_PROMPTS = 128


def _prompts(body: dict[str, Any], parsed: dict[str, Any]) -> list[str | list[int]]:
    """The request's prompts, each a text or a list of token ids (each checked when its turn is prepared)."""
    prompt = body["prompt"]
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = prompt
    else:
        raise invalid("'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                      "of token ids", "prompt")
    if len(items) > MAX_PROMPTS:
        raise invalid(f"{len(items)} prompts in one request (at most {MAX_PROMPTS})", "prompt")
    return items


def _best_of(body: dict[str, Any], parsed: dict[str, Any]) -> None:
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "'best_of' is not supported by this server", "unsupported_value", param="best_of")
    return BEST_OF.read(body, "best_of", parsed)


_IDS = array(integer(0), min_items=1)
_PROMPT_SCHEMA = {"anyOf": [string(min_length=1), _IDS, array({"anyOf": [string(min_length=1), _IDS]}, min_items=1)],
                  "description": "text, token ids, or a list of either (no chat template)"}


@dataclass
class CompletionsRequest(RequestModel):
    """``POST /v1/completions`` (raw prompts, no chat template): every field, in the order they are checked."""

    endpoint = "/v1/completions"

    model: str | None = spec(MODEL)
    echo: bool = spec(Flag("return the prompt before the completion, and with logprobs its tokens' logprobs "
                           "(the first null); max_tokens 0 scores the prompt only, unrecorded", nullable=True))
    best_of: None = spec(Custom(_best_of, integer(1, 1), nullable=True, role=REFUSED))
    prompt: list[str | list[int]] = spec(Custom(_prompts, _PROMPT_SCHEMA, required=True))
    # refused unless their no-op value
    functions: None = spec(FUNCTIONS, listed=False)  # Chat's fields, refused here too (not in this table)
    function_call: None = spec(FUNCTION_CALL, listed=False)
    modalities: None = spec(MODALITIES, listed=False)
    audio: None = spec(AUDIO, listed=False)
    prediction: None = spec(PREDICTION, listed=False)
    suffix: None = spec(SUFFIX)
    reasoning_effort: None = spec(REASONING_EFFORT, listed=False)
    web_search_options: None = spec(WEB_SEARCH_OPTIONS, listed=False)
    # sampling
    max_tokens: int | None = spec(Integer(0, MAX_TOKENS, None, "default 16; 0 only with echo (score the prompt)"))
    stop: list[str] = spec(STOP)
    seed: int | None = spec(SEED)
    logprobs: int | None = spec(Integer(0, 5, None, nullable=True))  # how many top logprobs (0: only the token's)
    temperature: float = spec(TEMPERATURE)
    top_p: float = spec(TOP_P)
    n: int = spec(N)
    skip_special_tokens: bool = spec(SKIP_SPECIAL_TOKENS)
    top_k: int = spec(TOP_K)
    min_p: float = spec(MIN_P)
    frequency_penalty: float = spec(FREQUENCY_PENALTY)
    presence_penalty: float = spec(PRESENCE_PENALTY)
    repetition_penalty: float = spec(REPETITION_PENALTY)
    logit_bias: dict[Any, float] = spec(LOGIT_BIAS)
    response_format: dict[str, Any] | None = spec(RESPONSE_FORMAT)
    stream: Any = spec(STREAM)
    stream_options: bool = spec(STREAM_OPTIONS)  # read as include_usage
    # metadata
    user: None = spec(USER)

    def check(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise invalid("'max_tokens' 0 generates nothing: only an 'echo' request (prompt scoring) may ask "
                          "for it", "max_tokens")
        if self.echo and self.stream:
            raise ApiError(400, "'echo' is not supported with 'stream'", "unsupported_value", param="echo")

    @property
    def scores_only(self) -> bool:
        """An ``echo`` request that generates nothing (``max_tokens: 0``): prompt scoring, never recorded."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options)

    def to_sampling_params(self, max_new: int, backend: Any) -> SamplingParams:
        """The engine's sampling of this request, within ``max_new`` tokens (the context left)."""
        return SamplingParams(
            max_tokens=min(self.max_tokens or 16, max_new), temperature=self.temperature, top_p=self.top_p or 1e-9,
            n=self.n, stop=self.stop, seed=self.seed, top_logprobs=self.logprobs or 0,
            skip_special_tokens=self.skip_special_tokens,
            **engine_shaping(backend, top_k=self.top_k, min_p=self.min_p, frequency_penalty=self.frequency_penalty,
                             presence_penalty=self.presence_penalty, repetition_penalty=self.repetition_penalty,
                             logit_bias=self.logit_bias, response_format=self.response_format))
