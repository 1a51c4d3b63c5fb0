"""Swarm servers as local processes: start, configure, boot and watch them (multi-server scripts, tests).

Each :class:`ServerProc` is one ``python -m swarmkit mode=server`` process on
127.0.0.1 with its own run dir and log; :func:`boot_servers` configures them
over the controller API and starts them in parallel; :func:`watch` prints one
line per training step of each until they reach a step. Used by
``examples/multi_model`` and ``examples/who_is_spy`` and their tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from swarmkit.apps.task_client import EpisodeLoop
from swarmkit.client import SwarmClient
from swarmkit.procs import free_port
from swarmkit.swarm.metrics import read_metrics

#: the admin token of servers started without one
DEFAULT_TOKEN = "swarmkit-local-token"


@dataclass
class ServerProc:
    """One ``python -m swarmkit mode=server`` process."""

    role: str
    url: str
    run_dir: Path
    proc: subprocess.Popen
    token: str
    device: str = "cpu"
    model_path: str = ""

    def client(self, retry_for: float = 120.0) -> SwarmClient:
        return SwarmClient(self.url, token=self.token, retry_for=retry_for, client_id=f"controller-{self.role}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def server_env(token: str, device: str = "cpu") -> dict[str, str]:
    """The environment of a server process: its admin token, offline hub, one torch thread on CPU."""
    env = dict(os.environ, SWARMKIT_ADMIN_TOKEN=token, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("SWARMKIT_TORCH_THREADS", "1" if device in ("cpu", "auto") else "4")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def launch_server(role: str, run_dir: Path, *, token: str = DEFAULT_TOKEN, device: str = "cpu",
                  extra: Sequence[str] = (), env: dict[str, str] | None = None) -> ServerProc:
    """Start a bare (OFFLINE) server process; :func:`boot_servers` configures and starts it."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "swarmkit", "mode=server", "server.host=127.0.0.1", f"server.port={port}",
           f"server.run_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra", *extra]
    log = open(run_dir / "server.log", "ab")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, env={**server_env(token, device), **(env or {})}, stdout=log,
                            stderr=subprocess.STDOUT)
    return ServerProc(role, f"http://127.0.0.1:{port}", run_dir, proc, token, device)


def boot_servers(servers: Sequence[ServerProc], overrides: dict[str, list[str]], timeout: float = 300.0) -> None:
    """Configure and start every server, then wait until all are ROLLING (boots run in parallel)."""
    for s in servers:
        s.client(retry_for=timeout).wait_for_state("OFFLINE", timeout=timeout)
    for s in servers:
        ctl = s.client()
        ctl.configure(overrides[s.role])
        ctl.start()
    for s in servers:
        s.client().wait_for_state("ROLLING", timeout=timeout)


def step_line(role: str, m: dict[str, Any]) -> str:
    """One line of a server's training step (its metrics from the status's ``pool.last_step``)."""
    loss = (f"sft nll {m['sft_nll']:.4f}" if m.get("sft_nll") is not None and m.get("demo_samples") == m.get("samples")
            else f"loss {m.get('loss', float('nan')):+.4f}")
    adapter = next((k.split("/")[1] for k in m if k.startswith("adapter/") and k.endswith("/step")), None)
    who = f"[server {role}{f' adapter {adapter}' if adapter else ''}]"
    return (f"{who} step {int(m['step']):>3}  reward {m.get('reward_mean', float('nan')):.3f}  "
            f"{loss}  samples {int(m.get('samples', 0))}  "
            f"step {m.get('cycle_time_s', 0.0):.2f}s (weight sync {m.get('weight_sync_s', 0.0):.3f}s)")


def watch(servers: Sequence[ServerProc], steps: int, timeout: float, client: EpisodeLoop | None = None,
          out: TextIO = sys.stdout) -> dict[str, list[dict[str, Any]]]:
    """Print one line per training step of each server until all reached ``steps``; returns the metrics.

    Every step's row is read from the server's ``metrics.jsonl`` (steps come faster than a
    status poll with asynchronous training); the status's ``last_step`` when there is none.
    """
    ctls = {s.role: s.client() for s in servers}
    run_dirs = {s.role: s.run_dir for s in servers}
    seen: dict[str, list[dict[str, Any]]] = {s.role: [] for s in servers}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        done = True
        for role, ctl in ctls.items():
            st = ctl.status()
            last = (st.get("pool") or {}).get("last_step")
            new = [r for r in read_metrics(run_dirs[role]) if r.get("kind", "train") == "train"][len(seen[role]):]
            if not new and last and (not seen[role] or int(last["step"]) > int(seen[role][-1]["step"])):
                new = [last]
            for row in new:
                seen[role].append(row)
                print(step_line(role, row), file=out, flush=True)
            if st["state"] == "OFFLINE":
                raise RuntimeError(f"server {role} went OFFLINE: {st.get('last_error')}")
            done = done and int(st["global_step"]) >= steps
        if done:
            return seen
        if client is not None and client.last_error and client.failures % 20 == 1:
            print(f"  (client: {client.failures} failed episodes; last: {client.last_error})", file=out)
        time.sleep(0.25)
    raise TimeoutError(f"not every server reached step {steps} in {timeout:g} s: "
                       + ", ".join(f"{r}: {len(v)} steps" for r, v in seen.items()))

