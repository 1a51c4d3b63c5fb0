"""A normal run's console is quiet (issue 36): no WARNING on a normal end, no drain line per step."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from types import SimpleNamespace

from swarmkit.swarm import server as server_mod


class _Episodes:
    """One running episode that ends ``seconds`` after the drain starts."""

    def __init__(self, seconds: float):
        self.until = time.time() + seconds
        self.ep = SimpleNamespace(id="ep-1", task_id="t-0", client_id="c-1", eval=False, running=True)

    def running(self):
        return [self.ep] if time.time() < self.until else []


def _drain(seconds: float) -> int:
    fake = SimpleNamespace(drain_timeout_s=60.0, drain_idle_s=30.0, episodes=_Episodes(seconds),
                           abandoned=lambda ep, now: False)
    return asyncio.run(server_mod.SwarmServer.drain(fake))  # type: ignore[arg-type]


def test_a_drain_of_a_few_seconds_is_logged_at_debug_only(caplog):
    with caplog.at_level(logging.DEBUG, logger="swarmkit.server"):
        assert _drain(1.3) == 0
    drains = [r for r in caplog.records if "draining before the step" in r.getMessage()]
    assert [r.levelno for r in drains] == [logging.DEBUG]


def test_an_unusually_long_drain_says_at_info_what_it_waits_for(caplog, monkeypatch):
    monkeypatch.setattr(server_mod, "SLOW_DRAIN_S", 1.2)
    with caplog.at_level(logging.DEBUG, logger="swarmkit.server"):
        _drain(1.5)
    drains = [r for r in caplog.records if "draining before the step" in r.getMessage()]
    assert [r.levelno for r in drains] == [logging.DEBUG, logging.INFO]
    assert "ep-1 (t-0, c-1)" in drains[-1].getMessage()


def test_the_main_job_console_has_no_warning_on_a_normal_run(tmp_path):
    """The tiny model on a task it learns (the default one gives it reward 0 everywhere: a collapse alarm
    is right there) to its step limit, output piped: no WARNING line (the normal end, ``training
    finished``, is INFO), no drain line."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "swarmkit", "model=tiny", "task=token_rule", "task.eval_size=4",
         "task.max_tokens=8", "batching.batch_size=4", "batching.rollouts_per_task=8", "optim.lr=1e-2",
         "trainer.total_steps=6", "server.port=0",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    console = out.stdout + out.stderr
    assert "step   6" in out.stdout
    # swarmkit's own lines (a library imported along the way may warn in its own format: DeepSpeed, when
    # installed, says at import that it set its accelerator to CPU)
    ours = [line for line in console.splitlines() if "WARNING" in line and "[swarmkit" in line]
    assert not ours
    assert "draining before the step" not in console
    # transformers' progress bars (a load, every checkpoint) are off; one stop is one line
    assert "Loading weights" not in console and "Writing model shards" not in console
    assert console.count("server stopped in") == 1, console
    log = (tmp_path / "cli.log").read_text()
    assert not [line for line in log.splitlines() if "[WARNING]" in line and "[swarmkit" in line]


def test_training_finished_is_info(caplog):
    from swarmkit.swarm.cycle import TrainingCycle

    fake = SimpleNamespace(total_steps=2, global_step=2, training_finished=None)
    # the logger's own level too: the main job run in-process earlier (tests/test_main_job.py) quiets it
    with caplog.at_level(logging.DEBUG, logger="swarmkit.cycle"):
        assert TrainingCycle._limit_reached(fake)  # type: ignore[arg-type]
    [record] = [r for r in caplog.records if "training finished" in r.getMessage()]
    assert record.levelno == logging.INFO


def test_the_main_jobs_quiet_loggers_get_their_levels_back():
    """run_local quiets httpx & co. for the job only: a program that runs a main job in-process (a test,
    a notebook) keeps its own logging levels afterwards."""
    import logging

    from swarmkit.apps.quiet import QUIET_LOGGERS, quiet_loggers

    loggers = [logging.getLogger(n) for n in QUIET_LOGGERS]
    before = [lg.level for lg in loggers]
    try:
        loggers[0].setLevel(logging.DEBUG)
        with quiet_loggers():
            assert all(lg.level == logging.WARNING for lg in loggers)
        assert loggers[0].level == logging.DEBUG
        assert [lg.level for lg in loggers[1:]] == before[1:]
    finally:
        for lg, lvl in zip(loggers, before, strict=True):
            lg.setLevel(lvl)


def test_the_end_of_training_is_said_once_however_many_episodes_learn_it(caplog):
    """Several running episodes get 409 training_finished at once: one line, not one per episode."""
    from concurrent.futures import Future

    from swarmkit.apps.task_client import EpisodeLoop
    from swarmkit.client import SwarmAPIError

    loop = EpisodeLoop([], rollouts_per_task=1)
    with caplog.at_level(logging.DEBUG, logger="swarmkit.apps.task_client"):
        for _ in range(3):
            fut: Future = Future()
            fut.set_exception(SwarmAPIError(409, "training finished", "training_finished"))
            loop._collect(fut, None, None)  # type: ignore[arg-type]
    assert loop.stop_event.is_set() and loop.failures == 0
    assert [r.getMessage() for r in caplog.records].count("the server finished training; the loop stops sampling") == 1
