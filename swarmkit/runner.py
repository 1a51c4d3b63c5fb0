"""What each ``mode`` of the command line runs."""

from __future__ import annotations

import json

from omegaconf import DictConfig

from swarmkit.config.validate import to_dict


def run(cfg: DictConfig) -> int:
    if cfg.mode == "plan":
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    if cfg.mode == "server":
        return serve(cfg)
    print("resolved configuration:")
    print(json.dumps(to_dict(cfg), indent=2))
    print(f"mode={cfg.mode}: not implemented yet")
    return 0


def serve(cfg: DictConfig) -> int:
    """``mode=server``: a bare OFFLINE swarm server on ``server.host:server.port``."""
    from swarmkit.server.serve import serve as serve_forever

    return serve_forever(cfg)


def start_server_thread(cfg: DictConfig, **kwargs):
    """A swarm server in a background thread of this process (for ``mode=local``).

    ``kwargs`` go to :class:`swarmkit.server.app.SwarmServer` (``config=``,
    ``on_episode_accepted=``...). Returns a handle with ``url``,
    ``admin_token``, ``swarm`` and ``stop()``.
    """
    from swarmkit.server.serve import start_server_thread as start

    return start(cfg, **kwargs)
