"""A step is trained once (issue 18, item 4): when the journal cannot record a step (a full disk),
the batch is not released to be trained again, ``global_step`` never goes back, the real SQLite
error is reported, and the write goes through once the journal takes writes again.

The journal test fills the database for real (``max_page_count``: SQLite answers SQLITE_FULL and
rolls the transaction back itself, as on a full disk). The server test needs the failure on the
step's two rows exactly, so SQLite refuses the step's UPDATE through its authorizer instead."""

from __future__ import annotations

import random
import sqlite3
import time

import pytest
from omegaconf import OmegaConf

from swarmkit.apps.serve import start_server_thread
from swarmkit.client import ServerUnavailable, SwarmClient
from swarmkit.pool.journal import SamplePool
from swarmkit.pool.records import EpisodeRecord
from swarmkit.swarm.cycle import TrainingCycle
from swarmkit.testing.scripted import ScriptedBackend

TOKEN = "exactly-once-test-token"


def _fill_disk(db: sqlite3.Connection) -> None:
    """The database may not grow by one page: SQLite answers SQLITE_FULL, as on a full disk."""
    n = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count={n}")


def _free_disk(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA max_page_count=1073741823")


def _refuse_updates(pool: SamplePool, refuse: bool) -> None:
    """SQLite refuses (``not authorized``) every UPDATE of the journal while ``refuse``."""
    with pool._lock:
        pool._db.set_authorizer(
            (lambda action, *_: sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_UPDATE else sqlite3.SQLITE_OK)
            if refuse else None)


def test_a_full_disk_surfaces_as_itself_not_as_a_rollback_error(tmp_path):
    pool = SamplePool(tmp_path / "journal.sqlite")
    rng = random.Random(0)
    for i in range(300):
        pool.add(EpisodeRecord(f"e{i}", "t", "c", 1.0, [{"pad": "x" * rng.randrange(200, 900)}], 0))
    _fill_disk(pool._db)
    with pytest.raises(sqlite3.OperationalError, match="full"):  # was: "cannot rollback - no transaction is active"
        pool.mark_trained([f"e{i}" for i in range(300)], 1)
    assert len(pool) == 300 and pool.stats()["trained"] == 0  # nothing half-written
    _free_disk(pool._db)
    assert pool.mark_trained([f"e{i}" for i in range(300)], 1) == 300


class _Trainer:
    """Stands in for the trainer: counts which episodes each step trained on; ``on_step`` runs
    while the step is under way (the disk fills up then)."""

    def __init__(self) -> None:
        self.global_step = 0
        self.trained: list[str] = []
        self.on_step = lambda: None

    def step(self, records):
        self.on_step()
        self.trained += [r.episode_id for r in records]
        self.global_step += 1
        return {"loss": 0.1}

    def export_weights(self):
        return iter(())

    def latest_checkpoint(self):
        return None

    def close(self):
        pass


def _start(cfg, tmp_path, cycle):
    """A real server on a scripted backend (one reply, "ok") with ``cycle`` as its training cycle."""
    from swarmkit.models import build_tiny_tokenizer

    return start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                           "run_dir": str(tmp_path)}},
                               config=cfg, backend_factory=lambda c: ScriptedBackend(build_tiny_tokenizer(),
                                                                                     replies=["ok"]),
                               cycle=cycle)


def _one_group_cfg(train_cfg):
    """The tiny config, no step limit, a step per group of two episodes of one task."""
    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.batching.batch_size, cfg.batching.rollouts_per_task = 1, 2
    cfg.trainer.total_steps = 0
    return cfg


def _no_step_cfg(train_cfg, **server):
    """The tiny config, no step limit, a batch no test fills (episodes stay in the pool); ``server`` limits."""
    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.batching.batch_size, cfg.batching.rollouts_per_task = 100, 2
    cfg.trainer.total_steps = 0
    for key, value in server.items():
        cfg.server[key] = value
    return cfg


