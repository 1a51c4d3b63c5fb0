"""Running a built swarm server with uvicorn: in the foreground or in a thread.

:func:`run_forever` is what ``python -m swarmkit mode=server`` ends in: the
server on ``server.host:server.port`` (127.0.0.1 by default), printing its URL
and where its admin token is. :func:`run_in_thread` runs it in a background
thread of this process (``mode=local``, tests). Building the server (pool,
trainer) is the composition root's job: :mod:`swarmkit.apps.wiring`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette

from swarmkit.swarm.server import SwarmServer


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only then
    # (without it every answer waits ~40 ms for the peer's delayed ACK)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: Any, log_level: str = "warning") -> Any:
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on", timeout_keep_alive=30,
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def token_hint(srv: SwarmServer) -> str:
    """Where the server's admin token comes from (never the token itself)."""
    return {
        "config": "from server.admin_token",
        "env": "from $SWARMKIT_ADMIN_TOKEN",
    }.get(srv.admin_token_source, f"in {srv.admin_token_source}")


def _announce(srv: SwarmServer, file: Any = None, hint: str | None = None) -> None:
    file = file or sys.stdout
    print(f"swarmkit server listening on {srv.url} (state {srv.state.state})", file=file, flush=True)
    if hint:
        print(f"  {hint}", file=file, flush=True)
    print(f"  OpenAI-compatible endpoint: {srv.url}/v1 (one api_key per episode)", file=file, flush=True)
    print(f"  dashboard: {srv.url}/dashboard (log in with the token below)", file=file, flush=True)
    print(f"  admin token: {token_hint(srv)}", file=file, flush=True)
    if srv.run_dir is not None:
        print(f"  run dir: {srv.run_dir}", file=file, flush=True)


def _write_server_json(srv: SwarmServer) -> None:
    if srv.run_dir is None:
        return
    srv.run_dir.mkdir(parents=True, exist_ok=True)
    info = {"url": srv.url, "pid": os.getpid(), "admin_token_source": srv.admin_token_source}
    (srv.run_dir / "server.json").write_text(json.dumps(info, indent=2))


def serve_app(app: Starlette, host: str, port: int, announce: Callable[[str], None]) -> int:
    """Serve any app in the foreground on ``host:port`` (0: a free port); ``announce(url)`` once it
    is bound. Returns the exit status."""
    try:
        sock = _bind(host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc}", file=sys.stderr)
        return 2
    bound = sock.getsockname()[1]
    announce(f"http://{'[' + host + ']' if ':' in host else host}:{bound}")
    _uvicorn_server(app).run(sockets=[sock])
    return 0


def run_forever(srv: SwarmServer, app: Starlette, *, hint: str | None = None) -> int:
    """Run a server in the foreground until interrupted; returns the exit status. ``hint``: a line
    printed under the URL (whether it is configured, and how to configure it)."""
    try:
        sock = _bind(srv.host, srv.port)
    except OSError as exc:
        print(f"error: cannot listen on {srv.host}:{srv.port}: {exc}", file=sys.stderr)
        return 2
    srv.port = sock.getsockname()[1]
    _configure_torch_threads()
    server = _uvicorn_server(app)
    _announce(srv, hint=hint)
    _write_server_json(srv)
    server.run(sockets=[sock])
    return 0


def _configure_torch_threads() -> None:
    """Honour ``SWARMKIT_TORCH_THREADS`` (handy on small shared CPU boxes)."""
    n = os.environ.get("SWARMKIT_TORCH_THREADS")
    if n:
        try:
            import torch

            torch.set_num_threads(int(n))
        except (ImportError, ValueError):
            pass


class ServerThread:
    """A server running in a background thread; ``stop()`` shuts it down."""

    def __init__(self, swarm: SwarmServer, uv_server: Any):
        self.swarm = swarm
        self.uv = uv_server
        self.thread: threading.Thread | None = None
        #: the event loop the server runs on (set once its thread starts)
        self.loop: asyncio.AbstractEventLoop | None = None

    @property
    def url(self) -> str:
        return self.swarm.url

    @property
    def admin_token(self) -> str:
        return self.swarm.admin_token

    def stop(self, timeout: float = 10.0) -> None:
        self.uv.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_in_thread(srv: SwarmServer, app: Starlette, *, announce: bool = False,
                  timeout: float = 30.0) -> ServerThread:
    """Start a server in a daemon thread and wait until it accepts connections."""
    sock = _bind(srv.host, srv.port)
    srv.port = sock.getsockname()[1]
    uv = _uvicorn_server(app)
    handle = ServerThread(srv, uv)

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        handle.loop = loop
        try:
            loop.run_until_complete(uv.serve(sockets=[sock]))
        finally:
            loop.close()

    thread = threading.Thread(target=run, name="swarmkit-server", daemon=True)
    handle.thread = thread
    thread.start()
    end = time.monotonic() + timeout
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > end:
            raise RuntimeError(f"the swarm server did not start on {srv.url}")
        time.sleep(0.01)
    if announce:
        _announce(srv)
    _write_server_json(srv)
    return handle
