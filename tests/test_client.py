"""The client SDK against a real-socket server (in a thread, scripted backend)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import pytest

from swarmkit.apps.serve import start_server_thread
from swarmkit.client import ServerUnavailable, SwarmAPIError, SwarmClient, SwarmError
from swarmkit.testing.scripted import ScriptedBackend

TOKEN = "client-test-admin-token"


@pytest.fixture(scope="module")
def train_cfg():
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    return validate_config(compose(["model=tiny"]), get_registry())


@pytest.fixture(scope="module")
def handle(train_cfg, tmp_path_factory):
    from swarmkit.models import build_tiny_tokenizer

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["fine, thanks"])
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("run"))}},
                            config=train_cfg, backend_factory=lambda cfg: backend)
    with SwarmClient(h.url, token=TOKEN) as c:
        c.start()
        c.wait_for_state("ROLLING", timeout=20)
    yield h
    h.stop()


@pytest.fixture()
def client(handle):
    with SwarmClient(handle.url, token=TOKEN, retry_for=10) as c:
        yield c


def on_loop(handle, fn, *args):
    handle.loop.call_soon_threadsafe(fn, *args)


def test_importing_the_client_loads_no_torch_and_no_server():
    code = ("import sys; import swarmkit.client as c; c.SwarmClient('http://127.0.0.1:1'); "
            "bad = [m for m in ('torch', 'transformers', 'starlette', 'omegaconf', 'hydra', 'swarmkit.server') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_status_has_state_step_and_pool(client):
    st = client.status()
    assert st["state"] == "ROLLING" and st["global_step"] == 0 and "episodes" in st["pool"]


def test_episode_block_reports_and_reads_timelines(client):
    import openai

    with client.episode(task_id="t1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        r = llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content == "fine, thanks"
        res = ep.report(0.75)
    assert res["accepted"] is True and res["reward"] == 0.75 and ep.ended
    tls = ep.timelines()
    assert len(tls) == 1 and tls[0]["blocks"][-1]["author"] == "llm"
    objs = ep.timelines(as_objects=True)
    assert objs[0].blocks[-1].token_ids == tls[0]["blocks"][-1]["token_ids"]
    with pytest.raises(SwarmAPIError) as e:
        ep.report(1.0)
    assert e.value.status == 409 and e.value.code == "episode_already_ended"


def test_exception_in_the_block_aborts_the_episode(client):
    with pytest.raises(RuntimeError, match="env broke"), client.episode(task_id="t2") as ep:
        raise RuntimeError("env broke")
    info = ep.status()
    assert info["status"] == "aborted" and "env broke" in info["abort_reason"]


def test_block_without_reward_is_aborted(client):
    with client.episode(task_id="t3") as ep:
        pass
    assert ep.status()["status"] == "aborted"


def test_explicit_abort_and_eval_episode(client):
    with client.episode(task_id="t4") as ep:
        assert ep.abort("tool failed")["status"] == "aborted"
    with client.episode(task_id="t5", eval=True) as ev:
        assert ev.report(1.0)["accepted"] is False


def test_roles_through_the_client(client):
    with client.episode(task_id="game", roles=["wolf", "seer"]) as ep:
        assert ep.key_for("seer") != ep.key_for("wolf") and ep.api_key == ep.key_for("wolf")
        with pytest.raises(KeyError, match="roles: wolf, seer"):
            ep.key_for("villager")
        assert ep.report({"wolf": 1.0, "seer": 0.0})["rewards"] == {"wolf": 1.0, "seer": 0.0}


def test_register_retries_while_the_server_is_busy(client, handle):
    srv = handle.swarm
    on_loop(handle, srv.enter_rolling_post)
    time.sleep(0.05)

    def resume():
        time.sleep(1.2)
        on_loop(handle, srv.enter_weight_syncing)
        time.sleep(0.2)
        on_loop(handle, srv.resume_rolling)

    threading.Thread(target=resume).start()
    t0 = time.monotonic()
    with client.episode(task_id="busy") as ep:
        ep.report(1.0)
    assert time.monotonic() - t0 >= 1.0
    assert srv.state.state == "ROLLING"


def test_busy_server_gives_a_clear_error_after_the_retry_budget(handle):
    srv = handle.swarm
    on_loop(handle, srv.enter_rolling_post)
    try:
        with SwarmClient(handle.url, retry_for=1.5) as c:
            t0 = time.monotonic()
            with pytest.raises(ServerUnavailable, match="server_busy"):
                c.register("t")
            assert time.monotonic() - t0 < 4
    finally:
        on_loop(handle, srv.enter_weight_syncing)
        on_loop(handle, srv.resume_rolling)
        time.sleep(0.1)


def test_unreachable_server_gives_a_clear_error_after_the_retry_budget():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with SwarmClient(f"http://127.0.0.1:{port}", token="x", retry_for=1.0) as c:
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable, match="ConnectError"):
            c.status()
        assert 0.8 < time.monotonic() - t0 < 4


def test_client_id_and_ready_votes_reach_the_server(client, handle):
    client.ready(True)
    state = handle.swarm.clients.all()[client.client_id]
    assert state.ready is True
    client.ready(False)
    assert handle.swarm.clients.all()[client.client_id].ready is False
    assert client.heartbeat()["client_id"] == client.client_id
    assert SwarmClient(handle.url).client_id != client.client_id


def test_wrong_admin_token_is_an_api_error(handle):
    with SwarmClient(handle.url, token="wrong") as c, pytest.raises(SwarmAPIError) as e:
        c.status()
    assert e.value.status == 403
    with SwarmClient(handle.url, token="") as c, pytest.raises(SwarmAPIError) as e:
        c.stop()
    assert e.value.status == 401


def test_configure_accepts_overrides_dict_and_yaml_file(train_cfg, tmp_path):
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}})
    try:
        with SwarmClient(h.url, token=TOKEN) as c:
            assert c.configure(["model=tiny"])["config"]["model"]["path"] == "builtin:tiny"
            assert c.configure({"model": {"path": "builtin:tiny", "max_context": 99}})["config"]["model"][
                "max_context"] == 99
            f = tmp_path / "cfg.yaml"
            f.write_text("model:\n  path: builtin:tiny\nbatching:\n  name: c1\n")
            assert c.configure(str(f))["config"]["batching"]["name"] == "c1"
            with pytest.raises(FileNotFoundError):
                c.configure(str(tmp_path / "missing.yaml"))
            with pytest.raises(SwarmAPIError) as e:
                c.configure(["model.nope=1"])
            assert e.value.status == 422
    finally:
        h.stop()


def test_wait_for_state_reports_a_failed_boot(train_cfg, tmp_path):
    def broken(cfg):
        raise OSError("weights missing")

    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=broken)
    try:
        with SwarmClient(h.url, token=TOKEN) as c:
            c.start()
            with pytest.raises(SwarmError, match="weights missing"):
                c.wait_for_state("ROLLING", timeout=10)
            assert "weights missing" in c.wait_for_state("OFFLINE", timeout=1)["last_error"]
    finally:
        h.stop()


class _SlowToClose(ScriptedBackend):
    async def close(self) -> None:
        await asyncio.sleep(1.5)


def test_a_slow_stop_waits_for_the_server_and_logs_where_it_hangs(train_cfg, tmp_path, monkeypatch, caplog):
    """stop/restart/checkpoint outlive the client's per-call timeout (an engine can take minutes to
    free), and a stop slower than SLOW_STOP_S logs every thread's stack."""
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.swarm import server as server_mod

    monkeypatch.setattr(server_mod, "SLOW_STOP_S", 0.3)
    monkeypatch.setattr("swarmkit.client.sync.LIFECYCLE_TIMEOUT_S", 10.0)
    backend = _SlowToClose(build_tiny_tokenizer(), replies=["ok"])
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=lambda cfg: backend, train=False)
    try:
        with SwarmClient(h.url, token=TOKEN, timeout=0.5) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            assert c.stop()["state"] == "OFFLINE"  # 1.5 s > the 0.5 s per-call timeout
    finally:
        h.stop()
    slow = [r.getMessage() for r in caplog.records if "stopping the server takes over" in r.getMessage()]
    assert slow and "the threads are at" in slow[0] and "--- thread" in slow[0]


