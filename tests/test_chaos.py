"""Hot swap and chaos against one real training server (tiny model): clients are separate processes
that log every episode the server acknowledged as accepted; the journal is read back.

- hot swap: a client is stopped mid-run, its reward is edited (token_rule's target letter), it starts
  again; the server process never restarts, its step count goes on, nothing accepted is lost, and the
  edited client's episodes are trained;
- chaos: three clients of three task families; one at random is SIGKILLed while it has an episode open
  and restarted, again and again, while the server trains; the server keeps training, abandoned episodes are aborted at their
  deadline (or when a drain runs out), no drain outlasts ``server.drain_timeout_s``, and every acknowledged episode is in the
  journal (pooled or trained).
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

from swarmkit.apps.processes import boot_servers, launch_server, server_env
from swarmkit.client import SwarmAPIError

TOKEN = "chaos-test-admin-token"
EPISODE_TIMEOUT_S = 3.0
DRAIN_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("chaos")
    s = launch_server("chaos", work / "server", token=TOKEN)
    try:
        boot_servers([s], {"chaos": [
            "model=tiny", "batching=c2", "batching.batch_size=2", "batching.rollouts_per_task=2", "optim.lr=1e-2",
            "trainer.total_steps=100000", "trainer.checkpoint_every=0",
            f"server.episode_timeout_s={EPISODE_TIMEOUT_S}", f"server.drain_timeout_s={DRAIN_TIMEOUT_S}"]},
            timeout=120)
        yield {"proc": s, "ctl": s.client(retry_for=30), "work": work}
    finally:
        s.stop()


def _client(server, task: str, log: Path, *extra: str, client_id: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "swarmkit.apps.task_client", "--url", server["proc"].url, "--task", task,
         "--max-tokens", "4", "--rollouts-per-task", "2", "--train-size", "6", "--concurrency", "2",
         "--episode-log", str(log), "--client-id", client_id or f"{task}-client", *extra],
        env=server_env(TOKEN), stdout=subprocess.DEVNULL, stderr=open(log.with_suffix(".err"), "ab"))


def _stop(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _accepted(logs) -> set[str]:
    out = set()
    for log in logs:
        if log.exists():
            for line in log.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    if row["accepted"]:
                        out.add(row["episode_id"])
    return out


def _journal(server) -> dict[str, tuple[str, int | None, str]]:
    db = sqlite3.connect(f"file:{server['proc'].run_dir / 'journal.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT episode_id, status, trained_step, task_family FROM episodes").fetchall()
    finally:
        db.close()
    return {eid: (status, step, fam) for eid, status, step, fam in rows}


def _wait_step(ctl, at_least: int, timeout: float = 90.0) -> int:
    end = time.monotonic() + timeout
    step = -1
    while time.monotonic() < end:
        step = int(ctl.status()["global_step"])
        if step >= at_least:
            return step
        time.sleep(0.2)
    raise AssertionError(f"the server stayed at step {step} (< {at_least})")


def test_hot_swap_an_edited_client_continues_the_same_run(server):
    ctl, work = server["ctl"], server["work"]
    pid, up0, t0 = server["proc"].proc.pid, ctl.status()["uptime_s"], time.monotonic()
    log1, log2 = work / "swap1.jsonl", work / "swap2.jsonl"
    first = _client(server, "token_rule", log1, "--task-option", "target=e")
    try:
        step0 = _wait_step(ctl, 2)
    finally:
        _stop(first, signal.SIGINT)  # stopped mid-run, like Ctrl-C
    time.sleep(EPISODE_TIMEOUT_S + 1.0)  # its open episodes pass their deadline
    step1 = int(ctl.status()["global_step"])
    assert step1 >= step0
    second = _client(server, "token_rule", log2, "--task-option", "target=a")  # the reward, edited
    try:
        _wait_step(ctl, step1 + 2)
    finally:
        _stop(second)
    assert server["proc"].proc.poll() is None and server["proc"].proc.pid == pid
    st = ctl.status()  # never restarted: the same process, up all along, never back to BOOTING
    assert st["uptime_s"] >= up0 + (time.monotonic() - t0) - 1.0 and st["state_history"].count("BOOTING") <= 1
    journal = _journal(server)
    before, after = _accepted([log1]), _accepted([log2])
    assert before and after and before <= set(journal) and after <= set(journal)
    trained_after = [journal[e][1] for e in after if journal[e][0] == "trained"]
    assert trained_after and min(trained_after) > step0  # the edited client's samples train the same model


@pytest.mark.slow  # about 35 s: the slow step of .ci/run
def test_chaos_sigkilled_clients_lose_nothing_and_never_stall_training(server):
    ctl, work = server["ctl"], server["work"]
    tasks = ["arithmetic", "token_rule", "calc_agent"]
    logs: list[Path] = []
    procs: dict[str, tuple[str, subprocess.Popen]] = {}

    def start(task: str) -> None:
        cid = f"chaos-{task}-{len(logs)}"
        log = work / f"{cid}.jsonl"
        logs.append(log)
        procs[task] = (cid, _client(server, task, log, client_id=cid))

    def open_episodes(cid: str, timeout: float = 30.0) -> list[str]:
        """The client's running episodes, once it has one (it may still be starting up)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ids = [e["episode_id"] for e in ctl._call("GET", "/api/v1/episodes", admin=True)["running"]
                   if e["client_id"] == cid]
            if ids:
                return ids
            time.sleep(0.1)
        raise AssertionError(f"client {cid} opened no episode in {timeout:g} s")

    t_start = time.time()
    for t in tasks:
        start(t)
    rng = random.Random(0)
    step0 = int(ctl.status()["global_step"])
    abandoned: list[str] = []
    try:
        end = time.monotonic() + 30
        while time.monotonic() < end or len(abandoned) < 4:
            time.sleep(rng.uniform(0.5, 2.0))
            victim = rng.choice(tasks)
            cid, proc = procs[victim]
            abandoned += open_episodes(cid)
            _stop(proc)  # SIGKILL, with an episode open
            start(victim)
            assert server["proc"].proc.poll() is None, "the server died"
        _wait_step(ctl, step0 + 3)
    finally:
        for _, p in procs.values():
            _stop(p)
    time.sleep(EPISODE_TIMEOUT_S + 1.5)  # every abandoned episode passes its deadline
    st = ctl.status()
    assert st["state"] in ("ROLLING", "ROLLING_POST", "WEIGHT_SYNCING")
    assert int(st["global_step"]) >= step0 + 3, "training stalled under chaos"
    # abandoned episodes end at their deadline, or earlier when a drain runs out
    listing = ctl._call("GET", "/api/v1/episodes?ended=4096", admin=True)
    assert not listing["running"], f"episodes left open past their deadline: {listing['running']}"
    ended = {e["episode_id"]: e for e in listing["ended"]}
    outcome = [ended[e]["abort_reason"] if ended[e]["status"] == "aborted" else "reported" for e in abandoned]
    assert set(outcome) <= {"deadline", "drain deadline", "reported"} and outcome.count("reported") < len(outcome)
    reasons = {e["abort_reason"] for e in listing["ended"] if e["status"] == "aborted" and e["created"] >= t_start}
    assert reasons <= {"deadline", "drain deadline"}, reasons
    metrics = [json.loads(x) for x in (server["proc"].run_dir / "metrics.jsonl").read_text().splitlines()]
    chaos_steps = [m for m in metrics if m.get("kind", "train") == "train" and m["step"] > step0]
    assert chaos_steps and max(m["drain_s"] for m in chaos_steps) <= DRAIN_TIMEOUT_S + 1.0
    journal = _journal(server)
    acknowledged = _accepted(logs)
    assert len(acknowledged) > 10
    lost = acknowledged - set(journal)
    assert not lost, f"{len(lost)} acknowledged episodes are not in the journal"
    assert {journal[e][2] for e in acknowledged} == set(tasks)
    kills = len(logs) - len(tasks)
    print(f"chaos: {kills} client SIGKILLs, {len(abandoned)} episodes abandoned (all ended: {outcome.count('deadline')} "
          f"at their deadline, {outcome.count('drain deadline')} by a drain), {len(acknowledged)} acknowledged "
          f"accepted, {len(acknowledged & set(journal))} of them in the journal, "
          f"{int(st['global_step']) - step0} steps, longest drain {max(m['drain_s'] for m in chaos_steps):.2f} s")


