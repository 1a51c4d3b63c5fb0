"""Heterogeneous multi-model training, end to end (examples/multi_model/run.py).

Two real server processes train two different tiny models (``builtin:tiny``
and a 3-layer Qwen2 built with another seed); ONE client process runs
two-role episodes, role ``a`` on server A and role ``b`` on server B, each
role's reward reported to its own server. Checked: both servers train; each
journal holds only its own role's timelines, with the tokens that server
answered; keys and episode ids of one server mean nothing to the other; a
client SIGKILLed mid-episode leaves both servers up, its open episodes are
reaped, and a restarted (edited) client continues the same training.
"""

from __future__ import annotations

import importlib.util
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from swarmkit.apps.processes import boot_servers, launch_server, server_env
from swarmkit.client import SwarmAPIError, SwarmClient

RUN = Path(__file__).resolve().parents[1] / "examples" / "multi_model" / "run.py"
TOKEN = "multi-model-test-token"
ROLES = ("a", "b")
SPECIAL = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")


def _load_example():
    spec = importlib.util.spec_from_file_location("swarmkit_example_multi_model", RUN)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


mm = _load_example()


def _client_proc(swarm: dict, log: Path, *extra: str) -> subprocess.Popen:
    routes = [f"--route={s.role}={s.url}" for s in swarm["servers"]]
    return subprocess.Popen(
        [sys.executable, str(RUN), "client", *routes, "--max-tokens", "4", "--rollouts", "2",
         "--train-size", "8", "--concurrency", "3", "--episode-log", str(log), *extra],
        env=server_env(TOKEN), stdout=subprocess.DEVNULL, stderr=open(log.with_suffix(".err"), "ab"),
    )


def _journal(server) -> list[dict]:
    db = sqlite3.connect(f"file:{server.run_dir / 'journal.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        rows = db.execute("SELECT episode_id, task_family, reward, timelines, meta, status FROM episodes "
                          "ORDER BY seq").fetchall()
    finally:
        db.close()
    return [{"id": r[0], "family": r[1], "reward": json.loads(r[2]), "timelines": json.loads(r[3]),
             "meta": json.loads(r[4]), "status": r[5]} for r in rows]


def _logged(log: Path) -> list[dict]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_steps(ctls: dict[str, SwarmClient], at_least: dict[str, int], timeout: float = 60.0) -> dict:
    end = time.monotonic() + timeout
    status = {}
    while time.monotonic() < end:
        status = {r: c.status() for r, c in ctls.items()}
        if all(status[r]["global_step"] >= at_least[r] for r in ctls):
            return status
        time.sleep(0.2)
    raise AssertionError(f"servers did not reach steps {at_least}: "
                         + str({r: (s["global_step"], s["state"], s["pool"]) for r, s in status.items()}))


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    work = tmp_path_factory.mktemp("multi_model")
    paths = mm.model_paths(2, work)  # builtin:tiny, and a 3-layer tiny Qwen2 with seed 1
    assert paths[0] == "builtin:tiny" and Path(paths[1], "config.json").exists()
    servers = [launch_server(role, work / f"server_{role}", token=TOKEN) for role in ROLES]
    procs: list[subprocess.Popen] = []
    try:
        overrides = {s.role: mm.training_overrides(p, s.role, "cpu", task="token_rule", steps=100000, batch_size=2,
                                                   rollouts=2, lr=1e-2, episode_timeout_s=4.0)
                     for s, p in zip(servers, paths, strict=True)}
        boot_servers(servers, overrides, timeout=90)
        ctls = {s.role: s.client(retry_for=30) for s in servers}
        log = work / "client1.jsonl"
        procs.append(_client_proc({"servers": servers}, log))
        status = _wait_steps(ctls, {"a": 2, "b": 2})
        yield {"servers": servers, "ctls": ctls, "work": work, "log": log, "procs": procs, "status": status,
               "paths": paths}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for s in servers:
            s.stop()


