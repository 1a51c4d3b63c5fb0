"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the shared turn.

The Anthropic SDK takes the server's root as its ``base_url`` (it appends
``/v1/messages``): registration answers it as ``anthropic_base_url``. The
episode key comes as ``x-api-key`` (or a bearer token). Errors have
Anthropic's shape (:mod:`swarmkit.server.errors`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import SamplingParams
from swarmkit.server import fields
from swarmkit.server.protocols import anthropic
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import served_model, server_of, turn_params
from swarmkit.server.schema.anthropic import CountTokensRequest, MessagesRequest
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

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_R = TypeVar("_R", MessagesRequest, CountTokensRequest)


async def _turn(request: Request, model: type[_R]) -> tuple[SwarmServer, Episode, str | None, _R, list[str], Turn]:
    """What both routes read: the episode, the request (``model``), its unknown fields, the prepared turn."""
    srv = server_of(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    unknown = fields.unknown_fields(body, model.table(), strict=srv.strict_fields)
    req = model.parse(body)
    turn = await prepare_turn_async(srv, ep, req.messages, req.tools, req.tool_choice, endpoint="messages",
                                    template_kwargs=req.template_kwargs)
    return srv, ep, role, req, unknown, turn


async def messages(request: Request) -> Response:
    """``POST /v1/messages``."""
    srv, ep, role, req, unknown, turn = await _turn(request, MessagesRequest)
    params = turn_params(srv, turn, req, ep)
    mid = anthropic.new_message_id()
    model = served_model(srv)
    headers = fields.ignored_header(unknown)
    if req.stream:
        return StreamingResponse(_stream(srv, ep, role, turn, params, mid, model), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, **headers})
    (reply,) = await generate_turn(srv, ep, role, turn, params)
    headers = {**headers, **fields.strict_header("/v1/messages", [reply.strict_violations])}
    return JSONResponse(anthropic.message_object(mid, model, reply.content, reply.calls, reply.finish_reason,
                                                 reply.stop_sequence, len(turn.prompt_ids),
                                                 len(reply.output.token_ids), reply.reasoning, reply.parts),
                        headers=headers)


async def _stream(srv: SwarmServer, ep: Episode, role: str | None, turn: Turn, params: SamplingParams,
                  mid: str, model: str) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, content blocks (text deltas; each tool call as one
    ``input_json_delta``), message_delta (stop reason, usage), message_stop."""
    ev = anthropic.event
    index = -1  # the content block being written
    open_kind: str | None = None  # "thinking", "text" or "tool_use": the open block

    def switch(kind: str) -> list[bytes]:
        """Close the open block and open one of ``kind`` (nothing when it is open already)."""
        nonlocal index, open_kind
        if open_kind == kind:
            return []
        out = [ev("content_block_stop", {"index": index})] if open_kind else []
        index += 1
        open_kind = kind
        block = anthropic.thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        return [*out, ev("content_block_start", {"index": index, "content_block": block})]

    def thinking(text: str) -> list[bytes]:
        return [*switch("thinking"), ev("content_block_delta", {"index": index, "delta": {
            "type": "thinking_delta", "thinking": text}})]

    def text(piece: str) -> list[bytes]:
        return [*switch("text"), ev("content_block_delta", {"index": index, "delta": {
            "type": "text_delta", "text": piece}})]

    async for item in stream_turn(srv, ep, role, turn, params):
        out: list[bytes] = []
        if isinstance(item, Opened):
            start = anthropic.message_object(mid, model, None, [], "stop", None, len(turn.prompt_ids), 0)
            start.update(stop_reason=None, content=[])
            out = [ev("message_start", {"message": start}), ev("ping", {})]
        elif isinstance(item, Piece):
            if item.reasoning:
                out += thinking(item.reasoning)
            if item.text:
                out += text(item.text)
        elif isinstance(item, CallDelta):  # a tool call as it is generated: a tool_use block, input streamed
            if item.name is not None:
                if open_kind:
                    out.append(ev("content_block_stop", {"index": index}))
                index += 1
                open_kind = "tool_use"
                out.append(ev("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": item.call_id, "name": item.name, "input": {}}}))
            elif item.args:
                out.append(ev("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": item.args}}))
        elif isinstance(item, Finished):
            if item.reasoning is not None and open_kind is None and not item.reasoning:
                out += thinking("")  # an empty thinking block still says the model reasoned
            if item.rest:
                out += text(item.rest)
            if open_kind:
                out.append(ev("content_block_stop", {"index": index}))
                open_kind = None
            for call in item.calls:
                if call["id"] in item.streamed:
                    continue
                index += 1
                block = anthropic.tool_use_block(call)
                out += [ev("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                        ev("content_block_delta", {"index": index, "delta": {
                            "type": "input_json_delta", "partial_json": call["function"]["arguments"]}}),
                        ev("content_block_stop", {"index": index})]
            reason = "stop_sequence" if item.stop_sequence else anthropic.STOP_REASONS.get(item.finish_reason,
                                                                                              "end_turn")
            out.append(ev("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": item.stop_sequence},
                                            "usage": {"output_tokens": item.completion_tokens}}))
        for b in out:
            yield b
    yield ev("message_stop", {})  # the turn recorded the call before this


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's length as this server renders it."""
    _, _, _, _, unknown, turn = await _turn(request, CountTokensRequest)
    return JSONResponse({"input_tokens": len(turn.prompt_ids)}, headers=fields.ignored_header(unknown))
