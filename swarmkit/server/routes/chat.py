"""``POST /v1/chat/completions``: render the messages, generate, record, answer (or stream)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import GenerationOutput, SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    chat_logprobs,
    choice_streams,
    sampling_params,
    served_model,
    server_of,
    sse,
)
from swarmkit.timelines.toolcalls import ToolCallStreamParser, parse_tool_calls

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer


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


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    srv = server_of(request)
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
    model = served_model(srv)
    if body.get("stream"):
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        gen = _chat_stream(srv, ep, role, blocks, prompt_ids, params, want_lp, want_top, parse_tools,
                           cid, created, model, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outputs = await srv.generate(ep, prompt_ids, params)
    srv.tracker.record(ep, role, blocks, outputs, endpoint="chat")
    tt = srv.token_text if want_lp else None
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
    tt = srv.token_text if want_lp else None
    version = srv.policy_version
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": f"swarmkit-v{version}"}

    def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None, lp: Any = None) -> bytes:
        return sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]})

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
        async for i, ch in choice_streams(srv, prompt_ids, params):
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
            yield sse({**base, "choices": [], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": gen_tokens,
                                                          "total_tokens": len(prompt_ids) + gen_tokens}})
        completed = True
        record()  # before [DONE]: a client that saw the end finds the call recorded
        yield b"data: [DONE]\n\n"
    finally:
        record()