def test_both_servers_train_their_own_model(swarm):
    status = swarm["status"]
    for role in ROLES:
        st = status[role]
        assert st["global_step"] >= 2 and st["pool"]["trained"] >= 2 * 4, st
        assert st["model"] == f"model-{role}"
        assert st["pool"]["last_step"]["samples"] > 0
    # different models: the two servers answer the same prompts differently
    assert swarm["paths"][0] != swarm["paths"][1]


def test_each_journal_holds_only_its_own_roles_tokens(swarm):
    servers = {s.role: s for s in swarm["servers"]}
    # the client keeps running and logs an episode only after both servers acknowledged its reports
    # (journaled before the acknowledgement): read the log first, so every logged episode is journaled
    logged = _logged(swarm["log"])
    journals = {r: _journal(servers[r]) for r in ROLES}
    assert len(logged) >= 8
    ids = {r: {rec["id"] for rec in journals[r]} for r in ROLES}
    assert not ids["a"] & ids["b"]
    for role in ROLES:
        other = "b" if role == "a" else "a"
        recs = journals[role]
        assert len(recs) >= 8
        for rec in recs:
            assert rec["meta"]["roles"] == [role], rec["meta"]
            assert set(rec["reward"]) == {role}
            assert rec["family"] == "token_rule"
            assert rec["timelines"] and all(tl["role"] == role for tl in rec["timelines"])
        # every episode the client logged for this role sits in this server's journal, with the exact
        # text this server answered (the other server's replies are never there)
        texts = {rec["id"]: "".join(b["text"] for tl in rec["timelines"] for b in tl["blocks"]
                                    if b["author"] == "llm") for rec in recs}
        checked = 0
        for entry in logged:
            eid = entry["episode_ids"][role]
            assert eid in ids[role] and eid not in ids[other]
            assert entry["urls"][role] == servers[role].url
            # the answer keeps the special tokens the model generated mid-text (issue 18); the block
            # also holds the closing end-of-turn token the answer leaves out: compare without them
            got, sent = texts[eid], entry["completions"][role]
            for tok in SPECIAL:
                got, sent = got.replace(tok, ""), sent.replace(tok, "")
            assert got.strip() == sent.strip(), (got, entry)
            checked += 1
        assert checked == len(logged)
        # role b's prompt carries role a's reply (the relay), role a's never mentions b
        for rec in recs:
            prompt = "".join(b["text"] for b in rec["timelines"][0]["blocks"] if b["author"] != "llm")
            assert ("agent a:" in prompt) == (role == "b")


