"""The OpenAI-compatible endpoints at each episode's ``base_url``.

``POST /v1/chat/completions``, ``POST /v1/completions`` and ``GET /v1/models``.
The episode (and role) of a call is found from its API key
(``Authorization: Bearer <api_key>``). The server applies the model's chat
template itself, generates from token ids, records the call in the episode's
context tracker, parses tool calls, and answers in the OpenAI format. Agents'
messages are never rewritten.

Invalid requests get 400 (as the OpenAI API does); authentication 401.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.interfaces import GenerationOutput, SamplingParams, StreamChunk
from swarmkit.server.errors import ApiError
from swarmkit.toolcalls import ToolCallStreamParser, parse_tool_calls

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.server.app import SwarmServer
    from swarmkit.server.episodes import Episode

MAX_TOP_LOGPROBS = 20


def _server(request: Request) -> SwarmServer:
    return request.app.state.swarm


async def read_json(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or 400 with what is wrong."""
    raw = await request.body()
    if not raw:
        raise ApiError(400, "empty request body; send a JSON object", "invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(body).__name__}", "invalid_json")
    return body


def bearer(request: Request) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (or ``api-key``), if any."""
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return request.headers.get("api-key") or None


# --------------------------------------------------------------------------- params
def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", "invalid_value", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo:g} and {hi:g}, got {value}", "invalid_value", param=name)
    return float(value)


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", "invalid_value", param=name)
    if not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {value}", "invalid_value", param=name)
    return value


def sampling_params(body: dict[str, Any], *, chat: bool, max_new: int) -> tuple[SamplingParams, bool]:
    """SamplingParams of a request, and whether logprobs were asked for."""
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
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"'seed' must be an integer, got {seed!r}", "invalid_value", param="seed")
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
    )
    return params, want_logprobs


# --------------------------------------------------------------------------- helpers
class _TokenText:
    """Cached per-token strings and bytes for logprob answers."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            text = self.tokenizer.decode([token_id])
            hit = (text, list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit


def token_text(srv: SwarmServer) -> _TokenText:
    tt = getattr(srv, "_token_text", None)
    if tt is None or tt.tokenizer is not srv.tokenizer:
        tt = _TokenText(srv.tokenizer)
        srv._token_text = tt
    return tt


def chat_logprobs(
    tt: _TokenText, ids: Sequence[int], lps: Sequence[float], tops: Sequence[dict[int, float]] | None
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
    tt: _TokenText, ids: Sequence[int], lps: Sequence[float], tops: Sequence[dict[int, float]] | None, offset0: int = 0
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


def _validate_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "missing required field 'messages' (a list of chat messages)", "missing_field",
                       param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of chat messages", "invalid_value", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "invalid_value",
                           param=f"messages[{i}]")
        if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role '{m['role']}' is not one of system, developer, user, "
                           "assistant, tool", "invalid_value", param=f"messages[{i}].role")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"messages[{i}].content must be a string, a list of parts or null",
                           "invalid_value", param=f"messages[{i}].content")
    return messages


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, bool]:
    """(tools for the template, whether tool calls are parsed from the output)."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None, False
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ApiError(400, "'tools' must be a list of tool objects", "invalid_value", param="tools")
    choice = body.get("tool_choice", "auto")
    return tools, choice != "none"


def _served_model(srv: SwarmServer) -> str:
    return srv.model_name


# --------------------------------------------------------------------------- endpoints
async def list_models(request: Request) -> Response:
    """``GET /v1/models``: the one model this server serves."""
    srv = _server(request)
    srv.authorize_any(bearer(request))
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": _served_model(srv),
                    "object": "model",
                    "created": int(srv.started_at or time.time()),
                    "owned_by": "swarmkit",
                    "policy_version": srv.policy_version,
                }
            ],
        }
    )


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    srv = _server(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    messages = _validate_messages(body)
    tools, parse_tools = _tools(body)
    try:
        blocks = srv.renderer.render_prompt(messages, tools=tools)
    except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
        raise ApiError(400, f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                       "invalid_messages", param="messages") from None
    prompt_ids = [t for b in blocks for t in b.token_ids]
    params, want_lp = sampling_params(body, chat=True, max_new=srv.room_for(len(prompt_ids)))
    want_top = want_lp and params.top_logprobs > 0
    created = int(time.time())
    cid = "chatcmpl-" + secrets.token_hex(12)
    model = _served_model(srv)
    if body.get("stream"):
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        gen = _chat_stream(srv, ep, role, blocks, prompt_ids, params, want_lp, want_top, parse_tools,
                           cid, created, model, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outputs = await srv.generate(ep, prompt_ids, params)
    srv.tracker.record(ep, role, blocks, outputs, endpoint="chat")
    tt = token_text(srv) if want_lp else None
    choices = []
    completion_tokens = 0
    for i, out in enumerate(outputs):
        completion_tokens += len(out.token_ids)
        content, calls = parse_tool_calls(out.text) if parse_tools else (out.text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choices.append(
            {
                "index": i,
                "message": message,
                "logprobs": {"content": chat_logprobs(tt, out.token_ids, out.logprobs,
                                                      out.top_logprobs if want_top else None), "refusal": None}
                if tt is not None else None,
                "finish_reason": "tool_calls" if calls else out.finish_reason,
            }
        )
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": f"swarmkit-v{srv.policy_version}",
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }
    )


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _choice_streams(
    srv: SwarmServer, prompt_ids: list[int], params: SamplingParams
) -> AsyncIterator[tuple[int, StreamChunk]]:
    """(choice index, chunk) from ``params.n`` concurrent backend streams."""
    one = SamplingParams(**{**params.__dict__, "n": 1})
    if params.n == 1:
        agen = srv.backend.stream(prompt_ids, one)
        try:
            async for chunk in agen:
                yield 0, chunk
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
        return
    send, receive = anyio.create_memory_object_stream[tuple[int, StreamChunk | None]](64)

    async def pump(i: int) -> None:
        params_i = SamplingParams(**{**one.__dict__, "seed": None if one.seed is None else one.seed + i})
        agen = srv.backend.stream(prompt_ids, params_i)
        try:
            async for chunk in agen:
                await send.send((i, chunk))
        finally:
            aclose = getattr(agen, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            with anyio.CancelScope(shield=True):
                await send.send((i, None))

    async with anyio.create_task_group() as tg:
        for i in range(params.n):
            tg.start_soon(pump, i)
        done = 0
        async with receive:
            while done < params.n:
                i, chunk = await receive.receive()
                if chunk is None:
                    done += 1
                    continue
                yield i, chunk


async def _chat_stream(
    srv: SwarmServer,
    ep: Episode,
    role: str | None,
    blocks: list[Any],
    prompt_ids: list[int],
    params: SamplingParams,
    want_lp: bool,
    want_top: bool,
    parse_tools: bool,
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE of a chat completion; the call is recorded in ``finally`` (even on disconnect)."""
    n = params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    tops: list[list[dict[int, float]]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    parsers = [ToolCallStreamParser() if parse_tools else None for _ in range(n)]
    tt = token_text(srv) if want_lp else None
    version = srv.policy_version
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": f"swarmkit-v{version}"}

    def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None, lp: Any = None) -> bytes:
        return _sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]})

    completed = False
    recorded = False

    def record() -> None:
        nonlocal recorded
        if recorded:
            return
        recorded = True
        srv.end_call(ep)
        outputs = [
            GenerationOutput(token_ids=ids[i], logprobs=lps[i], text="", finish_reason=finish[i] or "abort",
                             top_logprobs=tops[i] or None, policy_version=version)
            for i in range(n)
        ]
        if ep.running and any(ids):
            srv.tracker.record(ep, role, blocks, outputs, endpoint="chat",
                               meta={"stream": True, "complete": completed})

    srv.begin_call(ep)
    try:
        await srv.wait_serving(ep)
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, ch in _choice_streams(srv, prompt_ids, params):
            ids[i].extend(ch.token_ids)
            lps[i].extend(ch.logprobs)
            if ch.top_logprobs:
                tops[i].extend(ch.top_logprobs)
            text = ch.text
            parser = parsers[i]
            if parser is not None:
                text = parser.feed(text)
            if ch.finish_reason:
                finish[i] = ch.finish_reason
            lp = None
            if tt is not None and ch.token_ids:
                lp = {"content": chat_logprobs(tt, ch.token_ids, ch.logprobs, ch.top_logprobs if want_top else None),
                      "refusal": None}
            if text or lp is not None:
                yield chunk(i, {"content": text} if text else {}, None, lp)
        for i in range(n):
            reason = finish[i] or "stop"
            parser = parsers[i]
            if parser is not None:
                rest, calls = parser.finish()
                if rest:
                    yield chunk(i, {"content": rest})
                if calls:
                    reason = "tool_calls"
                    yield chunk(i, {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]})
            yield chunk(i, {}, reason)
        if include_usage:
            gen_tokens = sum(len(x) for x in ids)
            yield _sse({**base, "choices": [], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": gen_tokens,
                                                          "total_tokens": len(prompt_ids) + gen_tokens}})
        completed = True
        record()  # before [DONE]: a client that saw the end finds the call recorded
        yield b"data: [DONE]\n\n"
    finally:
        record()


