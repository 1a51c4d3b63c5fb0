"""Serve a swarm server built from a config: in the foreground (``mode=server``) or in a thread."""

from __future__ import annotations

from typing import Any

from swarmkit.apps.wiring import build_server
from swarmkit.server.run import ServerThread, run_forever, run_in_thread


def serve(cfg: Any, **kwargs: Any) -> int:
    """``mode=server``: run a server (OFFLINE until configured) until interrupted; the exit status.

    ``kwargs`` go to :func:`~swarmkit.apps.wiring.build_server`.
    """
    srv, app = build_server(cfg, **kwargs)
    return run_forever(srv, app)


def start_server_thread(cfg: Any, *, announce: bool = False, timeout: float = 30.0,
                        **kwargs: Any) -> ServerThread:
    """A server in a daemon thread of this process, accepting connections when this returns.

    ``cfg`` is a full config or its ``server`` group; ``kwargs`` go to
    :func:`~swarmkit.apps.wiring.build_server` (e.g. ``config=`` a validated
    training config, ``backend_factory=``, ``cycle=``, ``train=False``).
    """
    srv, app = build_server(cfg, **kwargs)
    return run_in_thread(srv, app, announce=announce, timeout=timeout)
