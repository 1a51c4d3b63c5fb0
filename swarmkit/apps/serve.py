"""Serve a swarm server built from a config: in the foreground (``mode=server``) or in a thread."""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette

from swarmkit.apps.wiring import build_server
from swarmkit.server.run import ServerThread, run_forever, run_in_thread
from swarmkit.swarm.server import SwarmServer


def serve(cfg: Any, *, command_line: Sequence[str] = (), **kwargs: Any) -> int:
    """``mode=server``: run a server until interrupted; the exit status.

    :param command_line: the training overrides its command line gave (``model=tiny optim.lr=1e-3``):
        the server is configured with ``cfg`` (as ``POST /api/v1/admin/configure`` with those overrides
        would) and starts at once. None: it waits OFFLINE for a controller to configure and start it.
    :param kwargs: go to :func:`~swarmkit.apps.wiring.build_server`.
    """
    if command_line:
        kwargs.setdefault("config", cfg)
    srv, app = build_server(cfg, **kwargs)
    if command_line:
        start_on_startup(app, srv)
        follow = f"python -m swarmkit status {shlex.quote(str(srv.run_dir))} --watch" if srv.run_dir else \
            "python -m swarmkit status --url URL --watch"
        hint = (f"configured from the command line ({shlex.join(command_line)}): booting, then ROLLING "
                f"({follow} follows it)")
    else:
        hint = ("not configured (OFFLINE): configure and start it from a controller, e.g. "
                "SwarmClient(URL, token=ADMIN_TOKEN).configure([\"model=tiny\"]) then .start() "
                "(README \"Run a server\"), or give the training overrides on its command line: "
                "python -m swarmkit mode=server model=tiny ...")
    return run_forever(srv, app, hint=hint)


def start_on_startup(app: Starlette, srv: SwarmServer) -> None:
    """Start ``srv`` (configured) as soon as ``app`` serves: after its own startup, in its event loop."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[Any]:
        async with inner(a) as state:
            srv.start()
            yield state

    app.router.lifespan_context = lifespan


def start_server_thread(cfg: Any, *, announce: bool = False, timeout: float = 30.0,
                        **kwargs: Any) -> ServerThread:
    """A server in a daemon thread of this process, accepting connections when this returns.

    ``cfg`` is a full config or its ``server`` group; ``kwargs`` go to
    :func:`~swarmkit.apps.wiring.build_server` (e.g. ``config=`` a validated
    training config, ``backend_factory=``, ``cycle=``, ``train=False``).
    """
    srv, app = build_server(cfg, **kwargs)
    return run_in_thread(srv, app, announce=announce, timeout=timeout)
