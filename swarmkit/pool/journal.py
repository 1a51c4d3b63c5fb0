"""The sample pool and its durable journal (embedded SQLite, WAL mode).

Every accepted training episode is one row of the journal. ``SamplePool.add``
commits the row (``synchronous=FULL``) before it returns, so an episode whose
acceptance was answered survives a killed server. On open, the untrained pool
is rebuilt from the rows not yet consumed.

An episode's life: ``add`` (status ``untrained``) -> ``take`` (reserved for the
running step, in memory only) -> ``mark_trained(ids, step)`` (status
``trained``, ``trained_step`` set) or ``release(ids)`` (back into the pool).
Policies that filter by design (C3's degenerate groups) have their ids retired
with ``mark_filtered(ids, step)`` (status ``filtered``). Nothing leaves the
journal.

Rewards are a float or a role -> float dict. Policies see one float per
episode: the reward itself, or the mean over roles for a dict (0.0 for an empty
dict).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

from swarmkit.contract.batching import (
    BatchingPolicy,
    ClientState,
    Decision,
    PoolEpisode,
    scalar_reward,
)
from swarmkit.errors import ApiError
from swarmkit.pool.records import (
    FILTERED,
    TRAINED,
    UNTRAINED,
    DuplicateEpisodeError,
    EpisodeRecord,
    check_reward,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    episode_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    client_id TEXT NOT NULL,
    task_family TEXT NOT NULL,
    reward TEXT NOT NULL,
    timelines TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    accepted_at REAL NOT NULL,
    status TEXT NOT NULL,
    trained_step INTEGER,
    consumed_at REAL,
    meta TEXT NOT NULL,
    adapter TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS episodes_status ON episodes(status, seq);
"""

_COLS = ("episode_id, task_id, client_id, reward, timelines, policy_version, task_family, "
         "accepted_at, trained_step, meta, status, adapter")


def _row_to_record(row: tuple) -> EpisodeRecord:
    eid, task, client, reward, timelines, version, family, at, step, meta, status, adapter = row
    return EpisodeRecord(eid, task, client, json.loads(reward), json.loads(timelines),
                         int(version), family, float(at), step, json.loads(meta), status, adapter or "")


def _add_adapter_column(db: sqlite3.Connection) -> None:
    """A journal written before ``model.adapters`` existed gets its ``adapter`` column ("": the one model)."""
    cols = {row[1] for row in db.execute("PRAGMA table_info(episodes)")}
    if "adapter" not in cols:
        db.execute("ALTER TABLE episodes ADD COLUMN adapter TEXT NOT NULL DEFAULT ''")


