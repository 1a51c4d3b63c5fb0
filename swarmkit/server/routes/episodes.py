"""The episode API that sampling clients use.

- ``POST /api/v1/episodes`` register → ``episode_id``, ``base_url``, ``api_key``
  (and ``keys``: role → key when roles are given).
- ``POST /api/v1/episodes/{id}/report`` ``{"reward": 1.0}`` or
  ``{"reward": {"wolf": 1.0, "seer": 0.0}}`` ends it; ``call_rewards`` gives single calls
  their own reward (per-turn credit, :mod:`swarmkit.swarm.call_rewards`).
- ``POST /api/v1/episodes/{id}/abort`` ``{"reason": "..."}`` ends it without a sample.
- ``POST /api/v1/episodes/{id}/prepare`` (``reward``, ``meta``, ``primary``) then
  ``.../commit``: the two-phase end of an episode that spans several servers
  (:mod:`swarmkit.swarm.atomic`; the SDK's ``swarm_episode`` makes both calls).
- ``POST /api/v1/episodes/{id}/demonstration`` ``{"messages": [...], "tools": [...]}``
  records a demonstrated conversation; its assistant turns train with a
  supervised loss (see docs/agents.md, "Supervised warm start").
- ``GET /api/v1/episodes/{id}`` and ``.../timelines``: read-only, for its owner.
- ``POST /api/v1/clients/ready`` ``{"ready": true}``: batching C4/C5 votes.

Owner calls authenticate with any of the episode's keys (or the admin token
for reads). Each body is read by its request model (:mod:`swarmkit.server.schema.control`),
after the caller is authorized. Field errors are 422; the body of every error is OpenAI-style.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkit.errors import ApiError
from swarmkit.procs import is_loopback
from swarmkit.server.chat_input import (
    check_tools_rendered,
    normalize_messages,
    template_error,
)
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.schema.control import (
    CLIENT_ID_MESSAGE,
    MAX_CLIENT_ID,
    AbortRequest,
    DemonstrationRequest,
    HeartbeatRequest,
    PrepareRequest,
    ReadyRequest,
    RegisterRequest,
    ReportRequest,
)
from swarmkit.swarm.call_rewards import resolve_call_rewards, store_call_rewards
from swarmkit.swarm.episodes import FINISHED, PREPARED, RUNNING, check_reward
from swarmkit.timelines import Timeline
from swarmkit.timelines.render import TemplateError

#: the header with which a client shows the key that holds its client id (votes, heartbeats)
CLIENT_KEY_HEADER = "X-Swarm-Client-Key"

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.server import SwarmServer


def _server(request: Request) -> SwarmServer:
    """The server (a client counts as active only once a request of its has passed authorization:
    see :func:`_owned`, :func:`register`, :func:`_hold_client_id`)."""
    srv: SwarmServer = request.app.state.swarm
    return srv


def _client_id(request: Request, given: str | None) -> str:
    """The body's ``client_id`` (checked by its model), else the ``X-Swarm-Client`` header."""
    cid = given if given is not None else request.headers.get("x-swarm-client", "")
    if len(cid) > MAX_CLIENT_ID:
        raise ApiError(422, CLIENT_ID_MESSAGE, "invalid_field", param="client_id")
    return cid


def _base_url(request: Request) -> str:
    """``server.public_url`` + ``/v1``, else the address the request came to (its Host header)."""
    public = _server(request).public_url
    return (public or str(request.base_url).rstrip("/")) + "/v1"


