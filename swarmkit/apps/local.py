"""``mode=local`` (the default job): a whole swarm on this machine.

The main job of :mod:`swarmkit.apps.main_job` with :class:`LocalDriver`: a
swarm server in a thread of this process (configured through the same
controller API a remote controller uses) and the built-in task client in
threads next to it. It evaluates the model on held-out tasks, trains until
``trainer.total_steps`` optimizer steps are done (one metrics line per step,
an evaluation every ``trainer.eval_every`` steps), evaluates again and prints a
summary. Everything lands in the run folder: ``metrics.jsonl``,
``states.jsonl``, ``tensorboard/`` (the default logger), ``journal.sqlite``,
``checkpoints/``, ``summary.json``; the dashboard's URL is printed at start.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from swarmkit.apps.main_job import (
    JobError,
    Sampler,
    ServerInfo,
    ServerSession,
    console,
    run_main_job,
)
from swarmkit.apps.quiet import quiet_loggers
from swarmkit.apps.task_client import EvalResult
from swarmkit.server.run import token_hint

#: one line per request is noise next to the per-step lines; the client's retry lines too (the status bar
#: shows the state), and the server's own step lines (the job prints its step lines with the pool's fill)


class LocalDriver:
    """One server in a thread of this process and one :class:`~swarmkit.apps.main_job.Sampler` (the task
    client's ``task.concurrency`` episodes in threads) against it."""

    launcher = "local"
    namespace: str | None = None

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.server: ServerSession | None = None
        self.sampler: Sampler | None = None

    def _server(self, k: int) -> ServerSession:
        assert k == 0 and self.server is not None, k
        return self.server

    def start(self) -> list[ServerInfo]:
        run_dir = Path(str(self.cfg.server.run_dir))
        run_dir.mkdir(parents=True, exist_ok=True)
        self.server = server = ServerSession(self.cfg)
        console.print(f"[bold]swarmkit[/] local swarm: server {server.handle.url}  run dir {run_dir}")
        console.print(f"dashboard: {server.handle.url}/dashboard (admin token {token_hint(server.handle.swarm)})")
        self.sampler = Sampler(server.ctl, self.cfg)
        return [ServerInfo(0, self.cfg, server.handle.url)]

    def boot(self, k: int) -> None:
        self._server(k).boot()

    def warm_start(self, k: int) -> int:
        return self._server(k).warm_start()

    def evaluate(self, k: int) -> EvalResult:
        return self._server(k).evaluate()

    def status(self, k: int) -> dict[str, Any]:
        return self._server(k).status()

    def metrics(self, k: int, after_step: int) -> list[dict[str, Any]]:
        return self._server(k).metrics(after_step)

    def checkpoint(self, k: int) -> dict[str, Any]:
        return self._server(k).checkpoint()

    def start_clients(self, k: int, seed: int) -> None:
        assert self.sampler is not None
        self.sampler.start(seed)

    def stop_clients(self, k: int) -> None:
        if self.sampler is not None:
            self.sampler.stop()

    def check_clients(self, k: int) -> None:
        """Client threads do not die (a failed episode is counted and the loop goes on)."""

    def clients(self, k: int) -> list[dict[str, Any]]:
        finished = self.sampler.finished if self.sampler else 0
        return [{"slot": 0, "name": "local", "replacements": 0, "finished": finished, "nodes": []}]

    def stop(self) -> None:
        """The server first (the controller's calls share the sampler's client), then the sampler, whose
        episodes still running (a job that failed midway) give up their retries at once: an exit never
        waits out a client's hour of retrying a server that is gone."""
        if self.server is not None:
            self.server.shutdown()
        if self.sampler is not None:
            self.sampler.stop(abandon=True)


def run_local(cfg: DictConfig) -> int:
    """``mode=local``: the main job on this machine; the exit status (1: the job could not go on, such as a
    server that went OFFLINE because its engine failed; the error is printed)."""
    with quiet_loggers():
        try:
            return run_main_job(LocalDriver(cfg), cfg)
        except JobError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
