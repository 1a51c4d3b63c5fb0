"""The HTTP face of one swarm server: a Starlette app over a :class:`~swarmkit.swarm.server.SwarmServer`.

``create_app(...)`` builds the app with a lifespan (reaper task, clean
shutdown), explicit routes (one module per resource under :mod:`.routes`) and
a pure ASGI body-size limit. Everything the endpoints share lives on the
server object (``app.state.swarm``), never in module globals.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from swarmkit.server.dashboard.data import MetricsTail
from swarmkit.server.dashboard.session import Sessions
from swarmkit.server.dashboard.source import DashboardSource, LiveSource
from swarmkit.server.errors import EXCEPTION_HANDLERS
from swarmkit.server.middleware import BodySizeLimit, UnexpectedErrors
from swarmkit.server.openapi import openapi_document
from swarmkit.server.prometheus import RequestTimer, ServerMetrics
from swarmkit.server.routes import (
    admin,
    chat,
    completions,
    dashboard,
    episodes,
    messages,
    openai,
    responses,
)
from swarmkit.swarm.server import SwarmServer


async def openapi_json(request: Request) -> Response:
    """``GET /openapi.json``: the API's OpenAPI description; public (it describes routes, holds no secrets)."""
    return JSONResponse(openapi_document())


def create_app(swarm: SwarmServer | None = None, **kwargs: Any) -> Starlette:
    """The Starlette app of one swarm server.

    :param swarm: a ready :class:`~swarmkit.swarm.server.SwarmServer`; otherwise one is
        built from ``kwargs`` (see its parameters). The full wiring (pool, trainer) is
        :func:`swarmkit.apps.wiring.build_server`'s job.
    """
    srv = swarm if swarm is not None else SwarmServer(**kwargs)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await srv.startup()
        try:
            yield
        finally:
            await srv.shutdown()

    routes = [
        Route("/", admin.root, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/v1/models", openai.list_models, methods=["GET"]),
        Route("/v1/chat/completions", chat.chat_completions, methods=["POST"]),
        Route("/v1/models/{model_id:path}", openai.get_model, methods=["GET"]),
        Route("/v1/completions", completions.completions, methods=["POST"]),
        Route("/v1/messages", messages.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
        Route("/v1/responses", responses.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
        Route("/tokenize", openai.tokenize, methods=["POST"]),
        Route("/detokenize", openai.detokenize, methods=["POST"]),
        Route("/api/v1/health", admin.health, methods=["GET"]),
        Route("/api/v1/status", admin.status, methods=["GET"]),
        Route("/api/v1/admin/configure", admin.configure, methods=["POST"]),
        Route("/api/v1/admin/start", admin.start, methods=["POST"]),
        Route("/api/v1/admin/stop", admin.stop, methods=["POST"]),
        Route("/api/v1/admin/restart", admin.restart, methods=["POST"]),
        Route("/api/v1/admin/checkpoint", admin.checkpoint, methods=["POST"]),
        Route("/api/v1/admin/resume_training", admin.resume_training, methods=["POST"]),
        Route("/api/v1/admin/adapters", admin.add_adapter, methods=["POST"]),
        Route("/api/v1/episodes", episodes.register, methods=["POST"]),
        Route("/api/v1/episodes", episodes.list_episodes, methods=["GET"]),
        Route("/api/v1/episodes/{episode_id}", episodes.get_episode, methods=["GET"]),
        Route("/api/v1/episodes/{episode_id}/report", episodes.report, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/abort", episodes.abort, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/prepare", episodes.prepare, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/commit", episodes.commit, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/demonstration", episodes.demonstration, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/timelines", episodes.timelines, methods=["GET"]),
        Route("/api/v1/clients/ready", episodes.client_ready, methods=["POST"]),
        Route("/api/v1/clients/heartbeat", episodes.client_heartbeat, methods=["POST"]),
        Route("/metrics", dashboard.prometheus, methods=["GET"]),
        *dashboard.routes(),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)  # type: ignore[arg-type]
    app.state.swarm = srv
    app.state.dashboard = LiveSource(srv)
    app.state.dashboard_sessions = Sessions()
    app.state.dashboard_metrics = MetricsTail()
    app.state.prometheus = ServerMetrics(srv, app.state.dashboard_metrics)  # one reader of metrics.jsonl
    app.add_middleware(UnexpectedErrors)  # inner: added first
    app.add_middleware(BodySizeLimit, max_bytes=srv.max_body_bytes)
    app.add_middleware(RequestTimer, metrics=app.state.prometheus)  # outer: times the 413s too
    return app


def create_monitor_app(source: DashboardSource, max_body_bytes: int = 64_000) -> Starlette:
    """An app that serves only the dashboard, over ``source`` (e.g. a finished run's folder:
    ``python -m swarmkit monitor RUN_DIR``)."""
    app = Starlette(routes=dashboard.routes(), exception_handlers=EXCEPTION_HANDLERS)  # type: ignore[arg-type]
    app.state.dashboard = source
    app.state.dashboard_sessions = Sessions()
    app.state.dashboard_metrics = MetricsTail()
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    return app
