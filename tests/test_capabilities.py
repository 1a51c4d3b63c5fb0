"""What the architecture enables, shown on one real server process (tiny model).

(a) Cocktail training: two client processes run different tasks
    (``arithmetic`` and ``token_rule``, ``meta.task_family`` set by the example
    client) against one server; with ``batching.cocktail`` caps of 0.5 every
    trained batch holds both families.
(b) Evaluation any time: eval episodes run while the server trains, see
    several policy versions, and never enter the pool / journal.
(c) Fault tolerance: a client sends a NaN reward, a wrong key, an unknown
    episode, garbage, aborts after a tool failure, then crashes mid-episode:
    the server stays up, keeps training, and every accepted sample is intact.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from swarmkit.apps.task_client import run_episode
from swarmkit.client import SwarmClient
from swarmkit.tasks import make_tasks

TOKEN = "capabilities-test-token"
FAMILIES = {"arithmetic", "token_rule"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, SWARMKIT_TORCH_THREADS="1", HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false")


def _journal(run_dir: Path) -> dict[str, dict]:
    db = sqlite3.connect(f"file:{run_dir / 'journal.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT episode_id, task_family, reward, timelines, status, trained_step "
                          "FROM episodes ORDER BY seq").fetchall()
    finally:
        db.close()
    return {r[0]: {"family": r[1], "reward": json.loads(r[2]), "timelines": r[3], "status": r[4],
                   "trained_step": r[5]} for r in rows}


def _wait_step(ctl: SwarmClient, at_least: int, timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    st = ctl.status()
    while st["global_step"] < at_least and time.monotonic() < end:
        time.sleep(0.2)
        st = ctl.status()
    assert st["global_step"] >= at_least, st
    return st


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("capabilities")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}",
         f"hydra.run.dir={run_dir}/hydra"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=open(run_dir / "server.err", "ab"),
    )
    url = f"http://127.0.0.1:{port}"
    clients: list[subprocess.Popen] = []
    try:
        ctl = SwarmClient(url, token=TOKEN, retry_for=60, client_id="controller")
        ctl.wait_for_state("OFFLINE", timeout=60)
        ctl.configure(["model=tiny", "task=token_rule", "batching=c2", "batching.batch_size=2",
                       "batching.rollouts_per_task=2", "++batching.cocktail={arithmetic:0.5,token_rule:0.5}",
                       "optim.lr=1e-3", "trainer.total_steps=100000", "trainer.checkpoint_every=0",
                       "server.episode_timeout_s=3", "server.drain_timeout_s=10"])
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=90)
        for task, max_tokens in (("arithmetic", "6"), ("token_rule", "4")):
            clients.append(subprocess.Popen(
                [sys.executable, "-m", "swarmkit.apps.task_client", "--url", url, "--task", task,
                 "--train-size", "6", "--rollouts-per-task", "2", "--max-tokens", max_tokens,
                 "--concurrency", "2", "--client-id", f"cocktail-{task}"],
                env=_env(), stdout=subprocess.DEVNULL, stderr=open(run_dir / f"client-{task}.err", "ab")))
        yield {"url": url, "ctl": ctl, "run_dir": run_dir, "proc": proc, "clients": clients}
    finally:
        for p in [*clients, proc]:
            if p.poll() is None:
                p.terminate()
        for p in [*clients, proc]:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def test_cocktail_training_mixes_task_families_in_every_batch(server):
    st = _wait_step(server["ctl"], 3)
    journal = _journal(server["run_dir"])
    by_step: dict[int, set[str]] = {}
    for rec in journal.values():
        if rec["status"] == "trained":
            by_step.setdefault(rec["trained_step"], set()).add(rec["family"])
    assert len(by_step) >= 3, by_step
    assert all(fams == FAMILIES for fams in by_step.values()), by_step
    assert {rec["family"] for rec in journal.values()} == FAMILIES
    assert st["clients"]["active"] >= 2


def test_eval_episodes_during_training_never_enter_the_pool(server):
    ctl = server["ctl"]
    eval_client = SwarmClient(server["url"], retry_for=60, client_id="evaluator")
    tasks = make_tasks("token_rule", 4, split="eval") + make_tasks("arithmetic", 4, split="eval")
    before = ctl.status()
    ids, versions = [], set()
    end = time.monotonic() + 40
    with httpx.Client(timeout=60) as http, ThreadPoolExecutor(2) as pool:
        # keep evaluating until the live model moved on by two steps: eval overlaps training
        while time.monotonic() < end:
            def one(task):
                with eval_client.episode(task.task_id, eval=True, meta={"task_family": task.family}) as ep:
                    resp = http.post(f"{ep.base_url}/chat/completions",
                                     headers={"Authorization": f"Bearer {ep.api_key}"},
                                     json={"model": "m", "messages": task.messages, "max_tokens": 4,
                                           "temperature": 0.0})
                    resp.raise_for_status()
                    versions.add(ep.info["policy_version"])
                    result = ep.report(0.25)
                    assert result["accepted"] is False
                    return ep.episode_id
            ids += list(pool.map(one, tasks))
            if ctl.status()["global_step"] >= before["global_step"] + 2 and len(versions) >= 2:
                break
    after = ctl.status()
    assert after["global_step"] >= before["global_step"] + 2, (before["global_step"], after["global_step"])
    assert len(versions) >= 2, versions  # the eval saw the model change under it
    assert after["episodes"]["eval_finished"] - before["episodes"]["eval_finished"] == len(ids)
    journal = _journal(server["run_dir"])
    assert not set(ids) & set(journal), "an eval episode reached the journal"
    # and the training run kept going meanwhile, with its own episodes only
    assert after["pool"]["trained"] > before["pool"]["trained"]
    # a direct eval episode through the example client path: same answer
    res = run_episode(eval_client, tasks[0], max_tokens=3, temperature=0.0, eval=True)
    assert res.eval


BAD_CLIENT = textwrap.dedent("""
    import json, os, sys, httpx
    from swarmkit.client import SwarmClient, SwarmAPIError
    url = sys.argv[1]
    out = {}
    c = SwarmClient(url, retry_for=30, client_id="bad-client")
    h = httpx.Client(base_url=url, timeout=30)
    def post(path, body, key=None, raw=None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if raw is not None:
            headers["Content-Type"] = "application/json"
            r = h.post(path, content=raw, headers=headers)
        else:
            r = h.post(path, json=body, headers=headers)
        err = r.json().get("error", {}) if r.status_code >= 400 else {}
        return [r.status_code, err.get("code")]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ep = c.register("bad-1", meta={"task_family": "token_rule"})
    out["call"] = post("/v1/chat/completions", chat, ep.api_key)
    rep = f"/api/v1/episodes/{ep.episode_id}/report"
    out["nan"] = post(rep, None, ep.api_key, raw=b'{"reward": NaN}')
    out["inf"] = post(rep, None, ep.api_key, raw=b'{"reward": Infinity}')
    out["string"] = post(rep, {"reward": "nan"}, ep.api_key)
    out["role_dict_without_roles"] = post(rep, {"reward": {"x": 1.0}}, ep.api_key)
    out["garbage"] = post(rep, None, ep.api_key, raw=b'{"reward": ')
    out["wrong_key"] = post(rep, {"reward": 1.0}, "sk-swarm-not-a-key")
    out["no_key"] = post(rep, {"reward": 1.0})
    out["chat_wrong_key"] = post("/v1/chat/completions", chat, "sk-swarm-not-a-key")
    out["unknown_episode"] = post("/api/v1/episodes/ep-000000000000000000000000/report", {"reward": 1.0},
                                  ep.api_key)
    out["bad_register"] = post("/api/v1/episodes", {"task_id": ""})
    try:
        ep.report(float("nan"))   # the SDK path: refused on one side or the other, never accepted
        out["sdk_nan"] = "accepted"
    except (SwarmAPIError, ValueError) as exc:
        out["sdk_nan"] = type(exc).__name__
    tool = c.register("bad-tool", meta={"task_family": "token_rule"})
    post("/v1/chat/completions", chat, tool.api_key)
    out["tool_failure_abort"] = tool.abort("tool get_weather raised TimeoutError")["status"]
    crash = c.register("bad-crash", meta={"task_family": "token_rule"})
    post("/v1/chat/completions", chat, crash.api_key)
    out["open"] = [ep.episode_id, crash.episode_id]
    out["aborted"] = [tool.episode_id]
    print(json.dumps(out), flush=True)
    os._exit(3)   # crash mid-episode: no report, no abort, connections dropped
""")


def test_bad_and_crashing_client_never_hurts_the_server(server):
    ctl, run_dir = server["ctl"], server["run_dir"]
    _wait_step(ctl, 1)
    snapshot = _journal(run_dir)
    assert snapshot
    step0 = ctl.status()["global_step"]
    out = subprocess.run([sys.executable, "-c", BAD_CLIENT, server["url"]], env=_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["call"] == [200, None]
    for case in ("nan", "inf", "string", "role_dict_without_roles"):
        assert seen[case] == [422, "invalid_reward"], (case, seen[case])
    assert seen["garbage"] == [400, "invalid_json"]
    assert seen["wrong_key"] == [403, "wrong_episode_key"]
    assert seen["no_key"] == [401, "missing_api_key"]
    assert seen["chat_wrong_key"] == [401, "invalid_api_key"]
    assert seen["unknown_episode"] == [404, "episode_not_found"]
    assert seen["bad_register"][0] == 422
    assert seen["sdk_nan"] in ("SwarmAPIError", "ValueError")
    assert seen["tool_failure_abort"] == "aborted"

    # the server is up and keeps training; the crashed client's open episodes are reaped (3 s deadline)
    assert server["proc"].poll() is None
    end = time.monotonic() + 15
    while time.monotonic() < end:
        ended = {e["episode_id"]: e for e in ctl._request("GET", "/api/v1/episodes?ended=4096",
                                                           admin=True).json()["ended"]}
        if all(i in ended for i in seen["open"]):
            break
        time.sleep(0.25)
    for eid in seen["open"]:
        assert ended[eid]["status"] == "aborted" and ended[eid]["abort_reason"] == "deadline", ended[eid]
    st = _wait_step(ctl, step0 + 1)
    assert st["state"] in ("ROLLING", "ROLLING_POST", "WEIGHT_SYNCING")
    # every sample accepted before is still there, unchanged; none of the bad client's episodes is
    journal = _journal(run_dir)
    for eid, rec in snapshot.items():
        assert eid in journal
        assert journal[eid]["reward"] == rec["reward"] and journal[eid]["timelines"] == rec["timelines"]
        assert journal[eid]["family"] == rec["family"]
    assert not (set(seen["open"]) | set(seen["aborted"])) & set(journal)
