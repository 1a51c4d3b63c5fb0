"""The roll/train cycle end to end: a real server process, several client processes.

Each batching policy C1-C5 must cycle ROLLING -> ROLLING_POST -> WEIGHT_SYNCING
-> ROLLING at least three times with real training steps (tiny model), and a
SIGKILLed server must come back with every accepted episode in its pool.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmkit.client import SwarmClient

TOKEN = "test-admin-token"
CYCLE = ["ROLLING", "ROLLING_POST", "WEIGHT_SYNCING", "ROLLING"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, SWARMKIT_TORCH_THREADS="1", HF_HUB_OFFLINE="1")


def start_server(run_dir: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}",
         f"server.run_dir={run_dir}", f"hydra.run.dir={run_dir}/hydra"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=open(run_dir / "server.err", "ab"),
    )
    client = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
    client.wait_for_state("OFFLINE", timeout=60)
    return proc


def start_clients(port: int, n: int, ready_every: int = 0, log_dir: Path | None = None) -> list[subprocess.Popen]:
    """``n`` task-client processes; with ``log_dir`` each one's stderr goes to ``client-<i>.err`` there."""
    def _err(i: int):
        return open(log_dir / f"client-{i}.err", "ab") if log_dir is not None else subprocess.DEVNULL

    return [
        subprocess.Popen(
            [sys.executable, "-m", "swarmkit.apps.task_client", "--url", f"http://127.0.0.1:{port}",
             "--task", "token_rule", "--train-size", "8", "--rollouts-per-task", "2",
             "--max-tokens", "4", "--concurrency", "2", "--ready-every", str(ready_every),
             "--client-id", f"client-{i}"],
            env=_env(), stdout=subprocess.DEVNULL, stderr=_err(i),
        )
        for i in range(n)
    ]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _started(port: int, overrides: list[str]) -> SwarmClient:
    """A controller of the server on ``port``, configured with ``overrides``, started and ROLLING."""
    ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
    ctl.configure(overrides)
    ctl.start()
    ctl.wait_for_state("ROLLING", timeout=120)
    return ctl


def _wait_step(ctl: SwarmClient, step: int, timeout: float, poll: float = 0.2) -> None:
    """Poll until the server's ``global_step`` reaches ``step`` (or ``timeout`` seconds pass)."""
    deadline = time.monotonic() + timeout
    while ctl.status()["global_step"] < step and time.monotonic() < deadline:
        time.sleep(poll)


def _logs(run_dir: Path) -> str:
    """The last lines of the server's and the clients' stderr in ``run_dir`` (for a failing assertion)."""
    parts = []
    for f in sorted(run_dir.glob("*.err")):
        lines = f.read_text(errors="replace").splitlines()[-15:]
        parts.append(f"--- {f.name}\n" + "\n".join(lines))
    return "\n".join(parts)


def _cycles(history: list[str]) -> int:
    n, i = 0, 0
    while i + 3 < len(history) + 0:
        if history[i:i + 4] == CYCLE:
            n += 1
            i += 3
        else:
            i += 1
    return n


