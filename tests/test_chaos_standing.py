"""The standing chaos test (issue 31): client and server kills, in sync and async training, with two
inference replicas, on a bounded budget, checked against every acknowledgement.

One real server process (tiny model, ``backend.replicas=2``, a checkpoint every step) and three task
client processes that log each episode the server acknowledged as accepted, with its reward. For
about 40 seconds a seeded schedule SIGKILLs clients (each restarted at once) and, twice, the server
(restarted on the same run folder with ``trainer.resume=true``, while the clients keep retrying).
Afterwards:

- every acknowledged episode is in the journal, with the reward its client reported;
- the journal records every step from 1 to the last exactly once (none skipped, none trained twice);
- the server trained on after each restart (its step moved past the checkpoint it resumed from).

Marked slow: it runs in ``.ci/run``'s slow step (about a minute and a half per mode).
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmkit.client import SwarmClient

pytestmark = pytest.mark.slow

TOKEN = "standing-chaos-token"
CHAOS_S = 40.0
SERVER_KILLS_AT = (12.0, 28.0)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, SWARMKIT_TORCH_THREADS="1", HF_HUB_OFFLINE="1")


def _server(run_dir: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}",
         f"hydra.run.dir={run_dir}/hydra"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=open(run_dir / "server.err", "ab"))


def _boot(port: int, overrides: list[str]) -> SwarmClient:
    ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=90)
    ctl.wait_for_state("OFFLINE", timeout=90)
    ctl.configure(overrides)
    ctl.start()
    ctl.wait_for_state("ROLLING", timeout=120)
    return ctl


def _client(port: int, task: str, log: Path, cid: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "swarmkit.apps.task_client", "--url", f"http://127.0.0.1:{port}", "--task", task,
         "--max-tokens", "4", "--rollouts-per-task", "2", "--train-size", "6", "--concurrency", "2",
         "--episode-log", str(log), "--client-id", cid],
        env=_env(), stdout=subprocess.DEVNULL, stderr=open(log.with_suffix(".err"), "ab"))


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGKILL)
    p.wait(15)


def _acknowledged(logs: list[Path]) -> dict[str, float]:
    out: dict[str, float] = {}
    for log in logs:
        if log.exists():
            for line in log.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if row.get("accepted"):
                        out[row["episode_id"]] = float(row["reward"])
    return out


def _journal(run_dir: Path) -> dict[str, tuple[str, int | None, float]]:
    db = sqlite3.connect(f"file:{run_dir / 'journal.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT episode_id, status, trained_step, reward FROM episodes").fetchall()
    finally:
        db.close()
    return {eid: (status, step, float(json.loads(reward))) for eid, status, step, reward in rows}


def _step(ctl: SwarmClient) -> int:
    return int(ctl.status()["global_step"])


def _wait_step(ctl: SwarmClient, at_least: int, timeout: float = 120.0) -> int:
    end = time.monotonic() + timeout
    step = -1
    while time.monotonic() < end:
        step = _step(ctl)
        if step >= at_least:
            return step
        time.sleep(0.2)
    raise AssertionError(f"the server stayed at step {step} (< {at_least})")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_standing_chaos_loses_nothing_and_trains_every_step_once(tmp_path, mode):
    from swarmkit.procs import free_port

    port = free_port()
    run_dir = tmp_path / "server"
    run_dir.mkdir()
    overrides = ["model=tiny", "batching=c1", "batching.batch_size=2", "batching.rollouts_per_task=2",
                 "optim.lr=1e-3", "trainer.checkpoint_every=1", "trainer.total_steps=0", f"trainer.mode={mode}",
                 "trainer.max_staleness=1", "backend.replicas=2", "server.episode_timeout_s=4",
                 "server.drain_timeout_s=3"]
    rng = random.Random(31)
    tasks = ["token_rule", "arithmetic", "calc_agent"]
    logs: list[Path] = []
    clients: dict[str, subprocess.Popen] = {}
    kills = {"client": 0, "server": 0}
    resumed_at: list[int] = []

    def start_client(task: str) -> None:
        log = tmp_path / f"{task}-{len(logs)}.jsonl"
        logs.append(log)
        clients[task] = _client(port, task, log, f"chaos-{task}")  # a restarted client keeps its id

    server = _server(run_dir, port)
    try:
        ctl = _boot(port, overrides)
        for task in tasks:
            start_client(task)
        _wait_step(ctl, 1)
        t0 = time.monotonic()
        pending_server_kills = list(SERVER_KILLS_AT)
        while time.monotonic() - t0 < CHAOS_S or pending_server_kills:
            time.sleep(rng.uniform(1.0, 3.0))
            if pending_server_kills and time.monotonic() - t0 >= pending_server_kills[0]:
                pending_server_kills.pop(0)
                _kill(server)  # mid-rollout or mid-step: whatever it was doing
                kills["server"] += 1
                server = _server(run_dir, port)
                ctl = _boot(port, [*overrides, "trainer.resume=true"])
                resumed_at.append(_step(ctl))
                continue
            victim = rng.choice(tasks)
            _kill(clients[victim])
            kills["client"] += 1
            start_client(victim)
            assert server.poll() is None, "the server died"
        assert kills["server"] == len(SERVER_KILLS_AT)
        final = _wait_step(ctl, resumed_at[-1] + 2)  # it trains on after the last restart
    finally:
        for p in clients.values():
            _kill(p)
        _kill(server)

    acknowledged = _acknowledged(logs)
    journal = _journal(run_dir)
    assert len(acknowledged) >= 10, len(acknowledged)
    lost = set(acknowledged) - set(journal)
    assert not lost, f"{len(lost)} of {len(acknowledged)} acknowledged episodes are not in the journal"
    mismatched = {e for e, r in acknowledged.items() if journal[e][2] != pytest.approx(r)}
    assert not mismatched, f"rewards differ from what the clients reported: {sorted(mismatched)[:5]}"
    steps = sorted({step for status, step, _ in journal.values() if status == "trained" and step is not None})
    assert steps == list(range(1, steps[-1] + 1)), steps  # every step once, none skipped
    assert steps[-1] >= final - 1
    print(f"standing chaos ({mode}): {kills['client']} client and {kills['server']} server SIGKILLs, resumed at "
          f"steps {resumed_at}, {len(acknowledged)} acknowledged episodes all in the journal with their rewards, "
          f"steps 1..{steps[-1]} each once")
