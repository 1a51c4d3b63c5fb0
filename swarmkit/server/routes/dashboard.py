"""The dashboard's routes: the page, its login, its files and the JSON it polls.

Every route but the login form needs the admin token: as ``Authorization:
Bearer`` (scripts) or as the session cookie a login sets (browsers). Pages are
served with a strict Content-Security-Policy (scripts and styles from this
server only) and are never cached.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from swarmkit.pool.advantages import read_advantages
from swarmkit.server.dashboard import data
from swarmkit.server.dashboard.session import COOKIE, LoginThrottle, Sessions
from swarmkit.server.dashboard.source import DashboardSource
from swarmkit.server.errors import ApiError
from swarmkit.server.requests import bearer

#: files under ``dashboard/static`` a logged-in browser may fetch, and their types
STATIC = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: the login form: no script at all, its own inline style
LOGIN_HEADERS = {**HEADERS, "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                 "form-action 'self'; frame-ancestors 'none'"}


def _static(name: str) -> str:
    return (resources.files("swarmkit.server.dashboard") / "static" / name).read_text(encoding="utf-8")


def _sessions(request: Request) -> Sessions:
    return request.app.state.dashboard_sessions  # type: ignore[no-any-return]


def _throttle(request: Request) -> LoginThrottle:
    state = request.app.state
    if getattr(state, "dashboard_logins", None) is None:
        state.dashboard_logins = LoginThrottle()
    return state.dashboard_logins  # type: ignore[no-any-return]


def _source(request: Request) -> DashboardSource:
    return request.app.state.dashboard  # type: ignore[no-any-return]


def _signed_in(request: Request) -> bool:
    token = bearer(request)
    if token is not None:
        return _source(request).is_admin(token)
    return _sessions(request).valid(request.cookies.get(COOKIE))


def _viewer(request: Request) -> DashboardSource:
    """The data source, for a request that shows the admin token or a live session (401 otherwise)."""
    if not _signed_in(request):
        raise ApiError(401, "the dashboard needs the admin token: log in at /dashboard or send "
                       "'Authorization: Bearer <admin token>'", "unauthorized")
    return _source(request)


def _html(body: str, status: int = 200, headers: dict[str, str] = HEADERS) -> Response:
    return Response(body, status, media_type="text/html; charset=utf-8", headers=headers)


def _login_form(message: str = "", status: int = 200) -> Response:
    return _html(_static("login.html").replace("{{message}}", message), status, LOGIN_HEADERS)


def routes() -> list[Route]:
    """The dashboard's routes (pages, login, files, JSON); ``/metrics`` is the live server's only."""
    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/login", login, methods=["POST"]),
        Route("/dashboard/logout", logout, methods=["POST"]),
        Route("/dashboard/static/{name}", static, methods=["GET"]),
        Route("/api/v1/dashboard/overview", overview, methods=["GET"]),
        Route("/api/v1/dashboard/episodes", episodes, methods=["GET"]),
        Route("/api/v1/dashboard/episodes/{episode_id}", episode, methods=["GET"]),
    ]


# --------------------------------------------------------------------------- pages
async def page(request: Request) -> Response:
    """``GET /dashboard``: the dashboard when signed in, else the login form."""
    if _signed_in(request):
        return _html(_static("index.html"))
    return _login_form()


async def login(request: Request) -> Response:
    """``POST /dashboard/login`` (form field ``token``): a session cookie and back to the page."""
    try:
        form = parse_qs((await request.body()).decode("utf-8"), max_num_fields=4)
    except ValueError:  # not UTF-8, or too many fields
        return _login_form("The form could not be read.", 400)
    address = request.client.host if request.client else "?"
    throttle = _throttle(request)
    wait = throttle.retry_after(address)
    if wait > 0:
        out = _login_form(f"Too many wrong tokens; try again in {math.ceil(wait)} s.", 429)
        out.headers["Retry-After"] = str(math.ceil(wait))
        return out
    token = (form.get("token") or [""])[0].strip()
    if not token or not _source(request).is_admin(token):
        throttle.failed(address)
        return _login_form("That is not this server's admin token.", 401)
    out = RedirectResponse("/dashboard", status_code=303, headers=HEADERS)
    out.set_cookie(COOKIE, _sessions(request).issue(), max_age=int(_sessions(request).ttl_s), path="/",
                   httponly=True, samesite="strict", secure=request.url.scheme == "https")
    return out


async def logout(request: Request) -> Response:
    """``POST /dashboard/logout``: end the session."""
    _sessions(request).revoke(request.cookies.get(COOKIE))
    out = RedirectResponse("/dashboard", status_code=303, headers=HEADERS)
    out.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return out


async def static(request: Request) -> Response:
    """``GET /dashboard/static/{name}``: the page's script and style (signed in only)."""
    _viewer(request)
    name = request.path_params["name"]
    if name not in STATIC:
        raise ApiError(404, f"no dashboard file '{name}'", "not_found")
    return Response(_static(name), media_type=STATIC[name], headers=HEADERS)