def test_a_step_the_journal_cannot_record_is_not_trained_twice(train_cfg, tmp_path):
    cfg = _one_group_cfg(train_cfg)
    trainer = _Trainer()
    cycle = TrainingCycle(tmp_path, trainer_factory=lambda c, d: trainer)
    cycle.journal_attempts = 2
    h = _start(cfg, tmp_path, cycle)

    def wait(cond, what, timeout=20.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            st = c.status()
            if cond(st):
                return st
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}: {st}")

    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=20) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            trainer.on_step = lambda: _refuse_updates(cycle.pool, True)  # the journal fails during step 1
            first = []
            for _ in range(2):
                with c.episode("task-a") as ep:
                    ep.report(0.5)
                    first.append(ep.episode_id)
            # the error is set while the step still runs (WEIGHT_SYNCING): wait for the step to end too
            st = wait(lambda s: "journal could not record" in (s["pool"].get("last_error") or "")
                      and s["state"] == "ROLLING", "the error, after the step")
            assert "not authorized" in st["pool"]["last_error"]  # SQLite's own error, not a masking one
            assert st["global_step"] == 1 and st["state"] == "ROLLING"
            time.sleep(1.0)  # the batch is not offered again while the write is pending
            assert sorted(trainer.trained) == sorted(first) and trainer.global_step == 1
            assert c.status()["global_step"] == 1

            trainer.on_step = lambda: None
            _refuse_updates(cycle.pool, False)  # the journal takes writes again: the pending one goes through
            second = []
            for _ in range(2):
                with c.episode("task-b") as ep:
                    ep.report(0.5)
                    second.append(ep.episode_id)
            st = wait(lambda s: s["global_step"] == 2, "step 2")
            assert not st["pool"].get("last_error")
            assert sorted(trainer.trained) == sorted(first + second)  # each episode trained once
            assert {cycle.pool.get(e).trained_step for e in first} == {1}
            assert {cycle.pool.get(e).trained_step for e in second} == {2}
    finally:
        h.stop()


def test_a_report_the_journal_cannot_store_names_the_error_in_the_status(train_cfg, tmp_path):
    """Issue 31: while the journal could not be written (a full disk), reports answered 503 but ``last_error``
    stayed empty, though reliability.md promises SQLite's own error there."""
    cycle = TrainingCycle(tmp_path, trainer_factory=lambda c, d: _Trainer())
    h = _start(_no_step_cfg(train_cfg), tmp_path, cycle)
    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=1) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            with cycle.pool._lock:
                _fill_disk(cycle.pool._db)
            ep = c.register("task-full")
            with pytest.raises(ServerUnavailable, match="503 pool_unavailable"):
                c._call("POST", f"/api/v1/episodes/{ep.episode_id}/report", json_body={"reward": 0.5, "meta":
                        {"pad": "x" * 60_000}}, key=ep.api_key)
            err = c.status()["pool"].get("last_error") or ""
            assert "full" in err and ep.episode_id in err, err
            with cycle.pool._lock:
                _free_disk(cycle.pool._db)
            c._call("POST", f"/api/v1/episodes/{ep.episode_id}/report", json_body={"reward": 0.5}, key=ep.api_key)
            assert cycle.pool.get(ep.episode_id) is not None
            assert not c.status()["pool"].get("last_error")
    finally:
        h.stop()


def test_the_journal_has_a_quota(train_cfg, tmp_path):
    """Issue 31: the journal grew without bound (10.3 MB/s with 64 KiB meta). Past server.max_journal_bytes
    (or under server.min_free_disk_bytes free) a report gets 507 journal_full and the status says why."""
    from swarmkit.client import SwarmAPIError

    cycle = TrainingCycle(tmp_path, trainer_factory=lambda c, d: _Trainer())
    h = _start(_no_step_cfg(train_cfg, max_journal_bytes=1), tmp_path, cycle)
    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=1) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            ep = c.register("task-quota")
            with pytest.raises(SwarmAPIError) as e:
                ep.report(0.5)
            assert e.value.status == 507 and e.value.code == "journal_full"
            assert "max_journal_bytes" in (c.status()["pool"].get("last_error") or "")
            with pytest.raises(KeyError):
                cycle.pool.get(ep.episode_id)  # nothing was stored
    finally:
        h.stop()


