"""Several LoRA adapters on one server, end to end: routing, isolation, learning, kill -9 and resume.

A real server process (``mode=server``, the tiny model, ``model.adapters``) and real HTTP clients.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from swarmkit.client import SwarmClient
from swarmkit.testing.conformance import build_test_model
from tests.test_cycle_e2e import TOKEN, _env, _free_port, _started, _stop, start_server

ADAPTERS = ("vowel_e", "vowel_o")
#: LoRA on every projection of the tiny model, one adapter per target letter of token_rule
CONFIG = ["model=tiny", "model.lora_rank=8", "model.lora_alpha=32",
          "model.lora_target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
          f"model.adapters=[{','.join(ADAPTERS)}]", "optim.lr=5e-2", "batching.batch_size=4",
          "batching.rollouts_per_task=8"]


def _client(port: int, adapter: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "swarmkit.apps.task_client", "--url", f"http://127.0.0.1:{port}", "--task",
         "token_rule", "--task-option", f"target={adapter[-1]}", "--adapter", adapter, "--max-tokens", "8",
         "--rollouts-per-task", "8", "--concurrency", "8", "--client-id", f"c-{adapter}", *extra],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _eval(port: int, adapter: str) -> float:
    out = _client(port, adapter, "--eval", "--eval-size", "32").communicate(timeout=300)[0]
    line = [x for x in out.splitlines() if x.startswith("eval reward:")][-1]
    return float(line.split()[2])


def _journal(run_dir: Path) -> list[tuple[str, str, int | None, str]]:
    with sqlite3.connect(run_dir / "journal.sqlite") as db:
        return db.execute("SELECT episode_id, adapter, trained_step, timelines FROM episodes").fetchall()


def _train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "train"]


@pytest.mark.slow
def test_two_adapters_learn_two_rules_on_one_server(tmp_path):
    """vowel_e is rewarded for 'e', vowel_o for 'o': each learns its own letter from its own samples."""
    learn_two_rules(tmp_path, [])


def learn_two_rules(tmp_path: Path, extra: list[str]) -> None:
    """Two adapters trained at once on one server (config ``CONFIG`` + ``extra``) each learn their own rule,
    and every step trains the episodes of one adapter.

    The model is the tiny one with weights std 0.1 (``build_test_model``). At the default std 0.02 its tied
    embeddings keep every logit within about ±2.6, so a LoRA on its projections cannot move what it samples
    (sampled reward 0.07 -> 0.09 in 30 steps, entropy 6.04 of ln 512 = 6.24); its greedy answer then
    changed by argmax luck alone, 0.2-0.67, and this test failed on 2 of 4 runs at a 0.3 rise. At std 0.1
    each adapter settles within ~10 steps on one token that holds its letter, most often a word of the
    prompts, whose share is at least 0.2 (``tool`` 0.5 and ``world`` 0.2 for o; ``weather`` 0.29, ``apple``
    and ``hello`` 0.2 for e): over 10 runs its sampled reward went from 0.07 (first 3 steps) to 0.25-0.67
    and its greedy held-out reward rose by 0.17-0.65. The plateau can be lower: on 2026-12-07 a CI run settled
    vowel_o on a token with one o in eight characters (sampled 0.03 -> 0.12 from step 6 on, greedy 0.015 ->
    0.125; eight more runs on that machine plateaued at 0.33-1.0), which the earlier bound (a rise of 0.1) failed.
    Learning can also be fast: in another CI run vowel_o sampled 0.04, 0.09, 0.26, then 0.33 from step 4 on,
    so a baseline averaged over the first three steps (0.13) already held the learning and the bound "three
    times it" (0.39) failed. The baseline is therefore the first step alone, whose samples the untrained
    adapter drew (each adapter's first batch precedes its first update): the last five steps' mean must be
    at least twice it and 0.05 above it (a 1/8 plateau from the untrained 0.03-0.08 passes), and the greedy
    held-out reward must rise by 0.05."""
    port = _free_port()
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    model = build_test_model(tmp_path / "model")
    try:
        ctl = _started(port, [*CONFIG, f"model.path={model}", "trainer.total_steps=60", *extra])
        before = {a: _eval(port, a) for a in ADAPTERS}
        clients = [_client(port, a, "--train-size", "64") for a in ADAPTERS]
        deadline = time.monotonic() + 600
        while ctl.status()["global_step"] < 60 and time.monotonic() < deadline:
            time.sleep(1)
        _stop(clients)
        after = {a: _eval(port, a) for a in ADAPTERS}
        rows = _train_rows(tmp_path)
        per = {a: [r for r in rows if f"adapter/{a}/step" in r] for a in ADAPTERS}
        curves = {a: [round(r["reward_mean"], 2) for r in per[a]] for a in ADAPTERS}
        print("held-out reward before", before, "after", after, "sampled reward per step", curves)
        assert all(len(per[a]) >= 25 for a in ADAPTERS), {a: len(v) for a, v in per.items()}
        for a in ADAPTERS:  # what it samples moved, and its greedy held-out answer with it
            start, end = curves[a][0], statistics.mean(curves[a][-5:])  # start: the untrained adapter's samples
            assert end > max(2 * start, start + 0.05), (a, curves[a])
            assert after[a] > before[a] + 0.05, (a, before, after)
        # staleness counts the adapter's own versions; counted in the server's steps it read about the other
        # adapter's step count (median 16 here). The median, since a group left over by a drain is one version
        # stale, rarely more
        worst = [r["staleness_max"] for a in ADAPTERS for r in per[a]]
        assert statistics.median(worst) <= 1, worst
        # every episode has an adapter, and every step trained the episodes of one adapter only
        by_step: dict[int, set[str]] = {}
        for eid, adapter, step, _ in _journal(tmp_path):
            assert adapter in ADAPTERS, eid
            if step is not None:
                by_step.setdefault(step, set()).add(adapter)
        assert by_step and all(len(v) == 1 for v in by_step.values()), by_step
        status = ctl.status()
        assert set(status["pool"]["adapters"]) == set(ADAPTERS)
    finally:
        _stop(clients)
        _stop([server])


@pytest.mark.slow
def test_routing_isolation_and_refusals(tmp_path):
    """A step trains one adapter: its episodes only, and only its weights move; bad names are 4xx."""
    port = _free_port()
    server = start_server(tmp_path, port)
    try:
        _started(port, [*CONFIG, "trainer.total_steps=0", "batching.batch_size=1", "batching.rollouts_per_task=2"])
        url = f"http://127.0.0.1:{port}"
        sdk = SwarmClient(url, token=TOKEN, retry_for=30)
        with httpx.Client(timeout=60) as http:
            def chat(key: str, model: str | None) -> httpx.Response:
                body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}
                if model is not None:
                    body["model"] = model
                return http.post(f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})

            # the first call's model binds the episode; another adapter then is refused
            with sdk.episode("t-bind") as ep:
                assert chat(ep.api_key, "no-such-adapter").status_code == 404
                r = chat(ep.api_key, None)
                assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_required"
                assert chat(ep.api_key, "vowel_o").status_code == 200
                assert chat(ep.api_key, "gpt-4o").status_code == 200  # a framework's fixed name: its adapter
                r = chat(ep.api_key, "vowel_e")
                assert r.status_code == 400 and r.json()["error"]["code"] == "adapter_mismatch"
                ep.report(1.0)
            with pytest.raises(Exception, match="422|not served"):
                sdk.register("t-bad", adapter="nope")
            models = http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            assert {m["id"] for m in models["data"]} >= set(ADAPTERS)
            # one more vowel_o episode completes its group of 2; nothing of vowel_e is in the pool
            with sdk.episode("t-bind", adapter="vowel_o") as ep:
                assert chat(ep.api_key, None).status_code == 200
                ep.report(0.0)
        ctl = SwarmClient(url, token=TOKEN, retry_for=30)
        deadline = time.monotonic() + 120
        while ctl.status()["global_step"] < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        rows = _train_rows(tmp_path)
        assert len(rows) == 1 and "adapter/vowel_o/step" in rows[0] and rows[0]["episodes"] == 2
        assert {(a, s) for _, a, s, _ in _journal(tmp_path)} == {("vowel_o", 1)}
        # the checkpoint of step 1: vowel_o's adapter moved, vowel_e's is still its initial one (B = 0)
        ctl.checkpoint()
        from safetensors.torch import load_file

        ck = sorted((tmp_path / "checkpoints").glob("step_*"))[-1]
        b_of = {a: [t for k, t in load_file(str(ck / "adapters" / a / "adapter" / "adapter_model.safetensors")).items()
                    if "lora_B" in k] for a in ADAPTERS}
        assert all(float(t.abs().max()) == 0.0 for t in b_of["vowel_e"])
        assert any(float(t.abs().max()) > 0.0 for t in b_of["vowel_o"])
    finally:
        _stop([server])


@pytest.mark.slow
def test_kill_9_and_resume_keeps_each_adapters_weights_and_pool(tmp_path):
    port = _free_port()
    cfg = [*CONFIG, "trainer.checkpoint_every=2", "trainer.total_steps=0", "trainer.resume=true"]
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    try:
        ctl = _started(port, cfg)
        clients = [_client(port, a, "--train-size", "16") for a in ADAPTERS]
        deadline = time.monotonic() + 300
        while ctl.status()["global_step"] < 5 and time.monotonic() < deadline:
            time.sleep(0.3)
        server.send_signal(signal.SIGKILL)  # mid-run: episodes pooled after the last checkpoint
        server.wait(30)
        _stop(clients)
        ck = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
        saved = json.loads((ck / "trainer_state.json").read_text())["global_step"]
        journal = {eid: (a, s) for eid, a, s, _ in _journal(tmp_path)}
        waiting_before = {a: sum(1 for x, s in journal.values() if x == a and (s is None or s > saved))
                          for a in ADAPTERS}
        from safetensors.torch import load_file

        weights = {a: load_file(str(ck / "adapters" / a / "adapter" / "adapter_model.safetensors")) for a in ADAPTERS}
        server = start_server(tmp_path, port)
        ctl = _started(port, cfg)
        status = ctl.status()
        assert status["global_step"] == saved
        assert {a: v["waiting"] for a, v in status["pool"]["adapters"].items()} == waiting_before
        # a new checkpoint right after the resume holds exactly the weights saved before the kill
        ctl.checkpoint()
        again = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
        for a in ADAPTERS:
            now = load_file(str(again / "adapters" / a / "adapter" / "adapter_model.safetensors"))
            assert set(now) == set(weights[a]) and all(now[k].equal(weights[a][k]) for k in now), a
        steps = {a: v["step"] for a, v in status["pool"]["adapters"].items()}
        assert sum(steps.values()) == saved and all(s >= 1 for s in steps.values()), steps
        # training goes on with both adapters after the resume
        clients = [_client(port, a, "--train-size", "16") for a in ADAPTERS]
        deadline = time.monotonic() + 300
        while ctl.status()["global_step"] < saved + 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert ctl.status()["global_step"] >= saved + 2
    finally:
        _stop(clients)
        _stop([server])
        if os.environ.get("KEEP"):
            print(tmp_path)


@pytest.mark.slow
def test_each_adapter_steps_on_its_own_batch_size(tmp_path):
    """model.adapters[i].batching: vowel_e steps on 1 task x 2 rollouts, vowel_o on the shared 2 x 2."""
    port = _free_port()
    shared = [x for x in CONFIG if not x.startswith(("model.adapters", "batching."))]
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    try:
        ctl = _started(port, [*shared, "batching.batch_size=2", "batching.rollouts_per_task=2", "trainer.total_steps=0",
                              "model.adapters=[{name:vowel_e,batching:{batch_size:1}},vowel_o]"])
        batching = {a: v["batching"] for a, v in ctl.status()["pool"]["adapters"].items()}
        assert batching == {"vowel_e": {"policy": "c2", "batch_size": 1, "rollouts_per_task": 2},
                            "vowel_o": {"policy": "c2", "batch_size": 2, "rollouts_per_task": 2}}, batching
        clients = [_client(port, a, "--train-size", "8", "--rollouts-per-task", "2") for a in ADAPTERS]
        deadline = time.monotonic() + 300
        while (min(v["step"] for v in ctl.status()["pool"]["adapters"].values()) < 3
               and time.monotonic() < deadline):
            time.sleep(0.3)
        _stop(clients)
        per_step: dict[int, list[str]] = {}
        for _, adapter, step, _ in _journal(tmp_path):
            if step is not None:
                per_step.setdefault(step, []).append(adapter)
        sizes = {a: {len(v) for v in per_step.values() if v[0] == a} for a in ADAPTERS}
        assert sizes == {"vowel_e": {2}, "vowel_o": {4}}, per_step
    finally:
        _stop(clients)
        _stop([server])


@pytest.mark.slow
def test_an_adapter_added_through_the_admin_api_trains_beside_the_resumed_one(tmp_path):
    add_an_adapter(tmp_path, [])


def add_an_adapter(tmp_path: Path, extra: list[str]) -> None:
    """Adding a policy at run time (config ``CONFIG`` + ``extra``): checkpoint, configure model.adapters with
    one more and trainer.resume, restart. The adapter that trained keeps its weights and steps; the new one
    starts at step 0 and trains."""
    port = _free_port()
    one = [x for x in CONFIG if not x.startswith("model.adapters")] + extra
    server = start_server(tmp_path, port)
    clients: list[subprocess.Popen] = []
    try:
        # three steps and no more: a step the pool could still fire after the clients stop would race the
        # checkpoint (CI once resumed at step 4 after reading 3)
        ctl = _started(port, [*one, "model.adapters=[vowel_e]", "trainer.total_steps=3"])
        clients = [_client(port, "vowel_e", "--train-size", "16")]
        deadline = time.monotonic() + 300
        while ctl.status()["global_step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.3)
        _stop(clients)
        saved = ctl.checkpoint()
        from safetensors.torch import load_file

        weights = load_file(str(Path(saved["path"]) / "adapters" / "vowel_e" / "adapter" / "adapter_model.safetensors"))
        step = ctl.status()["pool"]["adapters"]["vowel_e"]["step"]
        assert step == 3 == saved["global_step"]
        ctl.configure([*one, f"model.adapters=[{','.join(ADAPTERS)}]", "trainer.total_steps=0",
                       "trainer.resume=true"])
        ctl.restart()
        status = ctl.wait_for_state("ROLLING", timeout=120)
        adapters = status["pool"]["adapters"]
        assert set(adapters) == set(ADAPTERS) and adapters["vowel_e"]["step"] == step and adapters["vowel_o"]["step"] == 0
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert set(ADAPTERS) <= {m["id"] for m in models["data"]}
        ctl.checkpoint()
        latest = tmp_path / "checkpoints" / (tmp_path / "checkpoints" / "latest").read_text().strip()
        now = load_file(str(latest / "adapters" / "vowel_e" / "adapter" / "adapter_model.safetensors"))
        assert set(now) == set(weights) and all(now[k].equal(weights[k]) for k in now)
        clients = [_client(port, "vowel_o", "--train-size", "16")]  # the new adapter trains
        deadline = time.monotonic() + 300
        while ctl.status()["pool"]["adapters"]["vowel_o"]["step"] < 2 and time.monotonic() < deadline:
            time.sleep(0.3)
        adapters = ctl.status()["pool"]["adapters"]
        assert adapters["vowel_o"]["step"] >= 2 and adapters["vowel_e"]["step"] == step
    finally:
        _stop(clients)
        _stop([server])



def _group(ctl: SwarmClient, url: str, adapter: str, task: str, rewards: list[float]) -> None:
    """One group of episodes of ``adapter`` (one short chat each), reported with ``rewards``."""
    with httpx.Client(timeout=60) as http:
        for reward in rewards:
            with ctl.episode(task, adapter=adapter) as ep:
                r = http.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                              json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
                r.raise_for_status()
                ep.report(reward)


def _adapter_steps(ctl: SwarmClient, want: dict[str, int], timeout: float = 120) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        steps = {n: a["step"] for n, a in ctl.status()["pool"]["adapters"].items()}
        if steps == want or time.monotonic() > deadline:
            return steps
        time.sleep(0.2)


def add_an_adapter_while_running(tmp_path: Path, extra: list[str]) -> None:
    """POST /api/v1/admin/adapters on a running server (config ``extra`` on top): the new adapter is served and
    trains at once on its own batching, the one that trained is left as it was, bad requests are refused and
    change nothing, and the running config lists it, so a restart resumes both."""
    from swarmkit.client import SwarmAPIError

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    ctl = SwarmClient(url, token=TOKEN, retry_for=60)
    base = ["model=tiny", "model.lora_rank=4", "model.max_adapters=3", "batching=c2", "batching.batch_size=1",
            "batching.rollouts_per_task=2", "trainer.total_steps=0", "trainer.checkpoint_every=0",
            "trainer.resume=true", *extra]
    try:
        with pytest.raises(SwarmAPIError) as err:
            ctl.add_adapter("two")
        assert err.value.status == 409, err.value
        ctl.configure([*base, "model.adapters=[one]"])
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=300)
        _group(ctl, url, "one", "t1", [0.0, 1.0])
        assert _adapter_steps(ctl, {"one": 1}) == {"one": 1}
        added = ctl.add_adapter("two", lr=0.01, batching={"rollouts_per_task": 3})
        assert added == {"adapter": "two", "adapters": ["one", "two"], "global_step": 1, "note": None}
        adapters = ctl.status()["pool"]["adapters"]
        assert adapters["two"]["step"] == 0 and adapters["one"]["step"] == 1
        assert adapters["two"]["batching"]["rollouts_per_task"] == 3 and adapters["one"]["batching"]["rollouts_per_task"] == 2
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert {"one", "two"} <= {m["id"] for m in models["data"]}
        for bad, status, part in ((dict(name="two"), 422, "listed twice"), (dict(name="has space"), 422, "has space"),
                                  (dict(name="x", batching={"batch_sise": 1}), 422, "batch_sise"),
                                  (dict(name="x", lr=-1), 422, "'lr' must be a number > 0")):
            with pytest.raises(SwarmAPIError) as err:
                ctl.add_adapter(**bad)
            assert err.value.status == status and part in str(err.value), (bad, err.value)
        assert list(ctl.status()["pool"]["adapters"]) == ["one", "two"]
        _group(ctl, url, "two", "t2", [0.0, 1.0, 0.5])  # its own group size: three
        assert _adapter_steps(ctl, {"one": 1, "two": 1}) == {"one": 1, "two": 1}
        saved = ctl.checkpoint()
        config = json.loads((Path(saved["path"]) / "config.json").read_text())
        assert config["model"]["adapters"] == ["one", {"name": "two", "lr": 0.01, "batching": {"rollouts_per_task": 3}}]
        assert (Path(saved["path"]) / "adapters" / "two" / "adapter" / "adapter_model.safetensors").exists()
        ctl.restart()  # the running config: both adapters, resumed from the checkpoint
        ctl.wait_for_state("ROLLING", timeout=300)
        assert _adapter_steps(ctl, {"one": 1, "two": 1}, timeout=5) == {"one": 1, "two": 1}
        ctl.configure([*base, "model.adapters=[one,two]"])  # a config for the next start: it does not list three
        added = ctl.add_adapter("three")
        assert added["adapters"] == ["one", "two", "three"] and "next restart" in added["note"]
        with pytest.raises(SwarmAPIError) as err:
            ctl.add_adapter("four")
        assert err.value.status == 422 and "model.max_adapters=3" in str(err.value)
    finally:
        _stop([server])
        ctl.close()


def test_an_adapter_added_while_the_server_runs_trains_at_once(tmp_path):
    add_an_adapter_while_running(tmp_path, [])
