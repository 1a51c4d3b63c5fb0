"""What the OpenAI-compatible endpoints share: sampling parameters, logprobs, SSE, ``/v1/models``.

The endpoints themselves are :mod:`.chat` (``/v1/chat/completions``) and
:mod:`.completions` (``/v1/completions``). The episode (and role) of a call is
found from its API key (``Authorization: Bearer <api_key>``). Invalid requests
get 400 (as the OpenAI API does); authentication 401.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkit.contract import SamplingParams
from swarmkit.contract.backend import SHAPING_DEFAULTS
from swarmkit.errors import ApiError
from swarmkit.server.chat_input import normalize_messages, parse_tools, template_error
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.turn import (
    Turn,
    check_prompt_size,
    encode_async,
    in_render_pool,
    with_internal_stop,
)
from swarmkit.timelines.render import TemplateError, TokenText

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.server import SwarmServer

MAX_TOP_LOGPROBS = 20


def server_of(request: Request) -> SwarmServer:
    return request.app.state.swarm


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", "invalid_value", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {value}", "invalid_value", param=name)
    return float(value)


def _flag(body: dict, name: str) -> bool:
    """A boolean field that defaults to false (anything but true, false or absent: 400)."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be true or false", "invalid_value", param=name)
    return bool(value)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", "invalid_value", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value}", "invalid_value", param=name)
    return value


#: fields that change what is generated and that this server cannot honour: refused (400)
#: when set to anything but their no-op value, never silently ignored (docs/agents.md has the table)
_UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "functions": (([],), "the legacy 'functions' field is not supported; send 'tools'"),
    "function_call": (("none", "auto"), "the legacy 'function_call' field is not supported; send 'tool_choice'"),
    "modalities": ((["text"],), "only text output is supported"),
    "audio": ((), "audio output is not supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "best_of": ((1,), "best_of is not supported (only 1); use n"),
    "echo": ((False,), "echo is not supported"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "reasoning_effort": ((), "this model has no reasoning-effort setting"),
    "web_search_options": ((), "web search is not supported"),
}


def refuse_unsupported(body: dict[str, Any]) -> None:
    """400 for a field that would change the generation in a way the server cannot honour."""
    for name, (noop, why) in _UNSUPPORTED.items():
        value = body.get(name)
        if value is None or any(value == v and type(value) is type(v) for v in noop):
            continue
        raise ApiError(400, f"'{name}' = {json.dumps(value)[:80]}: {why}", "unsupported_field", param=name)


def _logit_bias(body: dict[str, Any], vocab: int | None) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, "'logit_bias' must be an object of token id -> bias", "invalid_value", param="logit_bias")
    out: dict[int, float] = {}
    for k, v in value.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            tid = -1
        if tid < 0 or (vocab is not None and tid >= vocab):
            raise ApiError(400, f"'logit_bias' key {k!r} is not a token id of this model (0 <= id < {vocab})",
                           "invalid_value", param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise ApiError(400, f"'logit_bias' values must be numbers in [-100, 100], got {v!r}", "invalid_value",
                           param="logit_bias")
        out[tid] = float(v)
    return out


def response_format(value: Any, param: str = "response_format") -> dict[str, Any] | None:
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
            raise ApiError(400, f"'{param}' of type json_schema needs a 'schema' object", "invalid_value", param=param)
        return {"type": "json_schema", "schema": schema}
    raise ApiError(400, f"'{param}' must be of type text, json_object or json_schema", "invalid_value", param=param)


def _shaping(body: dict[str, Any], backend: Any, aliases: dict[str, str]) -> dict[str, Any]:
    """The distribution-shaping fields of a request, checked against what ``backend`` honours
    (``aliases``: the protocol's own name of a field, for the error)."""
    top_k = _int(body, "top_k", 0, -1, 10**6) or 0
    fields = {
        "top_k": max(top_k, 0),
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 1e-6, 10.0),
        "logit_bias": _logit_bias(body, len(backend.tokenizer) if backend is not None else None),
        "response_format": response_format(body.get("response_format"),
                                           aliases.get("response_format", "response_format")),
    }
    supported = getattr(backend, "sampling_fields", frozenset())
    for name, default in SHAPING_DEFAULTS.items():
        if fields[name] != default and name not in supported:
            kind = type(backend).__name__ if backend is not None else "no"
            hint = " (structured output needs an engine with guided decoding: backend=vllm)" \
                if name == "response_format" else ""
            field = aliases.get(name, name)
            raise ApiError(400, f"'{field}' is not supported by this server's engine ({kind} honours "
                           f"{', '.join(sorted(supported)) or 'none of the sampling-shaping fields'}){hint}",
                           "unsupported_field", param=field)
    return fields


