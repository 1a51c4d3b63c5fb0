"""``POST /v1/completions``: raw prompts (text or token ids), generate, record, answer (or stream)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkit.contract import GenerationOutput, SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server import fields
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.routes.openai import (
    completion_logprobs,
    sampling_params,
    served_model,
    server_of,
    sse,
)
from swarmkit.server.turn import choice_streams, encode_async, in_render_pool
from swarmkit.timelines.render import TokenText

#: the most prompts one /v1/completions request may batch
MAX_PROMPTS = 128

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer


async def _completion_prompts(srv: SwarmServer, body: dict[str, Any]) -> list[tuple[str, list[int]]]:
    """Each prompt as (text, token ids); text too long for the context is refused before it is tokenized,
    long text is tokenized off the event loop."""
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
    if len(items) > MAX_PROMPTS:
        raise ApiError(400, f"{len(items)} prompts in one request (at most {MAX_PROMPTS})", "invalid_value",
                       param="prompt")
    out = []
    vocab = len(tok)
    for p in items:
        if isinstance(p, str):
            if not p:
                raise ApiError(400, "'prompt' must not be empty", "invalid_value", param="prompt")
            ids = await encode_async(srv, p, lambda t: list(tok.encode(t, add_special_tokens=False)), "prompt")
            out.append((p, ids))
        else:
            if srv.max_context and len(p) > int(srv.max_context):
                raise ApiError(400, f"a prompt of {len(p)} token ids is longer than the model's context "
                               f"({srv.max_context} tokens)", "context_length_exceeded", param="prompt")
            if not p or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p):
                raise ApiError(400, f"token-id prompts must be non-empty lists of ids in [0, {vocab})",
                               "invalid_value", param="prompt")
            text = await in_render_pool(srv, lambda p=p: tok.decode(p)) if len(p) > 4096 else tok.decode(p)
            out.append((text, list(p)))
    return out


async def completions(request: Request) -> Response:
    """``POST /v1/completions`` (raw text or token-id prompts, no chat template)."""
    srv = server_of(request)
    body = await read_json(request)
    ep, role = await srv.authorize_call(bearer(request))
    headers = fields.ignored_header(fields.unknown_fields(body, fields.COMPLETIONS, strict=srv.strict_fields))
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server", "unsupported_value", param="echo")
    if body.get("best_of") not in (None, 1, body.get("n", 1)):
        raise ApiError(400, "'best_of' is not supported by this server", "unsupported_value", param="best_of")
    prompts = await _completion_prompts(srv, body)
    longest = max(len(ids) for _, ids in prompts)
    params, want_lp = sampling_params(body, chat=False, max_new=srv.room_for(longest), backend=srv.backend)
    srv.check_tokens(len(prompts) * params.n * params.max_tokens)
    created = int(time.time())
    cid = "cmpl-" + secrets.token_hex(12)
    model = served_model(srv)
    tt = srv.token_text if want_lp else None
    if body.get("stream"):
        if len(prompts) != 1:
            raise ApiError(400, "streaming supports one prompt per request", "unsupported_value", param="stream")
        text, ids = prompts[0]
        block = srv.tracker.prompt_block(text, ids)
        return StreamingResponse(_completion_stream(srv, ep, role, block, ids, params, tt, cid, created, model),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
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
        },
        headers=headers,
    )


async def _completion_stream(
    srv: SwarmServer, ep: Episode, role: str | None, block: Any, prompt_ids: list[int], params: SamplingParams,
    tt: TokenText | None, cid: str, created: int, model: str,
) -> AsyncIterator[bytes]:
    n = params.n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    vers: list[list[int]] = [[] for _ in range(n)]
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
                                    policy_version=version, token_versions=vers[i]) for i in range(n)]
        if ep.running and any(ids):
            srv.tracker.record(ep, role, [block], outputs, endpoint="completions", meta={"stream": True})

    srv.begin_call(ep)
    try:
        await srv.wait_serving(ep)
        async for i, ch in choice_streams(srv, prompt_ids, params):
            ids[i].extend(ch.token_ids)
            lps[i].extend(ch.logprobs)
            vers[i].extend(ch.versions(version))
            if ch.finish_reason:
                finish[i] = ch.finish_reason
            lp = completion_logprobs(tt, ch.token_ids, ch.logprobs, ch.top_logprobs if params.top_logprobs else None) \
                if tt is not None else None
            yield sse({**base, "choices": [{"index": i, "text": ch.text, "logprobs": lp, "finish_reason": None}]})
        for i in range(n):
            yield sse({**base, "choices": [{"index": i, "text": "", "logprobs": None,
                                             "finish_reason": finish[i] or "stop"}]})
        record()
        yield b"data: [DONE]\n\n"
    finally:
        record()
