"""``POST /v1/chat/completions``: the shared turn (:mod:`swarmkit.server.turn`) in OpenAI's Chat shape.

The request is read by :class:`~swarmkit.server.schema.openai.ChatRequest` (every field, its check, its
place in the field table and the document, and its ``to_sampling_params``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import SamplingParams
from swarmkit.server import fields
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    chat_logprobs,
    served_model,
    server_of,
    sse,
    turn_params,
)
from swarmkit.server.schema.openai import ChatRequest
from swarmkit.server.turn import (
    CallDelta,
    Finished,
    Opened,
    Piece,
    Turn,
    generate_turn,
    prepare_turn_async,
    stream_turn,
)

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    srv = server_of(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    unknown = fields.unknown_fields(body, fields.CHAT, strict=srv.strict_fields)
    headers = fields.ignored_header(unknown)
    req = ChatRequest.parse(body)
    turn = await prepare_turn_async(srv, ep, req.messages, req.tools, req.tool_choice, endpoint="chat",
                                    template_kwargs=req.chat_template_kwargs)
    params = turn_params(srv, turn, req, ep)
    want_lp = req.logprobs
    want_top = want_lp and params.top_logprobs > 0
    created = int(time.time())
    cid = "chatcmpl-" + secrets.token_hex(12)
    model = served_model(srv)
    if req.stream:
        gen = _chat_stream(srv, ep, role, turn, params, want_lp, want_top, cid, created, model, req.include_usage)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    replies = await generate_turn(srv, ep, role, turn, params)
    tt = srv.token_text if want_lp else None
    choices = []
    for r in replies:
        message: dict[str, Any] = {"role": "assistant", "content": r.content}
        if r.reasoning is not None:
            message["reasoning_content"] = r.reasoning
        if r.calls:
            message["tool_calls"] = r.calls
        out = r.output
        choices.append(
            {
                "index": r.index,
                "message": message,
                "logprobs": {"content": chat_logprobs(tt, out.token_ids, out.logprobs,
                                                      out.top_logprobs if want_top else None), "refusal": None}
                if tt is not None else None,
                "finish_reason": r.finish_reason,
            }
        )
    completion_tokens = sum(len(r.output.token_ids) for r in replies)
    headers = {**headers, **fields.strict_header("/v1/chat/completions", [r.strict_violations for r in replies])}
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "system_fingerprint": f"swarmkit-v{srv.policy_version}",
            "choices": choices,
            "usage": {
                "prompt_tokens": len(turn.prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(turn.prompt_ids) + completion_tokens,
            },
        },
        headers=headers,
    )


async def _chat_stream(
    srv: SwarmServer,
    ep: Episode,
    role: str | None,
    turn: Turn,
    params: SamplingParams,
    want_lp: bool,
    want_top: bool,
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE of a chat completion (the turn records the call, even on disconnect)."""
    tt = srv.token_text if want_lp else None
    base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": f"swarmkit-v{srv.policy_version}"}
    generated = 0

    def chunk(i: int, delta: dict[str, Any], finish_reason: str | None = None, lp: Any = None) -> bytes:
        return sse({**base, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}]})

    async for ev in stream_turn(srv, ep, role, turn, params):
        if isinstance(ev, Opened):
            for i in range(params.n):
                yield chunk(i, {"role": "assistant", "content": ""})
        elif isinstance(ev, Piece):
            ch = ev.chunk
            lp = None
            if tt is not None and ch.token_ids:
                lp = {"content": chat_logprobs(tt, ch.token_ids, ch.logprobs, ch.top_logprobs if want_top else None),
                      "refusal": None}
            if ev.reasoning:
                yield chunk(ev.index, {"reasoning_content": ev.reasoning})
            if ev.text or lp is not None:
                yield chunk(ev.index, {"content": ev.text} if ev.text else {}, None, lp)
        elif isinstance(ev, CallDelta):  # a tool call as it is generated: its start, then argument pieces
            call: dict[str, Any] = {"index": ev.call, "function": {"arguments": ev.args}}
            if ev.name is not None:
                call.update(id=ev.call_id, type="function", function={"name": ev.name, "arguments": ""})
            yield chunk(ev.index, {"tool_calls": [call]})
        elif isinstance(ev, Finished):
            generated += ev.completion_tokens
            if ev.rest:
                yield chunk(ev.index, {"content": ev.rest})
            whole = [{"index": k, **c} for k, c in enumerate(ev.calls) if c["id"] not in ev.streamed]
            if whole:  # calls held until they closed (another shape than {"name", "arguments": {...}})
                yield chunk(ev.index, {"tool_calls": whole})
            yield chunk(ev.index, {}, ev.finish_reason)
    # the turn has recorded the call: a client that saw the end finds it recorded
    if include_usage:
        yield sse({**base, "choices": [], "usage": {"prompt_tokens": len(turn.prompt_ids), "completion_tokens": generated,
                                                      "total_tokens": len(turn.prompt_ids) + generated}})
    yield b"data: [DONE]\n\n"
