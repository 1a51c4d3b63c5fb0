"""``POST /v1/responses`` and ``GET /v1/responses/{id}``: OpenAI's Responses API over the shared turn.

The request's fields are read by :class:`~swarmkit.server.schema.responses.ResponsesRequest`; the route
turns its ``input`` (with the conversation of ``previous_response_id`` and the items that
``item_reference`` names) into chat messages, which needs the episode.
Responses are stored per episode (unless ``store: false``), so
``previous_response_id`` and ``item_reference`` work within the episode that
made them, and never across episodes.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server import fields
from swarmkit.server.protocols import responses as proto
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    chat_logprobs,
    served_model,
    server_of,
    turn_params,
)
from swarmkit.server.schema.responses import ResponsesRequest
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
#: responses an episode keeps for ``previous_response_id`` (oldest dropped first)
STORED_PER_EPISODE = 256


def _stored_item(ep: Episode, item_id: str) -> dict[str, Any] | None:
    """An item this episode stored (an ``item_reference``'s target), newest response first."""
    for entry in reversed(ep.responses.values()):
        if item_id in entry["items"]:
            return entry["items"][item_id]
    return None


def _history(ep: Episode, prev: Any) -> list[dict[str, Any]]:
    if prev is None:
        return []
    entry = ep.responses.get(prev) if isinstance(prev, str) else None
    if entry is None:
        raise ApiError(400, f"previous response {prev!r} not found: this episode has not stored it "
                       "(responses live within their episode; store: false keeps none)", "invalid_value",
                       param="previous_response_id")
    return list(entry["conversation"])


def _store(ep: Episode, body: dict[str, Any], response: dict[str, Any], conversation: list[dict[str, Any]],
           content: str | None, calls: list[dict[str, Any]], reasoning: str | None = None) -> None:
    if body.get("store") is False:
        return
    items = {it["id"]: it for it in response["output"]}
    for it in body.get("input") if isinstance(body.get("input"), list) else []:
        if isinstance(it, dict) and isinstance(it.get("id"), str):
            items[it["id"]] = it
    ep.responses[response["id"]] = {"conversation": [*conversation, proto.assistant_message(content, calls, reasoning)],
                                    "items": items, "response": response}
    while len(ep.responses) > STORED_PER_EPISODE:
        ep.responses.pop(next(iter(ep.responses)))


async def create_response(request: Request) -> Response:
    """``POST /v1/responses``."""
    srv = server_of(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    unknown = fields.unknown_fields(body, fields.RESPONSES, strict=srv.strict_fields)
    req = ResponsesRequest.parse(body)
    messages, conversation = proto.to_chat(req.input, req.instructions, _history(ep, req.previous_response_id),
                                           lambda iid: _stored_item(ep, iid))
    turn = await prepare_turn_async(srv, ep, messages, req.tools, req.tool_choice, endpoint="responses")
    params = turn_params(srv, turn, req, ep)
    want_lp = req.logprobs
    rid = proto.new_id("resp")
    headers = fields.ignored_header(unknown)
    if req.stream:
        gen = _stream(srv, ep, role, turn, params, want_lp, rid, body, conversation)
        return StreamingResponse(gen, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
    (reply,) = await generate_turn(srv, ep, role, turn, params)
    out = reply.output
    lps = chat_logprobs(srv.token_text, out.token_ids, out.logprobs,
                        out.top_logprobs if params.top_logprobs else None) if want_lp else None
    response = proto.response_object(
        rid, body, served_model(srv), status="incomplete" if reply.finish_reason == "length" else "completed",
        output=proto.output_items(reply.content, reply.calls, lps, reply.reasoning, reply.parts),
        input_tokens=len(turn.prompt_ids), output_tokens=len(out.token_ids), finish_reason=reply.finish_reason)
    _store(ep, body, response, conversation, reply.content, reply.calls, reply.reasoning)
    return JSONResponse(response, headers={**headers, **fields.strict_header("/v1/responses",
                                                                            [reply.strict_violations])})


def _event(name: str, seq: int, data: dict[str, Any]) -> bytes:
    payload = json.dumps({"type": name, "sequence_number": seq, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {payload}\n\n".encode()


async def _stream(srv: SwarmServer, ep: Episode, role: str | None, turn: Turn, params: SamplingParams,
                  want_lp: bool, rid: str, body: dict[str, Any], conversation: list[dict[str, Any]]
                  ) -> AsyncIterator[bytes]:
    """The Responses event sequence: created, in_progress, a reasoning item (a thinking model's),
    a message item streamed as text deltas, one function_call item per tool call (arguments in one
    delta), completed (or incomplete)."""
    model = served_model(srv)
    created = time.time()
    seq = 0
    output: list[dict[str, Any]] = []  # finished items
    lps: list[dict[str, Any]] = []
    parts: dict[str, list[str]] = {"reasoning": [], "message": []}  # the whole turn's
    item_text: list[str] = []  # the open item's (a message after a call is an item of its own)
    open_item: dict[str, Any] | None = None  # the reasoning, message or function_call item being streamed
    final: dict[str, Any] | None = None

    def ev(kind: str, **data: Any) -> bytes:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, data)

    def close() -> list[bytes]:
        """Finish the open item (its done events) and add it to the output."""
        nonlocal open_item
        if open_item is None:
            return []
        item, open_item = open_item, None
        k, iid = len(output), item["id"]
        if item["type"] == "function_call":
            done = {**item, "status": "completed"}
            events = [ev("response.function_call_arguments.done", item_id=iid, output_index=k,
                         arguments=done["arguments"], name=done["name"])]
        elif item["type"] == "reasoning":
            text = "".join(item_text)
            done = proto.reasoning_item(text, item_id=iid)
            events = [ev("response.reasoning_text.done", item_id=iid, output_index=k, content_index=0, text=text)]
        else:
            text = "".join(item_text)
            done = proto.message_item(text, item_id=iid, logprobs=lps if want_lp else None)
            events = [ev("response.output_text.done", item_id=iid, output_index=k, content_index=0, text=text,
                         logprobs=lps if want_lp else []),
                      ev("response.content_part.done", item_id=iid, output_index=k, content_index=0,
                         part=done["content"][0])]
        output.append(done)
        return [*events, ev("response.output_item.done", output_index=k, item=done)]

    def delta(kind: str, text: str, delta_lps: list[dict[str, Any]]) -> list[bytes]:
        """``text`` for the open item of ``kind`` (opened first, closing another)."""
        nonlocal open_item
        out: list[bytes] = []
        if open_item is None or open_item["type"] != kind:
            out += close()
            item_text.clear()
            k = len(output)
            if kind == "reasoning":
                open_item = proto.reasoning_item("", item_id=proto.new_id("rs"), status="in_progress")
                out.append(ev("response.output_item.added", output_index=k, item={**open_item, "content": []}))
            else:
                open_item = proto.message_item("", item_id=proto.new_id("msg"), status="in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                out += [ev("response.output_item.added", output_index=k, item={**open_item, "content": []}),
                        ev("response.content_part.added", item_id=open_item["id"], output_index=k,
                           content_index=0, part=part)]
        parts[kind].append(text)
        item_text.append(text)
        iid, k = open_item["id"], len(output)
        if kind == "reasoning":
            out.append(ev("response.reasoning_text.delta", item_id=iid, output_index=k, content_index=0, delta=text))
        else:
            out.append(ev("response.output_text.delta", item_id=iid, output_index=k, content_index=0, delta=text,
                          logprobs=delta_lps))
        return out

    async for item in stream_turn(srv, ep, role, turn, params):
        out: list[bytes] = []
        if isinstance(item, Opened):
            start = proto.response_object(rid, body, model, status="in_progress", output=[], input_tokens=0,
                                          output_tokens=0, created_at=created)
            out = [ev("response.created", response=start), ev("response.in_progress", response=start)]
        elif isinstance(item, Piece):
            ch = item.chunk
            delta_lps = chat_logprobs(srv.token_text, ch.token_ids, ch.logprobs,
                                      ch.top_logprobs if params.top_logprobs else None) if want_lp else []
            lps.extend(delta_lps)
            if item.reasoning:
                out += delta("reasoning", item.reasoning, [])
            if item.text:
                out += delta("message", item.text, delta_lps)
        elif isinstance(item, CallDelta):  # a tool call as it is generated: its item, arguments streamed
            if item.name is not None:
                out += close()
                open_item = proto.call_item({"id": item.call_id, "function": {"name": item.name, "arguments": ""}},
                                            item_id=proto.new_id("fc"), status="in_progress")
                out.append(ev("response.output_item.added", output_index=len(output), item=dict(open_item)))
            elif item.args and open_item is not None and open_item["type"] == "function_call":
                open_item["arguments"] += item.args
                out.append(ev("response.function_call_arguments.delta", item_id=open_item["id"],
                              output_index=len(output), delta=item.args))
        elif isinstance(item, Finished):
            if item.reasoning is not None and not parts["reasoning"]:
                out += delta("reasoning", "", [])  # the model reasoned, if emptily
            if item.rest:
                out += delta("message", item.rest, [])
            out += close()
            for call in item.calls:
                if call["id"] in item.streamed:
                    continue
                k = len(output)
                fc = proto.call_item(call, item_id=proto.new_id("fc"))
                out += [ev("response.output_item.added", output_index=k, item={**fc, "arguments": "",
                                                                               "status": "in_progress"}),
                        ev("response.function_call_arguments.delta", item_id=fc["id"], output_index=k,
                           delta=fc["arguments"]),
                        ev("response.function_call_arguments.done", item_id=fc["id"], output_index=k,
                           arguments=fc["arguments"], name=fc["name"]),
                        ev("response.output_item.done", output_index=k, item=fc)]
                output.append(fc)
            status = "incomplete" if item.finish_reason == "length" else "completed"
            final = proto.response_object(rid, body, model, status=status, output=output,
                                          input_tokens=len(turn.prompt_ids), output_tokens=item.completion_tokens,
                                          created_at=created, finish_reason=item.finish_reason)
            _store(ep, body, final, conversation, "".join(parts["message"]) or None, item.calls, item.reasoning)
        for b in out:
            yield b
    if final is not None:  # the turn recorded the call before the closing event
        yield ev(f"response.{final['status']}", response=final)


async def get_response(request: Request) -> Response:
    """``GET /v1/responses/{response_id}``: a response this episode stored."""
    srv = server_of(request)
    ep, _ = await srv.authorize_call(bearer(request))
    entry = ep.responses.get(request.path_params["response_id"])
    if entry is None:
        raise ApiError(404, f"response {request.path_params['response_id']!r} not found in this episode",
                       "not_found", param="response_id")
    return JSONResponse(entry["response"])