def test_wait_for_state_times_out_with_the_state_it_saw(client):
    with pytest.raises(TimeoutError, match="still ROLLING"):
        client.wait_for_state(["WEIGHT_SYNCING", "ROLLING_POST"], timeout=0.3)


def test_stream_cut_by_the_client_is_still_recorded(train_cfg, tmp_path):
    import httpx

    from swarmkit.models import build_tiny_tokenizer

    slow = ScriptedBackend(build_tiny_tokenizer(), replies=["one two three four five six seven eight"], delay_s=0.05)
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=lambda cfg: slow)
    try:
        with SwarmClient(h.url, token=TOKEN) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=10)
            ep = c.register("cut")
            body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "count"}]}
            with httpx.stream("POST", ep.base_url + "/chat/completions", json=body,
                              headers={"Authorization": f"Bearer {ep.api_key}"}) as r:
                for line in r.iter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break  # hang up after the first token
            for _ in range(100):
                tls = ep.timelines()
                if tls:
                    break
                time.sleep(0.05)
            assert len(tls) == 1 and tls[0]["meta"]["complete"] is False
            assert 1 <= len(tls[0]["blocks"][-1]["token_ids"]) < 20
            assert ep.abort("cut")["status"] == "aborted"
    finally:
        h.stop()


def test_a_connection_cut_mid_request_is_retried_for_a_get_and_raised_for_a_change():
    import httpx

    from swarmkit.client import TransportError

    calls: list[str] = []

    def cut(request):
        calls.append(request.method)
        if len(calls) == 1:
            raise httpx.ReadError("connection reset by peer", request=request)
        return httpx.Response(200, json={"state": "ROLLING", "global_step": 3})

    with SwarmClient("http://127.0.0.1:9", transport=httpx.MockTransport(cut), retry_for=5) as c:
        assert c.health()["global_step"] == 3 and calls == ["GET", "GET"]  # retried
        calls.clear()
        with pytest.raises(TransportError, match="may or may not have done it") as e:
            c.register("t1")
        assert isinstance(e.value.__cause__, httpx.ReadError) and calls == ["POST"]  # not repeated