async def register(request: Request) -> Response:
    srv = _server(request)
    srv.check_client(bearer(request))
    srv.touch_client(request.headers.get("x-swarm-client"))
    req = RegisterRequest.parse(await read_json(request))
    task_id, is_eval, roles, meta = req.task_id, req.eval, req.roles, req.meta
    srv.check_meta(meta)
    client_id = _client_id(request, req.client_id)
    address = request.client.host if request.client else ""
    shown = request.headers.get(CLIENT_KEY_HEADER.lower())
    if client_id and shown:  # the client claims its id at its first contact: nobody can vote in its name first
        srv.clients.claim(client_id, shown)
    adapter = srv.check_adapter(req.adapter)
    srv.admit_episode(task_id, is_eval=is_eval, client_id=client_id, address=address)
    ep = srv.episodes.register(task_id, eval=is_eval, timeout_s=req.timeout_s, roles=roles, client_id=client_id,
                               meta=meta, policy_version=srv.policy_version, address=address, adapter=adapter)
    keys = {r: k for r, k in ep.keys.items() if r is not None}
    return JSONResponse(
        {
            "episode_id": ep.id,
            "base_url": _base_url(request),
            "anthropic_base_url": _base_url(request)[: -len("/v1")],
            "api_key": next(iter(ep.keys.values())),
            "keys": keys or None,
            "roles": ep.roles,
            "task_id": ep.task_id,
            "eval": ep.eval,
            "deadline": ep.deadline,
            "timeout_s": ep.deadline - ep.created,
            "policy_version": ep.policy_version,
            "model": srv.model_name,
            "adapter": ep.adapter,
        },
        status_code=201,
    )


def _owned(request: Request, srv: SwarmServer, *, admin_ok: bool = False):
    episode_id = request.path_params["episode_id"]
    token = bearer(request)
    if admin_ok and srv.is_admin(token):
        return srv.episodes.get(episode_id)
    ep = srv.episodes.owned(episode_id, token)
    srv.touch_client(ep.client_id)  # its key was right: the episode's client is alive
    return ep


_End = TypeVar("_End", ReportRequest, PrepareRequest)


async def _ended_by_client(request: Request, srv: SwarmServer, model: type[_End]
                           ) -> tuple[Any, float, dict[str, float], _End]:
    """The episode a report / prepare names, its checked reward, and the request, once its calls returned."""
    body = await read_json(request)
    ep = _owned(request, srv)
    req = model.parse(body)
    meta = req.meta
    if meta:
        srv.check_meta({**ep.meta, **meta})
    reward, rewards = check_reward(req.reward, ep.roles, srv.max_abs_reward)
    srv.episodes.check_open(ep)
    if req.call_rewards:
        srv.check_call_rewards(ep)
    for _ in range(100):  # a call that is returning right now gets up to 5 s to be recorded
        if not ep.in_flight:
            break
        await asyncio.sleep(0.05)
    if ep.in_flight:
        raise ApiError(409, f"episode '{ep.id}' still has {ep.in_flight} model call(s) in flight; report after "
                       "they return", "calls_in_flight")
    srv.episodes.check_open(ep)
    # checked once the calls have returned (every call is recorded), stored before the episode is committed
    resolved = resolve_call_rewards(req.call_rewards, ep.timelines, ep.roles, srv.max_abs_reward)
    store_call_rewards(ep.timelines, resolved)
    if meta:
        ep.meta.update(meta)
    return ep, reward, rewards, req


def _result(ep: Any) -> JSONResponse:
    out = {"episode_id": ep.id, "status": ep.status, "reward": ep.reward, "rewards": ep.rewards or None,
           "accepted": ep.accepted, "n_timelines": len(ep.timelines)}
    if "not_accepted" in ep.meta:
        out["not_accepted"] = ep.meta["not_accepted"]
    return JSONResponse(out)


async def report(request: Request) -> Response:
    srv = _server(request)
    ep, reward, rewards, _ = await _ended_by_client(request, srv, ReportRequest)
    srv.episodes.prepare(ep, reward, rewards, None)
    await srv.commit(ep, on_failure=RUNNING)
    return _result(ep)


def _origin(url: str) -> tuple[str, str] | None:
    """(``scheme://host:port``, host) of an http(s) URL, the port made explicit; None if it is not one."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    host = parts.hostname.lower()
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}:{port}", host


def _peer_allowed(url: str, peers: list[str]) -> bool:
    """Whether ``url`` is on one of the operator's ``server.peers``."""
    got = _origin(url)
    if got is None:
        return False
    origin, host = got
    for peer in peers:
        if peer == "loopback":
            if is_loopback(host):
                return True
        elif (p := _origin(peer)) is not None and p[0] == origin:
            return True
    return False


