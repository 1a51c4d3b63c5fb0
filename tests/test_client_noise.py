"""The task client logs at a sane level (issue 36): ``mode=client`` said a line per HTTP request (httpx),
per retry while the server synced weights and per episode (47,314 lines in 5 minutes), and against an
unconfigured server retried ``server in OFFLINE`` about 8 lines a second without saying what to do."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from swarmkit.client._common import RetryEvent, RetryNotes

TOKEN = "noise-admin-token-0123"


def _event(state: str | None, status: int | None = 503) -> RetryEvent:
    return RetryEvent("POST", "/api/v1/episodes", 2, 1.0, 0.1, f"503 server_{(state or 'busy').lower()}: x",
                      status, state)


def test_retries_are_debug_with_a_line_a_minute_at_info(caplog):
    now = [0.0]
    notes = RetryNotes(clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="swarmkit.client")
    for _ in range(300):  # 8 threads retrying an OFFLINE server, ~2.5 minutes
        notes.log(_event("OFFLINE"))
        notes.log(_event("ROLLING_POST"))
        now[0] += 0.5
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    offline = [m for m in info if "OFFLINE" in m]
    assert len(offline) == 3 and len(info) == 6  # at 0, 60 and 120 s, for each kind
    assert "a controller must configure and start it" in offline[0] and ".configure(" in offline[0]
    assert "119 more such retries in the last 60 s" in offline[1]
    assert "training a step (normal)" in info[1]
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 600 - 6


def _client(port: int, run_dir, *extra: str) -> list[str]:
    return [sys.executable, "-m", "swarmkit", "mode=client", f"server.port={port}", "model=tiny", "task=token_rule",
            "task.max_tokens=4", "task.concurrency=4", "batching.rollouts_per_task=4", f"hydra.run.dir={run_dir}",
            *extra]


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1", SWARMKIT_ADMIN_TOKEN=TOKEN)


def test_a_client_of_an_offline_server_says_once_what_it_needs(tmp_path):
    from swarmkit.apps.serve import start_server_thread

    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path / "server")}})
    try:
        proc = subprocess.Popen(_client(int(h.url.rsplit(":", 1)[1]), tmp_path / "client"), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=_env())
        time.sleep(8)  # ~60 retries of 4 threads at the old rate of a line each
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    finally:
        h.stop()
    lines = out.splitlines()
    hints = [line for line in lines if "a controller must configure and start it" in line]
    assert len(hints) == 1, out
    assert "OFFLINE" in hints[0] and "python -m swarmkit" in hints[0]
    assert len(lines) <= 6, out


@pytest.fixture()
def training_server(train_cfg, tmp_path):
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient

    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.backend.device = "cpu"
    cfg.logger = []
    cfg.trainer.total_steps = 6
    cfg.batching.batch_size = 2
    cfg.batching.rollouts_per_task = 4
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path / "server")}}, config=cfg)
    try:
        with SwarmClient(h.url, token=TOKEN) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=120)
            yield h, c
    finally:
        h.stop()


def test_a_client_of_a_training_server_prints_a_few_lines(training_server, tmp_path):
    """Six training steps (48+ episodes, ~150 HTTP requests, six weight syncs), output piped: a handful
    of lines, none from httpx, none per episode."""
    h, c = training_server
    out = subprocess.run(_client(int(h.url.rsplit(":", 1)[1]), tmp_path / "client"), capture_output=True, text=True, env=_env(),
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert c.status()["global_step"] >= 6
    lines = (out.stdout + out.stderr).splitlines()
    assert not [line for line in lines if "httpx" in line or "HTTP Request" in line], lines[:5]
    assert not [line for line in lines if ": reward " in line], lines[:5]
    assert any("episodes in" in line and "mean reward" in line for line in lines), lines  # the final summary
    assert len(lines) <= 12, "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_closing_the_client_ends_retries_in_other_threads():
    """A client closed (Ctrl-C, a shutdown) while another thread retries an unreachable server: that
    request gives up at once instead of sitting out ``retry_for``."""
    import threading

    from swarmkit.client import SwarmClient, SwarmError

    client = SwarmClient(f"http://127.0.0.1:{_free_port()}", retry_for=300)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            client.health()
        except BaseException as exc:  # noqa: BLE001
            raised.append(exc)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    time.sleep(0.8)  # a few retries in
    t0 = time.monotonic()
    client.close()
    t.join(5)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert isinstance(raised[0], SwarmError) and "closed while retrying" in str(raised[0])


def test_ctrl_c_stops_mode_client_at_once(tmp_path):
    """Ctrl-C on ``mode=client`` retrying an unreachable server: it exits 130 within seconds, saying so,
    no traceback (it sat out its 900 s retry budget per running episode)."""
    import signal

    from conftest import interruptible

    p = subprocess.Popen(_client(_free_port(), tmp_path / "c"), env=_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, cwd=tmp_path, preexec_fn=interruptible)
    seen = []
    try:
        assert p.stdout is not None
        for line in p.stdout:  # the SDK says the first retry (a loaded machine may take seconds to get there)
            seen.append(line)
            if "retrying" in line:
                break
        p.send_signal(signal.SIGINT)
        rest, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    out = "".join(seen) + (rest or "")
    assert p.returncode == 130, out[-2000:]
    assert "Traceback" not in out and "interrupted" in out