@pytest.mark.parametrize("policy", ["c1", "c2", "c3", "c4", "c5"])
def test_each_policy_cycles_three_times(tmp_path, policy):
    port = _free_port()
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    try:
        ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
        ctl.configure(["model=tiny", "task=token_rule", f"batching={policy}", "batching.batch_size=2",
                       "batching.rollouts_per_task=2", "optim.lr=1e-3", "trainer.total_steps=3",
                       "batching.active_window_s=30"])
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=120)
        clients = start_clients(port, 2, ready_every=4 if policy in ("c4", "c5") else 0, log_dir=tmp_path)
        deadline = time.monotonic() + 120
        status = ctl.status()
        while status["global_step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.3)
            status = ctl.status()
        assert status["global_step"] >= 3, (status["clients"], status["pool"], _logs(tmp_path))
        assert _cycles(status["state_history"]) >= 3, status["state_history"]
        assert status["pool"]["trained"] >= 3 * (4 if policy in ("c1", "c2", "c3") else 1)
        assert status["clients"]["active"] == 2
    finally:
        _stop(clients)
        _stop([server])


def test_killed_server_loses_no_accepted_episode(tmp_path):
    port = _free_port()
    server = start_server(tmp_path, port)
    try:
        ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
        # a policy that cannot fire: every accepted episode stays in the pool
        ctl.configure(["model=tiny", "task=token_rule", "batching=c2", "batching.batch_size=1000"])
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=120)
        accepted = []
        for i in range(6):
            with ctl.episode(task_id=f"t{i % 3}") as ep:
                import httpx

                httpx.post(f"{ep.base_url}/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                           timeout=60).raise_for_status()
                ep.report(0.5 * (i % 2))
                accepted.append(ep.episode_id)
        assert ctl.status()["pool"]["episodes"] == 6
        server.send_signal(signal.SIGKILL)
        server.wait(10)

        server = start_server(tmp_path, port)
        ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
        assert ctl.status()["pool"]["episodes"] == 6
        from swarmkit.pool import SamplePool

        pool = SamplePool(tmp_path / "journal.sqlite")
        assert sorted(r.episode_id for r in pool.untrained()) == sorted(accepted)
        assert all(r.timelines for r in pool.untrained())
        pool.close()
    finally:
        _stop([server])


def test_resume_after_crash_loses_and_repeats_no_step(tmp_path):
    port = _free_port()
    overrides = ["model=tiny", "task=token_rule", "batching=c1", "batching.batch_size=1",
                 "batching.rollouts_per_task=2", "optim.lr=1e-3", "trainer.checkpoint_every=1",
                 "trainer.total_steps=2"]
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    try:
        ctl = _started(port, overrides)
        clients = start_clients(port, 1)
        _wait_step(ctl, 2, 90, poll=0.3)
        _stop(clients)
        time.sleep(1.0)  # the step-2 checkpoint is written right after the step
        trained_before = ctl.status()["pool"]["trained"]
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        assert (tmp_path / "checkpoints" / "latest").exists()

        server = start_server(tmp_path, port)
        ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
        ctl.configure([*overrides[:-1], "trainer.total_steps=3", "trainer.resume=true"])
        ctl.start()
        status = ctl.wait_for_state("ROLLING", timeout=120)
        assert status["global_step"] == 2, "resumed at the checkpointed step"
        assert status["pool"]["trained"] == trained_before
        clients = start_clients(port, 1)
        _wait_step(ctl, 3, 90, poll=0.3)
        assert ctl.status()["global_step"] == 3
    finally:
        _stop(clients)
        _stop([server])


def _journal_rows(path: Path) -> dict[str, tuple[str, int | None]]:
    import sqlite3

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {eid: (status, step) for eid, status, step in
                db.execute("SELECT episode_id, status, trained_step FROM episodes")}
    finally:
        db.close()


def test_async_server_killed_during_a_background_step_loses_and_repeats_nothing(tmp_path):
    """``trainer.mode=async``: the server is SIGKILLed while clients sample and the trainer steps
    in the background. On resume every journaled episode is there, none is recorded as trained by
    a step the checkpoint does not hold, and training goes on from the checkpointed step."""
    port = _free_port()
    overrides = ["model=tiny", "task=token_rule", "batching=c1", "batching.batch_size=2",
                 "batching.rollouts_per_task=2", "optim.lr=1e-3", "trainer.checkpoint_every=1",
                 "trainer.total_steps=0", "trainer.mode=async", "trainer.max_staleness=1"]
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    try:
        ctl = _started(port, overrides)
        clients = start_clients(port, 2)
        _wait_step(ctl, 4, 120, poll=0.05)
        status = ctl.status()
        assert status["state"] == "ROLLING" and status["pool"]["trainer"]["mode"] == "async", status
        server.send_signal(signal.SIGKILL)  # clients keep sampling: a step is (most likely) under way
        server.wait(10)
        before = _journal_rows(tmp_path / "journal.sqlite")
        checkpointed = int((tmp_path / "checkpoints" / "latest").read_text().strip().split("_")[1])
        assert checkpointed >= 3

        # resumed with no clients and a batch it cannot fill, so no step runs before the journal is read: with
        # the same batch the async trainer can step on the episodes put back at once, before ROLLING is seen
        # (a clean-clone CI run on 2026-12-07 read global_step 4 after a resume at 3)
        _stop(clients)
        server = start_server(tmp_path, port)
        ctl = _started(port, [*overrides, "trainer.resume=true", "batching.batch_size=1000"])
        assert ctl.status()["global_step"] == checkpointed, "resumed at the checkpointed step"
        after = _journal_rows(tmp_path / "journal.sqlite")
        assert set(after) >= set(before), "an accepted episode was lost"
        for eid, (st, step) in after.items():
            if st == "trained":
                assert step is not None and step <= checkpointed, (eid, st, step)
                assert before[eid] == (st, step)  # what the checkpoint holds stays recorded as it was
        lost_steps = {step for st, step in before.values() if st == "trained" and step > checkpointed}
        assert all(after[e][0] == "untrained" for e, (st, step) in before.items()
                   if st == "trained" and step in lost_steps), "episodes of unsaved steps go back to the pool"
        _stop([server])  # then on with the run's own batch, and the clients
        server = start_server(tmp_path, port)
        ctl = _started(port, [*overrides, "trainer.resume=true"])
        clients = start_clients(port, 2)
        _wait_step(ctl, checkpointed + 2, 90)
        assert ctl.status()["global_step"] >= checkpointed + 2
        final = _journal_rows(tmp_path / "journal.sqlite")
        steps = sorted({step for st, step in final.values() if st == "trained"})
        assert steps == list(range(1, steps[-1] + 1)), steps  # every step once, none skipped
    finally:
        _stop(clients)
        _stop([server])