def test_a_client_token_guards_registration_and_votes(train_cfg, tmp_path, monkeypatch):
    """With server.client_token set, registering, voting and heartbeats need it (or the admin token);
    the SDK sends it (client_token=, or $SWARMKIT_CLIENT_TOKEN)."""
    import httpx

    from swarmkit.models import build_tiny_tokenizer

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "client_token": "client-secret-xyz",
                                        "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=lambda cfg: backend, train=False)
    try:
        with SwarmClient(h.url, token=TOKEN) as admin:
            admin.start()
            admin.wait_for_state("ROLLING", timeout=20)
            assert admin.register("t-admin").episode_id  # the admin token is accepted in its place
        for path, body in (("/api/v1/episodes", {"task_id": "t"}), ("/api/v1/clients/ready", {"ready": True}),
                           ("/api/v1/clients/heartbeat", {})):
            r = httpx.post(h.url + path, json=body, headers={"X-Swarm-Client": "c1"})
            assert (r.status_code, r.json()["error"]["code"]) == (401, "missing_client_token"), path
            r = httpx.post(h.url + path, json=body, headers={"X-Swarm-Client": "c1",
                                                               "Authorization": "Bearer nope"})
            assert (r.status_code, r.json()["error"]["code"]) == (403, "wrong_client_token"), path
        # issue 31: a refused request never marks its client id active (an outsider held C4 that way)
        assert "c1" not in h.swarm.clients.active()
        monkeypatch.setenv("SWARMKIT_ADMIN_TOKEN", "")
        with SwarmClient(h.url, token="", client_token="client-secret-xyz") as c:
            with c.episode("t1") as ep:
                ep.report(1.0)
            assert c.ready(True)["ready"] is True and c.heartbeat()["client_id"] == c.client_id
        monkeypatch.setenv("SWARMKIT_CLIENT_TOKEN", "client-secret-xyz")
        with SwarmClient(h.url, token="") as c:
            assert c.register("t2").episode_id
        with SwarmClient(h.url, token="", client_token="wrong") as c, pytest.raises(SwarmAPIError) as e:
            c.register("t3")
        assert e.value.status == 403
    finally:
        h.stop()