async def prometheus(request: Request) -> Response:
    """``GET /metrics``: the Prometheus text format (:mod:`swarmkit.server.prometheus`)."""
    _viewer(request)
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(request.app.state.prometheus.exposition(), media_type=CONTENT_TYPE_LATEST,
                    headers={"Cache-Control": "no-store"})


# --------------------------------------------------------------------------- data
def _json(body: dict[str, Any]) -> Response:
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


async def overview(request: Request) -> Response:
    """``GET /api/v1/dashboard/overview?after=N``: status, state spans, running episodes, clients,
    and the metrics rows after the first ``N`` (the page keeps those it has)."""
    source = _viewer(request)
    after = _query_int(request, "after", 0)
    now = time.time()
    rows = request.app.state.dashboard_metrics.rows(source.run_dir)
    return _json({
        "now": now,
        "live": source.live,
        "status": source.status(),
        "states": data.state_spans(source.state_history(), now if source.live else _last_time(source, rows)),
        "running": [data.episode_row(ep, now) for ep in source.running()],
        "pool_tasks": source.pool_tasks(),
        "clients": source.clients(now),
        "metrics": {"total": len(rows), "rows": rows[after:]},
    })


def _last_time(source: DashboardSource, rows: list[dict[str, Any]]) -> float:
    """When a finished run last did something: its last state move or metrics row."""
    times = [t for t, _ in source.state_history()[-1:]] + [float(r.get("time") or 0.0) for r in rows[-1:]]
    return max(times) if times else time.time()


async def episodes(request: Request) -> Response:
    """``GET /api/v1/dashboard/episodes``: running and recently ended episodes, filtered by
    ``task``, ``role``, ``client``, ``status``, ``kind`` (train/eval), ``adapter``, ``min_reward``, ``max_reward``;
    ``adapters``: the LoRA adapters the episodes or the steps name (``model.adapters``; [] for one model)."""
    source = _viewer(request)
    q = request.query_params
    filters = {"task": q.get("task", ""), "role": q.get("role", ""), "client": q.get("client", ""),
               "status": q.get("status", ""), "kind": q.get("kind", ""), "adapter": q.get("adapter", ""),
               "min_reward": _query_float(request, "min_reward"), "max_reward": _query_float(request, "max_reward"),
               "limit": _query_int(request, "limit", data.MAX_EPISODES)}

    # a live server's episodes are listed on the loop that changes them; a journal's are parsed off it
    everything = source.all_episodes() if source.live else await asyncio.to_thread(source.all_episodes)
    rows = await asyncio.to_thread(data.find_episodes, everything, time.time(), **filters)
    adapters = sorted({*source.adapters(),
                       *data.adapter_names(everything, request.app.state.dashboard_metrics.rows(source.run_dir))})
    return _json({"episodes": rows, "total": len(everything), "adapters": adapters})


async def episode(request: Request) -> Response:
    """``GET /api/v1/dashboard/episodes/{episode_id}``: one episode token by token, and its samples."""
    source = _viewer(request)
    ep = source.episode(request.path_params["episode_id"])
    # off the event loop: merging and per-token text of a long episode take a while
    view = await asyncio.to_thread(lambda: data.episode_view(
        ep, time.time(), source.decoder(), source.match(), read_advantages(source.run_dir, ep.id)))
    return _json(view)


def _query(request: Request, name: str, parse: Callable[[str], Any], what: str) -> Any:
    """A query parameter parsed, None when absent or empty (unparsable: 422 naming ``what`` it must be)."""
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        return parse(raw)
    except ValueError:
        raise ApiError(422, f"'{name}' must be {what}", "invalid_field", param=name) from None


def _query_int(request: Request, name: str, default: int) -> int:
    value = _query(request, name, int, "an integer")
    if value is None:
        return default
    if not 0 <= value <= 10**9:
        raise ApiError(422, f"'{name}' must be between 0 and 10^9", "invalid_field", param=name)
    return int(value)


def _query_float(request: Request, name: str) -> float | None:
    value = _query(request, name, float, "a number")
    if value is not None and not math.isfinite(value):
        raise ApiError(422, f"'{name}' must be finite", "invalid_field", param=name)
    return value
