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
    if cfg.mode == "client":
        return run_client(cfg)
    from swarmkit.local import run_local

    return run_local(cfg)


def run_client(cfg: DictConfig) -> int:
    """``mode=client``: the example client against ``http://server.host:server.port``."""
    from swarmkit.client.example import main as client_main

    return client_main([
        "--url", f"http://{cfg.server.host}:{cfg.server.port}",
        "--task", str(cfg.task.name),
        "--train-size", str(cfg.task.train_size),
        "--rollouts-per-task", str(cfg.batching.rollouts_per_task),
        "--max-tokens", str(cfg.task.max_tokens),
        "--concurrency", str(cfg.task.concurrency),
    ])


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