def _check_peer(primary: dict[str, str] | None, peers: list[str]) -> dict[str, str] | None:
    """``primary`` (checked by its model), if its url is on the operator's peers."""
    if primary is not None and not _peer_allowed(primary["url"], peers):
        raise ApiError(422, f"'primary.url' is not on this server's peers ({', '.join(peers) or 'none'}): it "
                       "calls no other server (server.peers lists the swarm servers a primary may live on)",
                       "invalid_field", param="primary.url")
    return primary


async def prepare(request: Request) -> Response:
    """First phase of ending a multi-server episode: keep the reward, wait for ``commit`` (or an abort)."""
    srv = _server(request)
    ep, reward, rewards, req = await _ended_by_client(request, srv, PrepareRequest)
    srv.episodes.prepare(ep, reward, rewards, _check_peer(req.primary, list(srv.server_cfg.peers)))
    return JSONResponse({"episode_id": ep.id, "status": ep.status, "reward": reward, "rewards": rewards or None,
                         "deadline": ep.deadline})


async def commit(request: Request) -> Response:
    """Second phase: a prepared episode goes to the pool (idempotent: a committed one answers again)."""
    srv = _server(request)
    ep = _owned(request, srv)
    if ep.status == FINISHED:
        return _result(ep)
    if ep.status != PREPARED:
        srv.episodes.check_open(ep)  # 409 aborted / committing, 410 expired
        raise ApiError(409, f"episode '{ep.id}' is not prepared: send 'prepare' first (or 'report' for a "
                       "one-server episode)", "episode_not_prepared")
    await srv.commit(ep)
    return _result(ep)


async def demonstration(request: Request) -> Response:
    """Record a demonstrated conversation: its assistant turns train with a supervised (NLL) loss."""
    srv = _server(request)
    body = await read_json(request)
    ep = _owned(request, srv)
    srv.episodes.check_open(ep)
    renderer = srv.renderer
    if renderer is None:
        raise ApiError(409, "the server has no model loaded; start it first", "not_serving")
    _, role = srv.episodes.by_key(bearer(request))  # the key's role (`_owned` checked it is this episode's)
    req = DemonstrationRequest.parse(body)
    messages = normalize_messages(req.messages, developer_role=renderer.has_developer_role)
    if messages[-1]["role"] != "assistant":
        raise ApiError(400, "a demonstration must end with an assistant message (the turns to learn)",
                       "invalid_value", param=f"messages[{len(messages) - 1}].role")
    tools = req.tools
    check_tools_rendered(renderer, tools)
    try:
        blocks = renderer.render_demonstration(messages, tools)
    except TemplateError as exc:
        raise template_error(exc) from None
    except ValueError as exc:
        raise ApiError(400, str(exc), "invalid_messages", param="messages") from None
    n_tokens = sum(len(b.token_ids) for b in blocks)
    if srv.max_context and n_tokens > srv.max_context:
        raise ApiError(400, f"the demonstration has {n_tokens} tokens, more than the model's context "
                       f"({srv.max_context})", "context_length_exceeded", param="messages")
    meta = {"episode_id": ep.id, "task_id": ep.task_id, "call": ep.n_calls, "endpoint": "demonstration",
            "demonstration": True, "policy_version": srv.policy_version, "time": time.time()}
    ep.n_calls += 1
    ep.last_active = time.time()
    ep.timelines.append(Timeline(blocks=blocks, role=role, meta=meta))
    ep.meta["demonstration"] = True
    trained = sum(sum(b.loss_mask) for b in blocks)
    return JSONResponse({"episode_id": ep.id, "tokens": n_tokens, "trained_tokens": trained}, status_code=201)


