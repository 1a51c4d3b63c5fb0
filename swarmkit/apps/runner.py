"""What each ``mode`` of the command line runs."""

from __future__ import annotations

import json
from collections.abc import Sequence

from omegaconf import DictConfig

from swarmkit.apps.local import run_local
from swarmkit.apps.serve import serve
from swarmkit.apps.task_client import main as client_main
from swarmkit.config.validate import to_dict


def run(cfg: DictConfig, *, server_overrides: Sequence[str] = ()) -> int:
    """Run the validated config's ``mode``; returns the exit status.

    :param server_overrides: ``mode=server``'s training overrides from its command line: given, the
        server configures itself from ``cfg`` and starts; none, it waits OFFLINE for the admin API.
    """
    if cfg.mode == "plan":
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    if cfg.mode == "server":
        return serve(cfg, command_line=server_overrides)
    if cfg.mode == "client":
        return run_client(cfg)
    if cfg.get("launcher", "local") == "ray":
        from swarmkit.apps.ray_launcher import run_ray

        return run_ray(cfg)
    return run_local(cfg)


def _hydra_verbose() -> bool:
    """Whether Hydra's ``hydra.verbose`` is set (its usual switch for DEBUG logs)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return bool(HydraConfig.get().verbose)
    except (ImportError, ValueError):  # not under Hydra
        return False


def run_client(cfg: DictConfig) -> int:
    """``mode=client``: the task client against ``http://server.host:server.port`` (a summary line at most
    every 30 s; ``hydra.verbose=true``: a line per episode, request and retry)."""
    return client_main([*(["--verbose"] if _hydra_verbose() else []),
        "--url", f"http://{cfg.server.host}:{cfg.server.port}",
        "--task", str(cfg.task.name),
        "--train-size", str(cfg.task.train_size),
        "--rollouts-per-task", str(cfg.batching.rollouts_per_task),
        "--max-tokens", str(cfg.task.max_tokens),
        "--concurrency", str(cfg.task.concurrency),
    ])