class _SavingTrainer(_Trainer):
    """A :class:`_Trainer` that saves checkpoints (a folder holding the step it was saved at)."""

    def save_checkpoint(self, path, extra=None):
        from pathlib import Path

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "step.txt").write_text(str(self.global_step))
        return folder

    def prune_checkpoints(self, keep):
        return []


def test_a_checkpoint_requested_during_a_step_is_named_after_the_step_it_saves(train_cfg, tmp_path):
    """Issue 33: the controller's checkpoint was named from the server's step before the cycle took the
    trainer lock; requested while a step ran, the folder of step 1's weights was called step_00000000."""
    import threading

    import httpx

    cfg = _one_group_cfg(train_cfg)
    trainer = _SavingTrainer()
    in_step, release = threading.Event(), threading.Event()

    def hold():
        in_step.set()
        assert release.wait(20)

    trainer.on_step = hold
    cycle = TrainingCycle(tmp_path, trainer_factory=lambda c, d: trainer)
    h = _start(cfg, tmp_path, cycle)
    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=20) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            for _ in range(2):
                with c.episode("task-a") as ep:
                    ep.report(0.5)
            assert in_step.wait(20)  # step 1 is under way, its trainer held
            answer: dict = {}

            def ask():
                answer.update(httpx.post(f"{h.url}/api/v1/admin/checkpoint", timeout=30,
                                         headers={"Authorization": f"Bearer {TOKEN}"}).json())

            asker = threading.Thread(target=ask)
            asker.start()
            time.sleep(0.5)  # the request waits for the step
            release.set()
            asker.join(30)
            assert answer["global_step"] == 1, answer
            folder = tmp_path / "checkpoints" / "step_00000001"
            assert answer["path"] == str(folder)
            assert (folder / "step.txt").read_text() == "1" and (folder / "status.json").exists()
            assert not (tmp_path / "checkpoints" / "step_00000000").exists()
    finally:
        release.set()
        h.stop()


def test_failing_steps_are_counted_in_a_row_until_one_trains(train_cfg, tmp_path):
    """A trainer step that raises (out of memory, a broken plugin) leaves the batch in the pool, is retried with
    a back-off, and ``status.pool.steps_failed_in_row`` counts the failures since the last step that trained
    (a main job ends at MAX_FAILED_STEPS_IN_ROW of them); a step that trains clears it."""
    cfg = _one_group_cfg(train_cfg)
    trainer = _Trainer()
    failures = iter(range(2))

    def fail_twice():
        if next(failures, None) is not None:
            raise RuntimeError("CUDA out of memory (simulated)")

    trainer.on_step = fail_twice
    cycle = TrainingCycle(tmp_path, trainer_factory=lambda c, d: trainer)
    h = _start(cfg, tmp_path, cycle)
    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=20) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            for _ in range(2):
                with c.episode("task-a") as ep:
                    ep.report(0.5)
            seen = set()
            end = time.monotonic() + 20
            while time.monotonic() < end:
                pool = c.status()["pool"]
                seen.add(pool.get("steps_failed_in_row", 0))
                if c.status()["global_step"] == 1:
                    break
                time.sleep(0.05)
            pool = c.status()["pool"]
            assert c.status()["global_step"] == 1 and len(trainer.trained) == 2  # the batch trained once, at last
            assert {1, 2} <= seen and "steps_failed_in_row" not in pool and cycle.steps_failed == 2
    finally:
        h.stop()
