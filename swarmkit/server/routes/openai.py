"""What the OpenAI-compatible endpoints share: the turn's sampling, logprobs, SSE, ``/v1/models``.

The endpoints themselves are :mod:`.chat` (``/v1/chat/completions``) and
:mod:`.completions` (``/v1/completions``). The episode (and role) of a call is
found from its API key (``Authorization: Bearer <api_key>``). Invalid requests
get 400 (as the OpenAI API does); authentication 401.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkit.contract import SamplingParams
from swarmkit.errors import ApiError
from swarmkit.server.chat_input import normalize_messages, parse_tools, template_error
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.turn import (
    Turn,
    check_prompt_size,
    encode_async,
    in_render_pool,
    with_internal_stop,
    with_tool_constraint,
)
from swarmkit.timelines.render import TemplateError, TokenText

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.episodes import Episode
    from swarmkit.swarm.server import SwarmServer


def server_of(request: Request) -> SwarmServer:
    return request.app.state.swarm


class SamplingRequest(Protocol):
    """A request model that knows its engine sampling (:mod:`swarmkit.server.schema`)."""

    def to_sampling_params(self, max_new: int, backend: Any) -> SamplingParams: ...


def turn_params(srv: SwarmServer, turn: Turn | Sequence[Turn], request: SamplingRequest,
                ep: Episode | None = None) -> SamplingParams:
    """The sampling of a request's turns (several: the raw prompts of one ``/v1/completions`` request):
    the request's ``to_sampling_params`` within the context the longest prompt leaves, each turn's
    internal stop and its strict tools' constraint (``server.strict_tools``) added, and the tokens-per-request quota checked over all of them. On a server with
    several adapters, the adapter of the episode ``ep`` (the request's ``model`` field may name it)."""
    turns = [turn] if isinstance(turn, Turn) else list(turn)
    longest = max(len(t.prompt_ids) for t in turns)
    params = request.to_sampling_params(srv.room_for(longest), srv.backend)
    if ep is not None:
        params.adapter = srv.adapter_for(ep, getattr(request, "model", None))
    for t in turns:
        params = with_tool_constraint(t, with_internal_stop(t, params), srv.strict_tools)
    srv.check_tokens(len(turns) * params.n * params.max_tokens)
    return params


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


def top_by_text(tt: TokenText, top: dict[int, float]) -> dict[str, float]:
    """Alternatives keyed by token text (the Completions shape); where two ids share a text (e.g. two
    partial UTF-8 bytes that both decode to U+FFFD) the more likely one is kept, so the best alternative is
    always there."""
    out: dict[str, float] = {}
    for a, v in top.items():
        text = tt(a)[0]
        if text not in out or v > out[text]:
            out[text] = v
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
            top_list.append(top_by_text(tt, tops[k]))
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
                },
                *({"id": name, "object": "model", "created": int(srv.started_at or time.time()),
                   "owned_by": "swarmkit", "parent": served_model(srv), "adapter": True}
                  for name in srv.adapters),
            ],
        }
    )


async def get_model(request: Request) -> Response:
    """``GET /v1/models/{id}``: the served model under its name (404 for any other name)."""
    srv = server_of(request)
    srv.authorize_any(bearer(request))
    model_id = request.path_params["model_id"]
    if model_id in srv.adapters:
        return JSONResponse({"id": model_id, "object": "model", "created": int(srv.started_at or time.time()),
                             "owned_by": "swarmkit", "parent": served_model(srv), "adapter": True})
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
