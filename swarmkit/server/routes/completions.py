"""``POST /v1/completions``: the shared turn (:mod:`swarmkit.server.turn`) over raw prompts (text or token
ids, no chat template), in OpenAI's Completions shape (or streamed); the request is read by
:class:`~swarmkit.server.schema.openai.CompletionsRequest`."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server import fields
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    completion_logprobs,
    served_model,
    server_of,
    sse,
    turn_params,
)
from swarmkit.server.schema.openai import CompletionsRequest
from swarmkit.server.turn import (
    Finished,
    Piece,
    Turn,
    generate_turn,
    prepare_raw_turn_async,
    stream_turn,
)
from swarmkit.timelines.render import TokenText

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (raw text or token-id prompts, no chat template)."""
    srv = server_of(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    headers = fields.ignored_header(fields.unknown_fields(body, fields.COMPLETIONS, strict=srv.strict_fields))
    req = CompletionsRequest.parse(body)
    turns = [await prepare_raw_turn_async(srv, p, endpoint="completions") for p in req.prompt]
    params = turn_params(srv, turns, req)
    created = int(time.time())
    cid = "cmpl-" + secrets.token_hex(12)
    model = served_model(srv)
    tt = srv.token_text if req.logprobs is not None else None
    if req.stream:
        if len(turns) != 1:
            raise ApiError(400, "streaming supports one prompt per request", "unsupported_value", param="stream")
        return StreamingResponse(_completion_stream(srv, ep, role, turns[0], params, tt, cid, created, model,
                                                    req.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    choices = []
    usage_prompt = usage_gen = 0
    for p_index, turn in enumerate(turns):
        replies = await generate_turn(srv, ep, role, turn, params)
        usage_prompt += len(turn.prompt_ids)
        for r in replies:
            out = r.output
            usage_gen += len(out.token_ids)
            choices.append(
                {
                    "index": p_index * params.n + r.index,
                    "text": out.text,
                    "logprobs": completion_logprobs(tt, out.token_ids, out.logprobs,
                                                    out.top_logprobs if params.top_logprobs else None)
                    if tt is not None else None,
                    "finish_reason": r.finish_reason,
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
        },
        headers=headers,
    )


async def _completion_stream(
    srv: SwarmServer, ep: Episode, role: str | None, turn: Turn, params: SamplingParams,
    tt: TokenText | None, cid: str, created: int, model: str, include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE of a completion (the turn records the call, even on disconnect); with ``include_usage`` a last
    chunk (no choices) carries the usage."""
    base = {"id": cid, "object": "text_completion", "created": created, "model": model}
    generated = 0
    async for ev in stream_turn(srv, ep, role, turn, params):
        if isinstance(ev, Piece):
            ch = ev.chunk
            lp = completion_logprobs(tt, ch.token_ids, ch.logprobs, ch.top_logprobs if params.top_logprobs else None) \
                if tt is not None else None
            yield sse({**base, "choices": [{"index": ev.index, "text": ev.text, "logprobs": lp, "finish_reason": None}]})
        elif isinstance(ev, Finished):
            generated += ev.completion_tokens
            yield sse({**base, "choices": [{"index": ev.index, "text": "", "logprobs": None,
                                             "finish_reason": ev.finish_reason}]})
    # the turn has recorded the call: a client that saw the end finds it recorded
    if include_usage:
        prompt = len(turn.prompt_ids)
        yield sse({**base, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": generated,
                                                      "total_tokens": prompt + generated}})
    yield b"data: [DONE]\n\n"