def test_a_client_votes_and_beats_only_in_its_own_name(train_cfg, tmp_path, monkeypatch):
    """Holding the client token is not enough to vote for another client: the first vote or heartbeat
    of an id binds it to a key the server issues (the SDK keeps it on disk, so a restarted client votes
    again); a vote or heartbeat in that id's name without its key is a 403 and changes nothing
    (issue 18, item 2)."""
    import httpx

    from swarmkit.models import build_tiny_tokenizer

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "client_token": "client-secret-xyz",
                                        "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=lambda cfg: backend, train=False)
    forger = {"Authorization": "Bearer client-secret-xyz", "X-Swarm-Client": "good-client"}
    try:
        with SwarmClient(h.url, token=TOKEN) as admin:
            admin.start()
            admin.wait_for_state("ROLLING", timeout=20)
            monkeypatch.setenv("SWARMKIT_CLIENT_KEYS", str(tmp_path / "keys-of-this-machine"))
            with SwarmClient(h.url, token="", client_token="client-secret-xyz", client_id="good-client") as good:
                assert good.ready(False)["ready"] is False  # binds the id; the key is kept
            for path, body, headers in (
                    ("/api/v1/clients/ready", {"ready": True, "client_id": "good-client"}, {}),
                    ("/api/v1/clients/ready", {"ready": True}, {"X-Swarm-Client-Key": "guessed"}),
                    ("/api/v1/clients/heartbeat", {}, {})):
                r = httpx.post(h.url + path, json=body, headers={**forger, **headers})
                assert (r.status_code, r.json()["error"]["code"]) == (403, "client_key_mismatch"), path
                assert "good-client" in r.json()["error"]["message"]
            assert admin.status()["clients"]["ready"] == 0  # the forged vote changed nothing
            with SwarmClient(h.url, token="", client_token="client-secret-xyz", client_id="good-client") as again:
                assert again.ready(True)["ready"] is True and "client_key" not in again.heartbeat()  # restarted
            assert admin.status()["clients"]["ready"] == 1
            monkeypatch.setenv("SWARMKIT_CLIENT_KEYS", str(tmp_path / "keys-of-another-machine"))
            with SwarmClient(h.url, token="", client_token="client-secret-xyz", client_id="good-client") as other, \
                    pytest.raises(SwarmAPIError) as e:
                other.ready(True)
            assert e.value.status == 403 and e.value.code == "client_key_mismatch"
            h.swarm.clients.forget("good-client")  # a forgotten id is free again
            with SwarmClient(h.url, token="", client_token="client-secret-xyz", client_id="good-client") as other:
                assert other.ready(True)["client_key"]
    finally:
        h.stop()


def test_a_client_holds_its_id_from_its_first_registration(train_cfg, tmp_path, monkeypatch):
    """Issue 31: whoever voted first under a client id took it over from the client that had registered
    episodes under it (its own votes then got 403). The SDK shows a key with its registrations, so the id is
    bound at the client's first contact; another caller's vote in its name is refused."""
    import httpx

    from swarmkit.models import build_tiny_tokenizer

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=lambda cfg: backend, train=False)
    monkeypatch.setenv("SWARMKIT_CLIENT_KEYS", str(tmp_path / "keys"))
    try:
        with SwarmClient(h.url, token=TOKEN) as admin:
            admin.start()
            admin.wait_for_state("ROLLING", timeout=20)
            for named in ("worker-7", None):
                with SwarmClient(h.url, client_id=named) as client:
                    ep = client.register("task-1")  # the first contact: nothing voted yet
                    r = httpx.post(h.url + "/api/v1/clients/ready", json={"ready": True},
                                   headers={"Authorization": f"Bearer {TOKEN}", "X-Swarm-Client": client.client_id})
                    assert (r.status_code, r.json()["error"]["code"]) == (403, "client_key_mismatch")
                    assert client.ready(True)["ready"] is True  # the client's own vote counts
                    ep.abort("done")
            # a raw HTTP client that registers without a key keeps today's rule: its first vote binds the id
            raw = {"Authorization": f"Bearer {TOKEN}", "X-Swarm-Client": "raw-client"}
            assert httpx.post(h.url + "/api/v1/episodes", json={"task_id": "t"}, headers=raw).status_code == 201
            assert httpx.post(h.url + "/api/v1/clients/ready", json={"ready": True}, headers=raw).json()["client_key"]
    finally:
        h.stop()