def test_a_server_that_reached_its_step_limit_says_so_and_refuses_training_episodes(tmp_path):
    s = launch_server("limited", tmp_path / "server", token=TOKEN)
    client = None
    try:
        boot_servers([s], {"limited": ["model=tiny", "batching=c2", "batching.batch_size=1",
                                       "batching.rollouts_per_task=2", "trainer.total_steps=2",
                                       "trainer.checkpoint_every=0"]}, timeout=120)
        ctl = s.client(retry_for=30)
        client = _client({"proc": s}, "token_rule", tmp_path / "limited.jsonl")
        _wait_step(ctl, 2)
        reason = ctl.status()["training_finished"]  # said as the last step ends
        assert reason and "trainer.total_steps=2" in reason
        with pytest.raises(SwarmAPIError) as e:
            ctl.register("after-the-limit")
        assert e.value.status == 409 and e.value.code == "training_finished"
        with ctl.episode("eval-after-the-limit", eval=True) as ev:  # eval episodes still run
            assert ev.report(1.0)["status"] == "finished"
        time.sleep(1.0)
        assert int(ctl.status()["global_step"]) == 2 and ctl.status()["state"] == "ROLLING"
    finally:
        if client is not None:
            _stop(client)
        s.stop()


@pytest.mark.parametrize("request_body, steps", [
    ({"overrides": ["model=tiny"]}, None),
    ({"overrides": ["model=tiny", "trainer.total_steps=7"]}, 7),
    ({"overrides": ["model=tiny", "trainer.total_steps=0"]}, 0),
    ({"config": {"model": "tiny"}}, None),
    ({"yaml": "model: tiny"}, None),
    ({"config": {"model": "tiny", "trainer": {"total_steps": 7}}}, 7),
])
def test_a_configured_server_has_the_schema_default_step_limit(request_body, steps):
    """One default wherever a server is configured: the schema's (as on the command line), unless the
    request sets a limit (0: until stopped)."""
    from swarmkit.config.compose import compose_checked, config_from_request
    from swarmkit.config.schema import TrainerConfig

    cfg = config_from_request(request_body, {"host": "127.0.0.1", "port": 8000})
    default = TrainerConfig().total_steps
    assert compose_checked(["model=tiny"]).trainer.total_steps == default
    assert compose_checked(["mode=server", "model=tiny"]).trainer.total_steps == default
    assert cfg.trainer.total_steps == (default if steps is None else steps)