class SamplePool:
    """Untrained episodes in memory (light view), every episode in the journal.

    Thread-safe: one SQLite connection guarded by a lock.
    """

    def __init__(self, db_path: str | os.PathLike[str]):
        self.db_path = os.fspath(db_path)
        parent = os.path.dirname(os.path.abspath(self.db_path))
        os.makedirs(parent, exist_ok=True)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.db_path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        _add_adapter_column(self._db)
        #: untrained episodes, oldest first (dict keeps insertion order = journal order)
        self._untrained: dict[str, PoolEpisode] = {}
        self._reserved: set[str] = set()
        self._trained = 0
        self._filtered = 0
        #: the quota :meth:`add` keeps (see :meth:`set_quota`): journal bytes, free bytes on its disk
        self.max_bytes: int | None = None
        self.min_free_bytes = 0
        self._rebuild()

    def set_quota(self, max_bytes: int | None, min_free_bytes: int = 0) -> None:
        """Refuse new episodes past ``max_bytes`` of journal (None: no limit) or with less than
        ``min_free_bytes`` free on its disk (a client cannot grow the run folder without bound)."""
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        self.min_free_bytes = int(min_free_bytes)

    def check_room(self) -> None:
        """507 ``journal_full`` (an :class:`~swarmkit.errors.ApiError`) when the quota is reached."""
        path = self.db_path
        if self.max_bytes is not None:
            size = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))
            if size > self.max_bytes:
                raise ApiError(507, f"the journal holds {size} bytes, over server.max_journal_bytes "
                               f"({self.max_bytes}); no further episodes are stored", "journal_full")
        if self.min_free_bytes:
            free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
            if free < self.min_free_bytes:
                raise ApiError(507, f"the run folder's disk has {free} bytes free, under "
                               f"server.min_free_disk_bytes ({self.min_free_bytes}); no further episodes are "
                               "stored", "journal_full")

    # ------------------------------------------------------------------ set-up
    def _rebuild(self) -> None:
        with self._lock:
            self._untrained.clear()
            self._reserved.clear()
            rows = self._db.execute(
                "SELECT episode_id, task_id, reward, client_id, task_family, policy_version, "
                "accepted_at, adapter FROM episodes WHERE status=? ORDER BY seq", (UNTRAINED,))
            for eid, task, reward, client, family, version, at, adapter in rows:
                self._untrained[eid] = PoolEpisode(
                    eid, task, scalar_reward(json.loads(reward)), client, family, int(version),
                    float(at), adapter or "")
            counts = dict(self._db.execute(
                "SELECT status, COUNT(*) FROM episodes GROUP BY status").fetchall())
            self._trained = counts.get(TRAINED, 0)
            self._filtered = counts.get(FILTERED, 0)

    def close(self) -> None:
        """Close the journal (further calls fail)."""
        with self._lock:
            self._db.close()

    def __enter__(self) -> SamplePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        with self._lock:
            return len(self._untrained)

    # ------------------------------------------------------------------ writing
    def add(self, record: EpisodeRecord) -> None:
        """Journal ``record`` (committed to disk before returning) and pool it.

        Raises :class:`DuplicateEpisodeError` if the id is already in the
        journal, ``ValueError`` for a non-finite reward or a record that is
        already marked trained, and a 507 ``journal_full``
        :class:`~swarmkit.errors.ApiError` past the quota (:meth:`set_quota`).
        """
        reward = check_reward(record.reward)
        self.check_room()
        if record.trained_step is not None or record.status != UNTRAINED:
            raise ValueError(f"episode {record.episode_id!r}: only untrained episodes can be added")
        row = (record.episode_id, record.task_id, record.client_id, record.task_family,
               json.dumps(reward), json.dumps(record.timelines), int(record.policy_version),
               float(record.accepted_at), UNTRAINED, json.dumps(record.meta), str(record.adapter or ""))
        with self._lock:
            try:
                self._db.execute(
                    "INSERT INTO episodes (episode_id, task_id, client_id, task_family, reward, "
                    "timelines, policy_version, accepted_at, status, meta, adapter) "
                    "VALUES (?,?,?,?,?,?,?,?,?,?,?)", row)
            except sqlite3.IntegrityError as exc:
                raise DuplicateEpisodeError(
                    f"episode {record.episode_id!r} is already in the sample pool journal; "
                    "episode ids must be unique") from exc
            self._untrained[record.episode_id] = PoolEpisode(
                record.episode_id, record.task_id, scalar_reward(reward), record.client_id,
                record.task_family, int(record.policy_version), float(record.accepted_at),
                str(record.adapter or ""))

    def _consume(self, ids: Iterable[str], step: int, status: str) -> int:
        ids = list(dict.fromkeys(ids))
        with self._lock:
            todo = [i for i in ids if i in self._untrained]
            rest = [i for i in ids if i not in self._untrained]
            if rest:  # allowed only as an idempotent repeat of the same consumption
                found: dict[str, tuple[str, int | None]] = {}
                for start in range(0, len(rest), 500):
                    chunk = rest[start:start + 500]
                    q = ",".join("?" * len(chunk))
                    found.update((eid, (st, s)) for eid, st, s in self._db.execute(
                        f"SELECT episode_id, status, trained_step FROM episodes "
                        f"WHERE episode_id IN ({q})", chunk))
                bad = [i for i in rest if found.get(i) != (status, step)]
                if bad:
                    raise KeyError(f"not untrained episodes in the pool: {bad[:5]}"
                                   f"{' ...' if len(bad) > 5 else ''}")
            if not todo:
                return 0
            now = time.time()
            with self._transaction():
                self._db.executemany(
                    "UPDATE episodes SET status=?, trained_step=?, consumed_at=? "
                    "WHERE episode_id=?", [(status, int(step), now, i) for i in todo])
            for i in todo:
                del self._untrained[i]
                self._reserved.discard(i)
            if status == TRAINED:
                self._trained += len(todo)
            else:
                self._filtered += len(todo)
            return len(todo)

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``; on an error, roll back if SQLite has not already done
        so itself (a full disk rolls the transaction back): the caller sees the real error, never
        "cannot rollback - no transaction is active"."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                with suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
            raise

    def mark_trained(self, ids: Iterable[str], step: int) -> int:
        """Record that optimizer step ``step`` trained on ``ids``; they leave the pool.

        Atomic; repeating it with the same step is a no-op. Raises ``KeyError``
        for ids that are neither untrained nor already trained at ``step``.
        Returns how many episodes changed.
        """
        return self._consume(ids, step, TRAINED)

    def mark_filtered(self, ids: Iterable[str], step: int) -> int:
        """Retire ``ids`` without training (e.g. C3's degenerate groups), at ``step``."""
        return self._consume(ids, step, FILTERED)

    def reset_after(self, step: int) -> int:
        """Put back into the pool every episode consumed at a step > ``step``.

        For resuming from a checkpoint taken at ``step``. Returns the count.
        """
        with self._lock:
            with self._transaction():
                cur = self._db.execute(
                    "UPDATE episodes SET status=?, trained_step=NULL, consumed_at=NULL "
                    "WHERE status!=? AND trained_step>?", (UNTRAINED, UNTRAINED, int(step)))
            self._rebuild()
            return cur.rowcount

    def retire_after(self, step: int) -> tuple[int, int]:
        """A rollback to the weights of step ``step``: every episode consumed at a later step, and
        every untrained episode sampled by later weights (``policy_version > step``, not reserved),
        is retired (status ``filtered``) at ``step``. They stay in the journal; a resume from a
        checkpoint at ``step`` or later does not put them back. Returns (consumed, waiting) counts."""
        with self._lock:
            reserved = set(self._reserved)
            now = time.time()
            with self._transaction():
                consumed = self._db.execute(
                    "UPDATE episodes SET status=?, trained_step=? WHERE status!=? AND trained_step>?",
                    (FILTERED, int(step), UNTRAINED, int(step))).rowcount
                waiting_ids = [eid for (eid,) in self._db.execute(
                    "SELECT episode_id FROM episodes WHERE status=? AND policy_version>?", (UNTRAINED, int(step)))
                    if eid not in reserved]
                self._db.executemany(
                    "UPDATE episodes SET status=?, trained_step=?, consumed_at=? WHERE episode_id=?",
                    [(FILTERED, int(step), now, eid) for eid in waiting_ids])
            self._rebuild()
            self._reserved.update(reserved & set(self._untrained))
            return consumed, len(waiting_ids)

    # ------------------------------------------------------------------ reading
    def view(self) -> list[PoolEpisode]:
        """What policies see: untrained, not reserved episodes, oldest first."""
        with self._lock:
            return [e for i, e in self._untrained.items() if i not in self._reserved]

    def untrained(self) -> list[EpisodeRecord]:
        """Full records (timelines included) of every untrained episode, oldest first."""
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLS} FROM episodes WHERE status=? ORDER BY seq", (UNTRAINED,)
            ).fetchall()
        return [_row_to_record(r) for r in rows]

    def get(self, episode_id: str) -> EpisodeRecord:
        """One record from the journal, whatever its status (``KeyError`` if unknown)."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLS} FROM episodes WHERE episode_id=?", (episode_id,)).fetchone()
        if row is None:
            raise KeyError(f"episode {episode_id!r} is not in the journal")
        return _row_to_record(row)

    def decide(
        self, policy: BatchingPolicy, clients: Mapping[str, ClientState] | None = None,
        now: float | None = None,
    ) -> Decision:
        """Ask ``policy`` about the current view."""
        return policy.decide(self.view(), dict(clients or {}), time.time() if now is None else now)

    def take(self, ids: Iterable[str]) -> list[EpisodeRecord]:
        """Full records of ``ids`` (in that order), reserved for the running step.

        Reserved episodes stay untrained (and in ``stats()["episodes"]``) but are
        hidden from ``view()``/``decide`` until ``mark_trained`` or ``release``.
        Reservations live in memory only: after a restart they are untrained
        again. Raises ``KeyError`` for ids not in the untrained pool.
        """
        ids = list(dict.fromkeys(ids))
        with self._lock:
            missing = [i for i in ids if i not in self._untrained]
            if missing:
                raise KeyError(f"not untrained episodes in the pool: {missing[:5]}")
            by_id: dict[str, EpisodeRecord] = {}
            for start in range(0, len(ids), 500):
                chunk = ids[start:start + 500]
                q = ",".join("?" * len(chunk))
                for row in self._db.execute(
                        f"SELECT {_COLS} FROM episodes WHERE episode_id IN ({q})", chunk):
                    rec = _row_to_record(row)
                    by_id[rec.episode_id] = rec
            self._reserved.update(ids)
        return [by_id[i] for i in ids]

    def release(self, ids: Iterable[str] | None = None) -> None:
        """Undo ``take`` for ``ids`` (all reservations if None), e.g. after a failed step."""
        with self._lock:
            if ids is None:
                self._reserved.clear()
            else:
                self._reserved.difference_update(ids)

    def stats(
        self, policy: BatchingPolicy | None = None,
        clients: Mapping[str, ClientState] | None = None, now: float | None = None,
    ) -> dict[str, Any]:
        """Numbers for the status API's ``pool``.

        ``episodes``: untrained (reserved included); ``tasks``: distinct task ids
        among them; ``reserved``; ``trained``; ``filtered``; and with a policy,
        ``policy`` (its name), ``fill`` ``{current, target, unit}`` and
        ``ready`` (whether it would fire now).
        """
        with self._lock:
            out: dict[str, Any] = {
                "episodes": len(self._untrained),
                "tasks": len({e.task_id for e in self._untrained.values()}),
                "reserved": len(self._reserved),
                "trained": self._trained,
                "filtered": self._filtered,
            }
        if policy is not None:
            d = self.decide(policy, clients, now)
            out["policy"] = getattr(policy, "name", type(policy).__name__)
            out["fill"] = {"current": d.current, "target": d.target, "unit": d.unit}
            out["ready"] = d.fire
        else:
            out["fill"] = None
        return out

    # ------------------------------------------------------------------ tools
    def iter_all(self, batch: int = 256) -> Iterator[EpisodeRecord]:
        """Every journal record, in journal order, whatever its status."""
        last = 0
        while True:
            with self._lock:
                rows = self._db.execute(
                    f"SELECT seq, {_COLS} FROM episodes WHERE seq>? ORDER BY seq LIMIT ?",
                    (last, batch)).fetchall()
            if not rows:
                return
            for row in rows:
                last = row[0]
                yield _row_to_record(row[1:])

    def journal_summary(self) -> dict[str, Any]:
        """Counts over the whole journal: by status, by task family, steps, time span."""
        with self._lock:
            by_status = dict(self._db.execute(
                "SELECT status, COUNT(*) FROM episodes GROUP BY status").fetchall())
            by_family = dict(self._db.execute(
                "SELECT task_family, COUNT(*) FROM episodes GROUP BY task_family").fetchall())
            steps, last_step = self._db.execute(
                "SELECT COUNT(DISTINCT trained_step), MAX(trained_step) FROM episodes "
                "WHERE status=?", (TRAINED,)).fetchone()
            first, last, tasks = self._db.execute(
                "SELECT MIN(accepted_at), MAX(accepted_at), COUNT(DISTINCT task_id) "
                "FROM episodes").fetchone()
        return {
            "db_path": self.db_path,
            "total": sum(by_status.values()),
            UNTRAINED: by_status.get(UNTRAINED, 0),
            TRAINED: by_status.get(TRAINED, 0),
            FILTERED: by_status.get(FILTERED, 0),
            "tasks": tasks,
            "by_family": by_family,
            "trained_steps": steps,
            "last_trained_step": last_step,
            "first_accepted_at": first,
            "last_accepted_at": last,
        }


class JournalReader:
    """Read-only access to a journal another process may be writing (``mode=ro``; never creates it).

    For looking at a run from outside: the dashboard of a finished or crashed run.
    """

    def __init__(self, db_path: str | os.PathLike[str]):
        self.db_path = os.fspath(db_path)
        if not os.path.exists(self.db_path):
            raise FileNotFoundError(f"no journal at {self.db_path}")
        uri = "file:" + urllib.parse.quote(os.path.abspath(self.db_path)) + "?mode=ro"
        self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        self._lock = threading.Lock()
        cols = {row[1] for row in self._db.execute("PRAGMA table_info(episodes)")}
        #: the columns of a record; a journal older than model.adapters reads "" as every adapter
        self._cols = _COLS if "adapter" in cols or not cols else _COLS.replace(", adapter", ", '' AS adapter")

    def close(self) -> None:
        self._db.close()

    def counts(self) -> dict[str, int]:
        """Episodes by status (``untrained``, ``trained``, ``filtered``) and distinct untrained tasks."""
        with self._lock:
            by_status = dict(self._db.execute("SELECT status, COUNT(*) FROM episodes GROUP BY status").fetchall())
            tasks = self._db.execute("SELECT COUNT(DISTINCT task_id) FROM episodes WHERE status=?",
                                     (UNTRAINED,)).fetchone()[0]
        return {UNTRAINED: by_status.get(UNTRAINED, 0), TRAINED: by_status.get(TRAINED, 0),
                FILTERED: by_status.get(FILTERED, 0), "untrained_tasks": int(tasks)}

    def newest(self, limit: int) -> list[EpisodeRecord]:
        """The ``limit`` most recently accepted records, newest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {self._cols} FROM episodes ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
        return [_row_to_record(r) for r in rows]

    def untrained_rewards(self) -> list[tuple[str, str, Any]]:
        """``(task_id, task_family, reward)`` of every untrained episode, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT task_id, task_family, reward FROM episodes WHERE status=? ORDER BY seq",
                                    (UNTRAINED,)).fetchall()
        return [(task, family, json.loads(reward)) for task, family, reward in rows]

    def get(self, episode_id: str) -> EpisodeRecord | None:
        with self._lock:
            row = self._db.execute(f"SELECT {self._cols} FROM episodes WHERE episode_id=?",
                                   (episode_id,)).fetchone()
        return _row_to_record(row) if row is not None else None


def _main(argv: list[str] | None = None) -> int:  # pragma: no cover - tiny tool (python -m swarmkit.pool)
    """``python -m swarmkit.pool JOURNAL.sqlite``: print the journal summary."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m swarmkit.pool PATH/TO/pool.sqlite", file=sys.stderr)
        return 2
    if not os.path.exists(args[0]):
        print(f"no journal at {args[0]}", file=sys.stderr)
        return 1
    with SamplePool(args[0]) as pool:
        print(json.dumps(pool.journal_summary(), indent=2))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
