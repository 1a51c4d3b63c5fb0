"""``POST /v1/completions``: the shared turn (:mod:`swarmkit.server.turn`) over raw prompts (text or token
ids, no chat template), in OpenAI's Completions shape (or streamed); the request is read by
:class:`~swarmkit.server.schema.openai.CompletionsRequest`.

``echo`` (as vLLM and OpenAI's legacy API): each choice's text starts with its prompt and, with
``logprobs``, its logprobs start with the prompt's tokens (the first one's logprob null), scored by
the engine in one forward over the prompt (:meth:`~swarmkit.contract.InferenceBackend.score_prompt`).
With ``max_tokens: 0`` nothing is generated and nothing is recorded: scoring tokens (a teacher for
distillation, a judge) is not a sample of the policy. A generation asked for beside the echo is
recorded as any other call.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import PromptScores, SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server import fields
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    completion_logprobs,
    served_model,
    server_of,
    sse,
    top_by_text,
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
    created = int(time.time())
    cid = "cmpl-" + secrets.token_hex(12)
    model = served_model(srv)
    tt = srv.token_text if req.logprobs is not None else None
    scored: list[PromptScores | None] = [None] * len(turns)
    if req.echo and tt is not None:
        for i, turn in enumerate(turns):
            scored[i] = await srv.score_prompt(ep, turn.prompt_ids, req.logprobs or 0)
    if req.scores_only:
        return JSONResponse(_echo_only(turns, scored, tt, req, cid, created, model), headers=headers)
    params = turn_params(srv, turns, req, ep)
    if req.stream:
        if len(turns) != 1:
            raise ApiError(400, "streaming supports one prompt per request", "unsupported_value", param="stream")
        return StreamingResponse(_completion_stream(srv, ep, role, turns[0], params, tt, cid, created, model,
                                                    req.include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
    choices = []
    usage_prompt = usage_gen = 0
    violations: list[list[str]] = []  # per choice, in order: how an answer breaks its response_format
    for p_index, turn in enumerate(turns):
        replies = await generate_turn(srv, ep, role, turn, params)
        violations += [r.strict_violations for r in replies]
        usage_prompt += len(turn.prompt_ids)
        head = turn.blocks[0].text if req.echo else ""
        for r in replies:
            out = r.output
            usage_gen += len(out.token_ids)
            lp = completion_logprobs(tt, out.token_ids, out.logprobs, out.top_logprobs if params.top_logprobs else None,
                                     offset0=len(head)) if tt is not None else None
            if lp is not None and req.echo:
                lp = _joined(_prompt_logprobs(tt, turn.prompt_ids, scored[p_index], req.logprobs or 0), lp)
            choices.append(
                {
                    "index": p_index * params.n + r.index,
                    "text": head + out.text,
                    "logprobs": lp,
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
        headers={**headers, **fields.strict_header("/v1/completions", violations)},
    )


def _prompt_logprobs(tt: TokenText | None, ids: list[int], scores: PromptScores | None, k: int) -> dict[str, Any]:
    """The Completions ``logprobs`` object of an echoed prompt: its tokens, their logprobs (the first
    null: it has no prefix), ``k`` alternatives at each position (null at the first) and text offsets."""
    assert tt is not None and scores is not None  # echo with logprobs scored the prompt
    out = completion_logprobs(tt, ids, scores.logprobs, None)
    if k > 0:
        tops = scores.top_logprobs or [None] * len(ids)
        out["top_logprobs"] = [None if t is None else top_by_text(tt, t) for t in tops]
    return out


def _joined(prompt: dict[str, Any], generated: dict[str, Any]) -> dict[str, Any]:
    """The logprobs of an echoed prompt followed by those of its completion."""
    tops = None
    if prompt["top_logprobs"] is not None or generated["top_logprobs"] is not None:
        tops = (prompt["top_logprobs"] or [None] * len(prompt["tokens"])) + (generated["top_logprobs"] or [])
    return {key: prompt[key] + generated[key] for key in ("tokens", "token_logprobs", "text_offset")} | \
        {"top_logprobs": tops}


def _echo_only(turns: list[Turn], scored: list[PromptScores | None], tt: TokenText | None, req: CompletionsRequest,
               cid: str, created: int, model: str) -> dict[str, Any]:
    """The answer of ``echo`` with ``max_tokens: 0``: each prompt back (``n`` times), with its logprobs
    when asked; nothing generated, nothing recorded."""
    choices = []
    for p_index, turn in enumerate(turns):
        lp = _prompt_logprobs(tt, turn.prompt_ids, scored[p_index], req.logprobs or 0) if tt is not None else None
        for i in range(req.n):
            choices.append({"index": p_index * req.n + i, "text": turn.blocks[0].text, "logprobs": lp,
                            "finish_reason": "length"})
    prompt_tokens = sum(len(t.prompt_ids) for t in turns)
    return {"id": cid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}


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