async def abort(request: Request) -> Response:
    srv = _server(request)
    body = await read_json(request) if await request.body() else {}
    ep = _owned(request, srv)
    reason = AbortRequest.parse(body).reason
    if ep.status != PREPARED:
        srv.episodes.check_open(ep)
    srv.episodes.abort(ep, reason[:1000] or "aborted by the client")
    return JSONResponse({"episode_id": ep.id, "status": ep.status, "reason": ep.abort_reason})


async def get_episode(request: Request) -> Response:
    srv = _server(request)
    return JSONResponse(_owned(request, srv, admin_ok=True).summary())


async def timelines(request: Request) -> Response:
    srv = _server(request)
    ep = _owned(request, srv, admin_ok=True)
    return JSONResponse({"episode_id": ep.id, "status": ep.status, "task_id": ep.task_id,
                         "timelines": [tl.to_dict() for tl in ep.timelines]})


async def list_episodes(request: Request) -> Response:
    """Admin: summaries of running episodes (and the latest ended ones with ``?ended=N``)."""
    srv = _server(request)
    srv.check_admin(bearer(request))
    try:
        n_ended = int(request.query_params.get("ended", "0"))
    except ValueError:
        raise ApiError(422, "'ended' must be an integer", "invalid_field", param="ended") from None
    ended = srv.episodes.ended()[-n_ended:] if n_ended > 0 else []
    return JSONResponse({"running": [e.summary() for e in srv.episodes.running()],
                         "ended": [e.summary() for e in ended]})


async def client_ready(request: Request) -> Response:
    srv = _server(request)
    srv.check_client(bearer(request))
    req = ReadyRequest.parse(await read_json(request))
    cid = _client_id(request, req.client_id)
    if not cid:
        raise ApiError(422, "missing client id: send the 'X-Swarm-Client' header or 'client_id'", "missing_field",
                       param="client_id")
    ready = req.ready
    issued = _hold_client_id(request, srv, cid)
    srv.clients.set_ready(cid, ready)
    return JSONResponse({"client_id": cid, "ready": ready, **issued})


async def client_heartbeat(request: Request) -> Response:
    srv = _server(request)
    srv.check_client(bearer(request))
    cid = request.headers.get("x-swarm-client", "")
    if not cid:
        raise ApiError(422, "missing the 'X-Swarm-Client' header", "missing_field", param="client_id")
    if len(cid) > MAX_CLIENT_ID:
        raise ApiError(422, f"'X-Swarm-Client' must be at most {MAX_CLIENT_ID} characters", "invalid_field",
                       param="client_id")
    interval = HeartbeatRequest.parse(await read_json(request) if await request.body() else {}).interval_s
    issued = _hold_client_id(request, srv, cid)
    if interval is not None:  # missing three beats, the client counts as gone: a drain does not wait for it
        srv.clients.declare_beat(cid, interval)
    return JSONResponse({"client_id": cid, "state": str(srv.state.state), **issued})


def _hold_client_id(request: Request, srv: SwarmServer, cid: str) -> dict[str, str]:
    """Votes and heartbeats speak for a client id only with the key that holds it.

    The first vote or heartbeat of an id binds it to the key it shows (``X-Swarm-Client-Key``)
    or to a fresh key, answered as ``client_key`` (the SDK keeps it, on disk too); later ones
    must show that key: 403 ``client_key_mismatch``, so one client cannot vote in another's name.
    The id is free again once the server has forgotten the client (silent for 10 activity windows).
    """
    try:
        issued = srv.clients.bind(cid, request.headers.get(CLIENT_KEY_HEADER.lower()) or None)
    except PermissionError:
        raise ApiError(403, f"client id '{cid}' is held by another client (a different {CLIENT_KEY_HEADER}); "
                       "use your own client id, or the key the server answered to its first vote or heartbeat "
                       "(the SDK keeps it)", "client_key_mismatch", param="client_id") from None
    srv.touch_client(cid)
    return {"client_key": issued} if issued else {}