def test_concurrent_first_registrations_share_one_client_key(train_cfg, tmp_path, monkeypatch):
    """CI failure (stop 42, C4 never fired): a task client's threads registered their first episodes at
    once; each found no key (the disk lookup lets the other thread run), each made its own, the server
    bound the id to the first to arrive and the client kept the other, so every ready vote got 403 and
    C4 waited forever. One client makes one key, whatever its threads do."""
    import threading

    import swarmkit.client._common as common
    from swarmkit.models import build_tiny_tokenizer

    real_load = common.load_client_key
    lookups: list[str] = []

    def slow_load(url: str, client_id: str) -> str | None:
        key = real_load(url, client_id)
        lookups.append(client_id)
        # a slow disk: the first lookup ends first, its key is sent first; a later one used to find no key
        # either (it looked before the first was made) and make a second one, the one the client kept
        time.sleep(0.05 if len(lookups) == 1 else 0.3)
        return key

    monkeypatch.setattr(common, "load_client_key", slow_load)
    monkeypatch.setenv("SWARMKIT_CLIENT_KEYS", str(tmp_path / "keys"))
    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    h = start_server_thread({"server": {"port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}},
                            config=train_cfg, backend_factory=lambda cfg: backend, train=False)
    try:
        with SwarmClient(h.url, token=TOKEN) as admin:
            admin.start()
            admin.wait_for_state("ROLLING", timeout=20)
            with SwarmClient(h.url, token=TOKEN, client_id="threaded") as client:
                episodes = []
                threads = [threading.Thread(target=lambda: episodes.append(client.register("t"))) for _ in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert len(episodes) == 4
                assert client.ready(True)["ready"] is True  # the key the server bound is the one the client kept
                for ep in episodes:
                    ep.abort("done")
            assert admin.status()["clients"]["ready"] == 1
    finally:
        h.stop()


def test_a_dead_clients_episode_does_not_hold_the_drain(handle, client):
    """Issue 31: a client that died just before a step held it for server.drain_idle_s (29.8 s by default)
    while registrations got 503. The SDK beats every 2 s while it has an episode open; a client that missed
    three is gone, and the drain aborts its episode at once. A live client's idle episode still gets the
    whole idle window (nothing tells its silence from a long tool call but its heartbeat)."""
    import asyncio as aio

    code = ("import sys, time; from swarmkit.client import SwarmClient; "
            f"c = SwarmClient({handle.url!r}, token={TOKEN!r}); ep = c.register('doomed'); "
            "print(ep.episode_id, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        doomed = proc.stdout.readline().split()[0]
        alive = client.register("alive")  # this process lives on and beats
        time.sleep(2.5)  # the doomed client has beaten (declared its interval) at least once
        proc.kill()
        proc.wait(10)
        srv = handle.swarm
        assert srv.drain_idle_s == 30.0
        on_loop(handle, srv.enter_rolling_post)
        t0 = time.monotonic()
        fut = aio.run_coroutine_threadsafe(srv.drain(12.0), handle.loop)
        deadline = time.monotonic() + 12
        while srv.episodes.get(doomed).running and time.monotonic() < deadline:
            time.sleep(0.1)
        took = time.monotonic() - t0
        ep = srv.episodes.get(doomed)
        assert ep.status == "aborted" and ep.abort_reason == "idle at drain" and took < 9.0, (ep.status, took)
        assert srv.episodes.get(alive.episode_id).running  # beating: it keeps its idle window
        assert fut.result(20) >= 1  # the drain ran out on the live one, then aborted it
    finally:
        proc.kill()
        on_loop(handle, srv.enter_weight_syncing)
        time.sleep(0.1)
        on_loop(handle, srv.resume_rolling)
