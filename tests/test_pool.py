"""The sample pool: durable journal, rebuild after restart, consumption, threads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from swarmkit.contract import ClientState
from swarmkit.pool import DuplicateEpisodeError, EpisodeRecord, SamplePool, scalar_reward
from swarmkit_plugins.batching.policies import NonDegenerateTaskCount, TaskCount

TIMELINE = {"blocks": [{"author": "llm", "text": "hi", "token_ids": [1, 2],
                        "logprobs": [-0.1, -0.2], "loss_mask": [1, 1]}]}


def rec(eid: str, task: str, reward=1.0, **kw) -> EpisodeRecord:
    return EpisodeRecord(eid, task, kw.pop("client_id", "c1"), reward, [TIMELINE],
                         kw.pop("policy_version", 0), **kw)


@pytest.fixture()
def db(tmp_path):
    return tmp_path / "run" / "pool.sqlite"


def test_add_view_take_mark(db):
    pool = SamplePool(db)
    pool.add(rec("e1", "a", 1.0, task_family="math"))
    pool.add(rec("e2", "a", {"alice": 1.0, "bob": 0.0}))
    pool.add(rec("e3", "b", 0.0, meta={"seed": 3}))
    assert [e.episode_id for e in pool.view()] == ["e1", "e2", "e3"]
    assert pool.view()[1].reward == 0.5  # role rewards: the mean
    assert pool.view()[0].task_family == "math"
    with pytest.raises(DuplicateEpisodeError):
        pool.add(rec("e1", "z"))
    with pytest.raises(ValueError):
        pool.add(rec("bad", "a", float("nan")))
    assert pool.stats() == {"episodes": 3, "tasks": 2, "reserved": 0, "trained": 0,
                            "filtered": 0, "fill": None}

    got = pool.take(["e2", "e1"])
    assert [r.episode_id for r in got] == ["e2", "e1"]
    assert got[0].reward == {"alice": 1.0, "bob": 0.0} and got[0].timelines == [TIMELINE]
    assert [e.episode_id for e in pool.view()] == ["e3"]  # reserved ones are hidden
    assert pool.stats()["episodes"] == 3 and pool.stats()["reserved"] == 2
    assert pool.mark_trained(["e1", "e2"], step=1) == 2
    assert pool.mark_trained(["e1"], step=1) == 0  # idempotent repeat
    with pytest.raises(KeyError):
        pool.mark_trained(["e1"], step=2)
    with pytest.raises(KeyError):
        pool.take(["e1"])
    s = pool.stats()
    assert (s["episodes"], s["trained"], s["reserved"]) == (1, 2, 0)
    assert pool.get("e1").trained_step == 1 and pool.get("e1").status == "trained"
    assert [r.episode_id for r in pool.untrained()] == ["e3"]
    assert pool.untrained()[0].meta == {"seed": 3}
    pool.close()

    pool = SamplePool(db)  # rebuild after reopen
    assert [e.episode_id for e in pool.view()] == ["e3"]
    assert pool.stats()["trained"] == 2
    assert [r.episode_id for r in pool.iter_all(batch=2)] == ["e1", "e2", "e3"]
    summary = pool.journal_summary()
    assert (summary["total"], summary["untrained"], summary["trained"]) == (3, 1, 2)
    assert summary["last_trained_step"] == 1 and summary["by_family"] == {"math": 1, "": 2}
    pool.close()


def test_decide_stats_filtered_and_reset(db):
    pool = SamplePool(db)
    for i, r in enumerate([1, 1, 0, 1]):
        pool.add(rec(f"a{i}", "a" if i < 2 else "b", float(r), accepted_at=float(i)))
    pol = NonDegenerateTaskCount(batch_size=1, rollouts_per_task=2, name="c3")
    d = pool.decide(pol, {}, now=10.0)
    assert d.fire and d.selected == ["a2", "a3"] and d.detail["filtered"] == ["a0", "a1"]
    s = pool.stats(pol, {}, now=10.0)
    assert s["fill"] == {"current": 1, "target": 1, "unit": "tasks"} and s["policy"] == "c3"
    assert s["ready"] is True
    pool.take(d.selected)
    pool.mark_trained(d.selected, step=1)
    pool.mark_filtered(d.detail["filtered"], step=1)
    assert pool.stats()["episodes"] == 0 and pool.stats()["filtered"] == 2
    # resume from a checkpoint taken before step 1: everything comes back
    assert pool.reset_after(0) == 4
    assert [e.episode_id for e in pool.view()] == ["a0", "a1", "a2", "a3"]
    pool.release()
    pool.close()


def test_release_returns_reserved(db):
    pool = SamplePool(db)
    pool.add(rec("x", "t"))
    pool.take(["x"])
    assert pool.view() == []
    pool.release(["x"])
    assert [e.episode_id for e in pool.view()] == ["x"]
    pool.close()
    pool = SamplePool(db)  # reservations are not durable; the episode is untrained
    pool.take(["x"])
    pool.close()
    assert [e.episode_id for e in SamplePool(db).view()] == ["x"]


def test_policy_through_pool_with_clients(db):
    from swarmkit_plugins.batching.policies import AllClientsReady

    pool = SamplePool(db)
    pool.add(rec("e", "t"))
    pol = AllClientsReady(batch_size=1, rollouts_per_task=1, active_window_s=5.0)
    cs = {"c": ClientState("c", 0.0, True)}
    assert pool.decide(pol, cs, now=1.0).selected == ["e"]
    assert pool.stats(pol, cs, now=1.0)["fill"]["unit"] == "ready clients"
    pool.close()


CHILD = textwrap.dedent("""
    import sys
    from swarmkit.pool import EpisodeRecord, SamplePool
    pool = SamplePool(sys.argv[1])
    i = 0
    while True:
        pool.add(EpisodeRecord(f"k{i}", f"t{i % 3}", "c", float(i % 2),
                               [{"blocks": [{"text": "x" * 2000}]}], 0))
        print(f"k{i}", flush=True)
        i += 1
""")


def test_sigkill_right_after_add_loses_nothing(db):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], stdout=subprocess.PIPE,
                            text=True)
    acked = []
    try:
        for _ in range(60):
            acked.append(proc.stdout.readline().strip())
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    pool = SamplePool(db)
    ids = {e.episode_id for e in pool.view()}
    assert set(acked) <= ids  # every acknowledged add survived
    pol = TaskCount(batch_size=3, rollouts_per_task=20)
    assert pool.decide(pol, {}, now=0.0).fire
    assert all(len(r.timelines[0]["blocks"][0]["text"]) == 2000 for r in pool.take(acked))
    pool.close()


def test_concurrent_adds(db):
    pool = SamplePool(db)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(25):
                pool.add(rec(f"w{w}-{i}", f"t{i % 4}", client_id=f"c{w}"))
                pool.stats()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    won: list[str] = []

    def racer(name: str) -> None:  # several threads add the same id: exactly one wins
        try:
            pool.add(rec("same", "t9", client_id=name))
            won.append(name)
        except DuplicateEpisodeError:
            pass

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=racer, args=(f"r{i}",)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(won) == 1
    pool.mark_trained(["same"], step=1)
    assert not errors
    assert len(pool) == 100 and pool.stats()["tasks"] == 4
    pool.close()
    assert len(SamplePool(db).view()) == 100


def test_scalar_reward():
    assert scalar_reward(2) == 2.0
    assert scalar_reward({"a": 1.0, "b": 2.0}) == 1.5
    assert scalar_reward({}) == 0.0