def _completion_prompts(srv: SwarmServer, body: dict[str, Any]) -> list[tuple[str, list[int]]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError(400, "missing required field 'prompt'", "missing_field", param="prompt")
    tok = srv.tokenizer
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        items = prompt
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                       "of token ids", "invalid_value", param="prompt")
    out = []
    vocab = len(tok)
    for p in items:
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' must not be empty", "invalid_value", param="prompt")
            out.append((p, list(tok.encode(p, add_special_tokens=False))))
        else:
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p):
                raise ApiError(400, f"token-id prompts must be non-empty lists of ids in [0, {vocab})",
                               "invalid_value", param="prompt")
            out.append((tok.decode(p), list(p)))
    return out


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (raw text or token-id prompts, no chat template)."""
    srv = _server(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server", "unsupported_value", param="echo")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "'best_of' is not supported by this server", "unsupported_value", param="best_of")
    prompts = _completion_prompts(srv, body)
    longest = max(len(ids) for _, ids in prompts)
    params, want_lp = sampling_params(body, chat=False, max_new=srv.room_for(longest))
    created = int(time.time())
    cid = "cmpl-" + secrets.token_hex(12)
    model = _served_model(srv)
    tt = token_text(srv) if want_lp else None
    if body.get("stream"):
        if len(prompts) != 1:
            raise ApiError(400, "streaming supports one prompt per request", "unsupported_value", param="stream")
        text, ids = prompts[0]
        block = srv.tracker.prompt_block(text, ids)
        return StreamingResponse(_completion_stream(srv, ep, role, block, ids, params, tt, cid, created, model),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    choices = []
    usage_prompt = usage_gen = 0
    for p_index, (text, ids) in enumerate(prompts):
        outputs = await srv.generate(ep, ids, params)
        block = srv.tracker.prompt_block(text, ids)
        srv.tracker.record(ep, role, [block], outputs, endpoint="completions")
        usage_prompt += len(ids)
        for i, out in enumerate(outputs):
            usage_gen += len(out.token_ids)
            choices.append(
                {
                    "index": p_index * params.n + i,
                    "text": out.text,
                    "logprobs": completion_logprobs(tt, out.token_ids, out.logprobs,
                                                    out.top_logprobs if params.top_logprobs else None)
                    if tt is not None else None,
                    "finish_reason": out.finish_reason,
                }
            )
    return JSONResponse(
        {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": {"prompt_tokens": usage_prompt, "completion_tokens": usage_gen,
                      "total_tokens": usage_prompt + usage_gen},
        }
    )


async def _completion_stream(
    srv: SwarmServer, ep: Episode, role: str | None, block: Any, prompt_ids: list[int], params: SamplingParams,
    tt: _TokenText | None, cid: str, created: int, model: str,
) -> AsyncIterator[bytes]:
    n = params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    version = srv.policy_version
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}
    recorded = False

    def record() -> None:
        nonlocal recorded
        if recorded:
            return
        recorded = True
        srv.end_call(ep)
        outputs = [GenerationOutput(token_ids=ids[i], logprobs=lps[i], text="", finish_reason=finish[i] or "abort",
                                    policy_version=version) for i in range(n)]
        if ep.running and any(ids):
            srv.tracker.record(ep, role, [block], outputs, endpoint="completions", meta={"stream": True})

    srv.begin_call(ep)
    try:
        await srv.wait_serving(ep)
        async for i, ch in _choice_streams(srv, prompt_ids, params):
            ids[i].extend(ch.token_ids)
            lps[i].extend(ch.logprobs)
            if ch.finish_reason:
                finish[i] = ch.finish_reason
            lp = completion_logprobs(tt, ch.token_ids, ch.logprobs, ch.top_logprobs if params.top_logprobs else None) \
                if tt is not None else None
            yield _sse({**base, "choices": [{"index": i, "text": ch.text, "logprobs": lp, "finish_reason": None}]})
        for i in range(n):
            yield _sse({**base, "choices": [{"index": i, "text": "", "logprobs": None,
                                             "finish_reason": finish[i] or "stop"}]})
        record()
        yield b"data: [DONE]\n\n"
    finally:
        record()