def test_keys_and_ids_of_one_server_are_rejected_by_the_other(swarm):
    ctl_a, ctl_b = swarm["ctls"]["a"], swarm["ctls"]["b"]
    url_b = swarm["servers"][1].url
    ep_a = ctl_a.register("cross-check", roles=["a"])
    ep_b = ctl_b.register("cross-check", roles=["b"])
    try:
        r = httpx.post(f"{url_b}/v1/chat/completions", headers={"Authorization": f"Bearer {ep_a.key_for('a')}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(SwarmAPIError) as exc:  # A's episode id is unknown on B
            ctl_b._request("POST", f"/api/v1/episodes/{ep_a.episode_id}/report", json_body={"reward": 1.0},
                           key=ep_a.api_key)
        assert exc.value.status == 404 and exc.value.code == "episode_not_found"
        with pytest.raises(SwarmAPIError) as exc:  # B's key does not own A's episode
            ctl_a._request("POST", f"/api/v1/episodes/{ep_a.episode_id}/report", json_body={"reward": 1.0},
                           key=ep_b.api_key)
        assert exc.value.status == 403 and exc.value.code == "wrong_episode_key"
    finally:
        ep_a.abort("cross-check done")
        ep_b.abort("cross-check done")
    assert ep_a.episode_id not in {r["id"] for r in _journal(swarm["servers"][0])}


def test_killed_client_is_reaped_and_a_restarted_client_continues(swarm):
    servers, ctls, procs = swarm["servers"], swarm["ctls"], swarm["procs"]
    client = procs[0]
    # freeze the client until both servers have one of its episodes open, then kill it there
    open_ids: dict[str, set[str]] = {}
    for _ in range(50):
        client.send_signal(signal.SIGSTOP)
        time.sleep(0.3)  # a call the client sent just before it stopped is served before the snapshot
        open_ids = {r: {e["episode_id"] for e in c._request("GET", "/api/v1/episodes", admin=True).json()["running"]}
                    for r, c in ctls.items()}
        if all(open_ids.values()):
            break
        client.send_signal(signal.SIGCONT)
        time.sleep(0.1)
    assert all(open_ids.values()), open_ids
    client.send_signal(signal.SIGKILL)
    client.wait(10)
    accepted_before = {s.role: {r["id"] for r in _journal(s)} for s in servers}
    steps_before = {r: c.status()["global_step"] for r, c in ctls.items()}

    # both servers stay up; the abandoned episodes pass their 4 s deadline and are reaped
    end = time.monotonic() + 20
    ended: dict[str, dict[str, dict]] = {}
    while time.monotonic() < end:
        ended = {r: {e["episode_id"]: e for e in c._request("GET", "/api/v1/episodes?ended=4096",
                                                             admin=True).json()["ended"]}
                 for r, c in ctls.items()}
        if all(open_ids[r] <= set(ended[r]) for r in ctls):
            break
        time.sleep(0.25)
    for s in servers:
        assert s.proc.poll() is None, f"server {s.role} died"
        st = ctls[s.role].status()
        assert st["state"] in ("ROLLING", "ROLLING_POST", "WEIGHT_SYNCING"), st
        assert st["episodes"]["reaped"] >= 1
        journal_ids = {r["id"] for r in _journal(s)}
        assert accepted_before[s.role] <= journal_ids  # nothing accepted was lost
        for eid in open_ids[s.role]:
            e = ended[s.role][eid]
            if e["status"] == "finished":  # its report was still in the server's hands (a loaded machine)
                assert eid in journal_ids, e
                continue
            assert e["status"] == "aborted" and e["abort_reason"] == "deadline", e
            assert eid not in journal_ids

    # hot swap: a restarted client with an edited reward (another target letter) continues the same run
    log2 = swarm["work"] / "client2.jsonl"
    procs.append(_client_proc(swarm, log2, "--target", "a"))
    # a step may come from samples the killed client left in the pool, so wait for the new client itself
    _wait_steps(ctls, {r: steps_before[r] + 1 for r in ctls})
    end = time.monotonic() + 60
    new = _logged(log2)
    while not new and time.monotonic() < end:
        time.sleep(0.25)
        new = _logged(log2)
    assert new, "the restarted client finished no episode"
    for s in servers:
        ids = {r["id"] for r in _journal(s)}
        assert accepted_before[s.role] <= ids
        assert any(e["episode_ids"][s.role] in ids for e in new)


#: a client that plays one two-server episode and SIGKILLs itself at a stage of its end
_ATOMIC_CLIENT = r'''
import json, os, signal, sys
import httpx
from swarmkit.client import SwarmClient, swarm_episode
from swarmkit.client.sync import Episode
a_url, b_url, stage = sys.argv[1:4]
calls = {"prepare": 0, "commit": 0, "report": 0}

def dies_after(name, original):
    def wrapped(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls[name] += 1
        if stage == f"{name}{calls[name]}":
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapped

for name in calls:
    setattr(Episode, name, dies_after(name, getattr(Episode, name)))
routes = {"a": SwarmClient(a_url, retry_for=60), "b": SwarmClient(b_url, retry_for=60)}
with swarm_episode(routes, "atomic-" + stage, timeout_s=6.0, meta={"task_family": "token_rule"}) as ep:
    for role in ("a", "b"):
        httpx.post(f"{ep.base_url(role)}/chat/completions", timeout=60,
                   headers={"Authorization": f"Bearer {ep.key_for(role)}"},
                   json={"model": f"model-{role}", "messages": [{"role": "user", "content": "say e"}],
                         "max_tokens": 4}).raise_for_status()
    print(json.dumps({r: ep.episode(r).episode_id for r in routes}), flush=True)
    if stage == "report1":  # the non-atomic way: one report per server
        for role in sorted(routes, key=lambda r: routes[r].url):
            ep.episode(role).report({role: 1.0})
    else:
        ep.report({"a": 1.0, "b": 0.0})
'''


def test_a_killed_client_leaves_a_two_server_episode_on_both_servers_or_on_neither(swarm):
    """SIGKILL at each stage of the two-phase end: both journals keep the episode or neither does;
    one report per server (``report1``) is the non-atomic baseline that splits it."""
    servers, ctls = swarm["servers"], swarm["ctls"]
    for p in swarm["procs"]:  # no other client: the servers stay ROLLING (no drain runs past a deadline)
        if p.poll() is None:
            p.kill()
            p.wait(10)
    urls = {s.role: s.url for s in servers}
    stages = {"prepare1": "neither", "prepare2": "neither", "commit1": "both", "none": "both", "report1": "split"}
    procs = {st: subprocess.Popen([sys.executable, "-c", _ATOMIC_CLIENT, urls["a"], urls["b"], st],
                                  env=server_env(TOKEN), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for st in stages}
    ids = {}
    for st, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert out.strip(), f"{st}: the client printed no episode ids: {err[-2000:]}"
        ids[st] = json.loads(out.strip().splitlines()[0])
        assert p.returncode == (0 if st == "none" else -signal.SIGKILL), (st, p.returncode, err[-2000:])
    # every part ends within its 6 s deadline (+ the reaper's resolution)
    end = time.monotonic() + 40
    ended: dict[str, dict[str, dict]] = {}
    wanted = {r: {v[r] for v in ids.values()} for r in ctls}
    while time.monotonic() < end:
        ended = {r: {e["episode_id"]: e for e in c._request("GET", "/api/v1/episodes?ended=4096",
                                                             admin=True).json()["ended"]}
                 for r, c in ctls.items()}
        if all(wanted[r] <= set(ended[r]) for r in ctls):
            break
        time.sleep(0.25)
    journal = {s.role: {row["id"] for row in _journal(s)} for s in servers}
    for st, expect in stages.items():
        kept = {r: ids[st][r] in journal[r] for r in ctls}
        for r in ctls:
            assert ended[r][ids[st][r]]["status"] == ("finished" if kept[r] else "aborted"), (st, r, ended[r][ids[st][r]])
        if expect == "both":
            assert all(kept.values()), (st, kept)
        elif expect == "neither":
            assert not any(kept.values()), (st, kept)
        else:
            assert sorted(kept.values()) == [False, True], (st, kept)


def test_two_models_train_asynchronously_from_one_client(tmp_path):
    """The example in async mode (``--override trainer.mode=async``): both servers keep sampling
    while they train, each learns from its own role's tokens, within its staleness bound.

    20 steps: the tiny models' reward curve bends upward anywhere from step 5 to step 11 (which
    policy version sampled what depends on timing); over 12 steps one in eight runs had gained less
    than the margin (0.05), over 20 steps the gain was 0.33-0.58 in every run measured."""
    out = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(RUN), "--steps", "20", "--batch-size", "2", "--rollouts", "8", "--max-tokens", "8",
         "--concurrency", "8", "--override", "trainer.mode=async", "--override", "trainer.max_staleness=1",
         "--work-dir", str(tmp_path), "--out", str(out), "--timeout", "300"],
        env=server_env(TOKEN), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["failed_episodes"] == 0
    for role in ROLES:
        rows = summary["servers"][role]["steps"]
        assert len(rows) >= 20
        assert all(r["staleness_max"] <= 1 and r["staleness_bound"] == 1 for r in rows)
        first = sum(r["reward_mean"] for r in rows[:3]) / 3
        last = sum(r["reward_mean"] for r in rows[-3:]) / 3
        assert last > first + 0.1, (role, [round(r["reward_mean"], 3) for r in rows])
        states = [json.loads(line)["state"] for line in
                  (tmp_path / f"server_{role}" / "states.jsonl").read_text().splitlines()]
        assert "ROLLING_POST" not in states and "WEIGHT_SYNCING" not in states, states