def sampling_params(body: dict[str, Any], *, chat: bool, max_new: int, backend: Any = None,
                    aliases: dict[str, str] | None = None) -> tuple[SamplingParams, bool]:
    """SamplingParams of a request, and whether logprobs were asked for (unsupported fields: 400).

    ``backend``: the serving engine; a distribution-shaping field it does not list in
    ``sampling_fields`` is refused, and ``logit_bias`` ids are checked against its vocabulary.
    """
    refuse_unsupported(body)
    max_tokens = _int(body, "max_completion_tokens", None, 1, 10**7) if chat else None
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, 1, 10**7)
    if max_tokens is None:
        max_tokens = max_new if chat else 16
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        stops = [s for s in stop if s]
    else:
        raise ApiError(400, "'stop' must be a string or a list of at most 16 strings", "invalid_value", param="stop")
    seed = _int(body, "seed", None, -(2**63), 2**63 - 1)  # a 64-bit integer, as every engine takes it
    if chat:
        lp = body.get("logprobs", False)
        if lp is not None and not isinstance(lp, bool):
            raise ApiError(400, "'logprobs' must be true or false", "invalid_value", param="logprobs")
        want_logprobs = bool(lp)
        top = _int(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
        if top and not want_logprobs:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", "invalid_value", param="top_logprobs")
    else:
        top_raw = _int(body, "logprobs", None, 0, 5)
        want_logprobs = top_raw is not None
        top = top_raw or 0
    params = SamplingParams(
        max_tokens=min(max_tokens, max_new),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
        n=_int(body, "n", 1, 1, 128) or 1,
        stop=stops,
        seed=seed,
        top_logprobs=top,
        skip_special_tokens=_flag(body, "skip_special_tokens"),
        **_shaping(body, backend, aliases or {}),
    )
    return params, want_logprobs


def turn_sampling(srv: SwarmServer, turn: Turn | Sequence[Turn], body: dict[str, Any],
                  aliases: dict[str, str] | None = None, *, chat: bool = True) -> tuple[SamplingParams, bool]:
    """The sampling of a request's turns (any protocol; several: the raw prompts of one
    ``/v1/completions`` request): :func:`sampling_params` within the context the longest prompt leaves,
    each turn's internal stop added, and the tokens-per-request quota checked over all of them.

    ``chat``: the Chat fields' meaning (false: Completions', see :func:`sampling_params`)."""
    turns = [turn] if isinstance(turn, Turn) else list(turn)
    longest = max(len(t.prompt_ids) for t in turns)
    params, want_lp = sampling_params(body, chat=chat, max_new=srv.room_for(longest), backend=srv.backend,
                                      aliases=aliases)
    for t in turns:
        params = with_internal_stop(t, params)
    srv.check_tokens(len(turns) * params.n * params.max_tokens)
    return params, want_lp


class SamplingRequest(Protocol):
    """A request model that knows its engine sampling (:mod:`swarmkit.server.schema`)."""

    def to_sampling_params(self, max_new: int, backend: Any) -> SamplingParams: ...


def turn_params(srv: SwarmServer, turn: Turn | Sequence[Turn], request: SamplingRequest) -> SamplingParams:
    """The sampling of a request's turns (several: the raw prompts of one ``/v1/completions`` request):
    the request's ``to_sampling_params`` within the context the longest prompt leaves, each turn's
    internal stop added, and the tokens-per-request quota checked over all of them."""
    turns = [turn] if isinstance(turn, Turn) else list(turn)
    longest = max(len(t.prompt_ids) for t in turns)
    params = request.to_sampling_params(srv.room_for(longest), srv.backend)
    for t in turns:
        params = with_internal_stop(t, params)
    srv.check_tokens(len(turns) * params.n * params.max_tokens)
    return params


def stream_flag(body: dict[str, Any]) -> bool:
    """``stream``: true, false or absent (anything else: 400)."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be true or false", "invalid_value", param="stream")
    return bool(stream)


def chat_logprobs(
    tt: TokenText, ids: Sequence[int], lps: Sequence[float], tops: Sequence[dict[int, float]] | None
) -> list[dict[str, Any]]:
    out = []
    for k, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
        tok, raw = tt(tid)
        alts = []
        if tops is not None and k < len(tops):
            for aid, alp in sorted(tops[k].items(), key=lambda kv: -kv[1]):
                atok, araw = tt(aid)
                alts.append({"token": atok, "logprob": alp, "bytes": araw})
        out.append({"token": tok, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return out


def completion_logprobs(
    tt: TokenText, ids: Sequence[int], lps: Sequence[float], tops: Sequence[dict[int, float]] | None, offset0: int = 0
) -> dict[str, Any]:
    tokens, offsets, top_list = [], [], []
    pos = offset0
    for k, tid in enumerate(ids):
        tok, _ = tt(tid)
        tokens.append(tok)
        offsets.append(pos)
        pos += len(tok)
        if tops is not None and k < len(tops):
            top_list.append({tt(a)[0]: v for a, v in tops[k].items()})
    return {
        "tokens": tokens,
        "token_logprobs": list(lps),
        "top_logprobs": top_list if tops is not None else None,
        "text_offset": offsets,
    }


def served_model(srv: SwarmServer) -> str:
    return srv.model_name


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the one model this server serves."""
    srv = server_of(request)
    srv.authorize_any(bearer(request))
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": served_model(srv),
                    "object": "model",
                    "created": int(srv.started_at or time.time()),
                    "owned_by": "swarmkit",
                    "policy_version": srv.policy_version,
                }
            ],
        }
    )


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model under its name (404 for any other name)."""
    srv = server_of(request)
    srv.authorize_any(bearer(request))
    model_id = request.path_params["model_id"]
    if model_id != served_model(srv):
        raise ApiError(404, f"model {model_id!r} is not served here; this server serves {served_model(srv)!r}",
                       "model_not_found", param="model")
    return JSONResponse({"id": model_id, "object": "model", "created": int(srv.started_at or time.time()),
                         "owned_by": "swarmkit", "policy_version": srv.policy_version})


def _renderer(srv: SwarmServer) -> Any:
    if srv.renderer is None:
        raise ApiError(503, f"the server is {srv.state.state}: no model is loaded", "not_serving")
    return srv.renderer


async def tokenize(request: Request) -> Response:
    """``POST /tokenize`` (vLLM's shape): ``{"prompt": str}`` or ``{"messages": [...], "tools": [...]}``
    (rendered with the chat template and the generation prompt) → ``{"count", "tokens", "max_model_len"}``."""
    srv = server_of(request)
    srv.authorize_any(bearer(request))
    body = await read_json(request)
    renderer = _renderer(srv)
    if isinstance(body.get("prompt"), str):
        ids = await encode_async(srv, body["prompt"], renderer.encode, "prompt")
    elif "messages" in body:
        messages = normalize_messages(body["messages"], developer_role=renderer.has_developer_role)
        tools = parse_tools(body)
        check_prompt_size(srv, messages, tools)

        def render() -> list[int]:
            try:
                blocks = renderer.render_prompt(messages, tools=tools)
            except TemplateError as exc:
                raise template_error(exc) from None
            return [t for b in blocks for t in b.token_ids]
        ids = await in_render_pool(srv, render)
    else:
        raise ApiError(400, "send 'prompt' (a string) or 'messages' (a chat)", "missing_field", param="prompt")
    return JSONResponse({"count": len(ids), "tokens": ids, "max_model_len": srv.max_context})


async def detokenize(request: Request) -> Response:
    """``POST /detokenize``: ``{"tokens": [ids]}`` → ``{"prompt": text}``."""
    srv = server_of(request)
    srv.authorize_any(bearer(request))
    body = await read_json(request)
    tokens = body.get("tokens")
    vocab = len(srv.tokenizer)
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                               for t in tokens):
        raise ApiError(400, f"'tokens' must be a list of token ids (0 <= id < {vocab})", "invalid_value",
                       param="tokens")
    return JSONResponse({"prompt": _renderer(srv).decode(tokens)})
