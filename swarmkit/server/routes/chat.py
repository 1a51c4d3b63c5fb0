"""``POST /v1/chat/completions``: render the messages, generate, record, answer (or stream)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import GenerationOutput, SamplingParams
from swarmkit.server.chat_input import (
    ToolChoice,
    check_tools_rendered,
    normalize_messages,
    parse_tool_choice,
    parse_tools,
    template_error,
)
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    chat_logprobs,
    choice_streams,
    sampling_params,
    served_model,
    server_of,
    sse,
)
from swarmkit.timelines.render import TemplateError
from swarmkit.timelines.toolcalls import CLOSE, OPEN, ToolCallStreamParser, parse_tool_calls

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer
    from swarmkit.timelines.block import Block


@dataclass
class _Prepared:
    """A checked chat request, ready to generate."""

    blocks: list[Any]
    prompt_ids: list[int]
    choice: ToolChoice
    forced_text: str
    forced_ids: list[int]
    internal_stop: bool  # a stop at the first </tool_call> (parallel_tool_calls: false)


def _prepare(srv: SwarmServer, ep: Episode, body: dict[str, Any]) -> _Prepared:
    renderer = srv.renderer
    messages = normalize_messages(body.get("messages"), developer_role=renderer.has_developer_role)
    tools = parse_tools(body)
    choice = parse_tool_choice(body, tools)
    check_tools_rendered(renderer, tools)
    messages, generated = ep.turns.substitute(messages)
    try:
        blocks = renderer.render_prompt(messages, tools=tools, generated=generated)
    except TemplateError as exc:
        raise template_error(exc) from None
    forced_text = renderer.tool_call_prefix(choice.name) if choice.forced else ""
    forced_ids = renderer.encode(forced_text) if forced_text else []
    prompt_ids = [t for b in blocks for t in b.token_ids] + forced_ids
    return _Prepared(blocks, prompt_ids, choice, forced_text, forced_ids, choice.parse and not choice.parallel)


def _sampling(srv: SwarmServer, body: dict[str, Any], prep: _Prepared) -> tuple[SamplingParams, bool]:
    params, want_lp = sampling_params(body, chat=True, max_new=srv.room_for(len(prep.prompt_ids)))
    if prep.internal_stop and CLOSE not in params.stop:
        params.stop = [*params.stop, CLOSE]
    else:
        prep.internal_stop = False
    return params, want_lp


def _reply_text(prep: _Prepared, text: str, finish_reason: str | None) -> str:
    """What tool calls are parsed from: the forced opening, the text, and the ``</tool_call>``
    that the internal stop (``parallel_tool_calls: false``) cut off."""
    full = prep.forced_text + text
    if prep.internal_stop and finish_reason == "stop" and full.rfind(OPEN) > full.rfind(CLOSE):
        full += CLOSE
    return full


def _remember(srv: SwarmServer, ep: Episode, completion: Block, content: str | None,
              calls: list[dict[str, Any]]) -> None:
    """Keep the turn (its recorded completion block: forced + generated tokens, decoded) for
    token-exact replay when the client sends it back."""
    rendered = completion.text
    eos = srv.renderer.eos_text
    text = rendered[: -len(eos)] if eos and rendered.endswith(eos) else rendered
    ep.turns.remember(text, completion.token_ids, rendered, content, calls)


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    srv = server_of(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    prep = _prepare(srv, ep, body)
    params, want_lp = _sampling(srv, body, prep)
    want_top = want_lp and params.top_logprobs > 0
    created = int(time.time())
    cid = "chatcmpl-" + secrets.token_hex(12)
    model = served_model(srv)
    if body.get("stream"):
        opts = body.get("stream_options") or {}
        include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
        gen = _chat_stream(srv, ep, role, prep, params, want_lp, want_top, cid, created, model, include_usage)
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    outputs = await srv.generate(ep, prep.prompt_ids, params)
    recorded = srv.tracker.record(ep, role, prep.blocks, outputs, endpoint="chat", forced=prep.forced_ids)
    tt = srv.token_text if want_lp else None
    choices = []
    completion_tokens = 0
    for i, out in enumerate(outputs):
        completion_tokens += len(out.token_ids)
        if prep.choice.parse:
            content, calls = parse_tool_calls(_reply_text(prep, out.text, out.finish_reason))
        else:
            content, calls = out.text, []
        _remember(srv, ep, recorded[i].blocks[-1], content, calls)
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
                "prompt_tokens": len(prep.prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prep.prompt_ids) + completion_tokens,
            },
        }
    )


async def _chat_stream(
    srv: SwarmServer,
    ep: Episode,
    role: str | None,
    prep: _Prepared,
    params: SamplingParams,
    want_lp: bool,
    want_top: bool,
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
    parsers = [ToolCallStreamParser() if prep.choice.parse else None for _ in range(n)]
    contents: list[list[str]] = [[] for _ in range(n)]
    calls_of: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    prompt_ids = prep.prompt_ids
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
            made = srv.tracker.record(ep, role, prep.blocks, outputs, endpoint="chat", forced=prep.forced_ids,
                                      meta={"stream": True, "complete": completed})
            if completed:
                for i in range(n):
                    _remember(srv, ep, made[i].blocks[-1], "".join(contents[i]) or None, calls_of[i])

    srv.begin_call(ep)
    try:
        await srv.wait_serving(ep)
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
            parser = parsers[i]
            if parser is not None and prep.forced_text:
                parser.feed(prep.forced_text)  # an open tool call: held until it closes
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
            if text:
                contents[i].append(text)
            if text or lp is not None:
                yield chunk(i, {"content": text} if text else {}, None, lp)
        for i in range(n):
            reason = finish[i] or "stop"
            parser = parsers[i]
            if parser is not None:
                if prep.internal_stop and finish[i] == "stop" and parser.in_call:
                    parser.feed(CLOSE)
                rest, calls = parser.finish()
                calls_of[i] = calls
                if rest:
                    contents[i].append(rest)
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
