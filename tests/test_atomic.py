"""Multi-server episodes end atomically: prepare on every server, commit the primary, then the rest;
a server whose client vanished resolves its prepared part from the primary's outcome.

Two real-socket servers in threads of this process (scripted backend: this tests the episode
protocol, not a model); the resolver talks to the other server over HTTP like in production.
The SIGKILLed-client version with real models and journals is in tests/test_multi_model.py.
"""

from __future__ import annotations

import time

import httpx
import pytest

from swarmkit.apps.serve import start_server_thread
from swarmkit.client import SwarmAPIError, SwarmClient, swarm_episode
from swarmkit.testing.scripted import ScriptedBackend

TOKEN = "atomic-test-admin-token"


@pytest.fixture(scope="module")
def train_cfg():
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    return validate_config(compose(["model=tiny"]), get_registry())


def _server(train_cfg, tmp_path_factory):
    from swarmkit.models import build_tiny_tokenizer

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("run"))}},
                            config=train_cfg, backend_factory=lambda cfg: backend, train=False)
    with SwarmClient(h.url, token=TOKEN) as c:
        c.start()
        c.wait_for_state("ROLLING", timeout=20)
    h.swarm.reaper_interval_s = 0.05
    h.swarm.prepared_grace_s = 1.0  # (the boot set the config's 60 s)
    return h


@pytest.fixture(scope="module")
def servers(train_cfg, tmp_path_factory):
    hs = [_server(train_cfg, tmp_path_factory) for _ in range(2)]
    yield sorted(hs, key=lambda h: h.url)  # the primary of a two-server episode is the first by URL
    for h in hs:
        h.stop()


def _clients(servers):
    return [SwarmClient(h.url, token=TOKEN, retry_for=10) for h in servers]


def _chat(ep, role):
    r = httpx.post(f"{ep.base_url(role)}/chat/completions", headers={"Authorization": f"Bearer {ep.key_for(role)}"},
                   json={"model": "m", "messages": [{"role": "user", "content": f"hi {role}"}], "max_tokens": 4})
    return r


def _status(client, episode_id):
    return client._call("GET", f"/api/v1/episodes/{episode_id}", admin=True)


def _wait_ended(client, episode_id, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = _status(client, episode_id)
        if st["status"] in ("finished", "aborted"):
            return st
        time.sleep(0.05)
    raise AssertionError(f"episode {episode_id} still {st['status']}")


def test_prepare_blocks_calls_and_commit_pools_it_once(servers):
    a, _ = _clients(servers)
    ep = a.register("t-1", roles=["x"])
    ans = ep.prepare({"x": 0.5})
    assert ans["status"] == "prepared" and ans["rewards"] == {"x": 0.5}
    r = httpx.post(f"{ep.base_url}/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                   json={"model": "m", "messages": [{"role": "user", "content": "more?"}]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "episode_prepared"
    with pytest.raises(SwarmAPIError) as e:
        ep.report({"x": 1.0})
    assert e.value.code == "episode_prepared"
    first = ep.commit()
    assert first["status"] == "finished" and first["accepted"] is True and first["rewards"] == {"x": 0.5}
    assert ep.commit() == first  # a retried commit answers the same
    with pytest.raises(SwarmAPIError) as e:
        ep.abort()
    assert e.value.status == 409


def test_commit_needs_a_prepared_episode_and_a_primary_must_be_well_formed(servers):
    a, _ = _clients(servers)
    ep = a.register("t-2")
    with pytest.raises(SwarmAPIError) as e:
        ep.commit()
    assert e.value.code == "episode_not_prepared"
    # issue 31: a primary off this server's peers (default: loopback) is refused, so a client cannot make
    # the server post to a URL of its choosing (blind SSRF, repeated until 60 s past the deadline)
    for bad in ({"url": "ftp://x", "episode_id": "e", "api_key": "k"}, {"url": "http://x"}, "http://x",
                {"url": "http://169.254.169.254/latest", "episode_id": "e", "api_key": "k"},
                {"url": "https://example.com:8443", "episode_id": "e", "api_key": "k"}):
        with pytest.raises(SwarmAPIError) as e:
            a._call("POST", f"/api/v1/episodes/{ep.episode_id}/prepare", json_body={"reward": 1.0, "primary": bad},
                    key=ep.api_key)
        assert e.value.status == 422 and "primary" in str(e.value)
    ep.abort()


def test_swarm_episode_ends_every_part_together(servers):
    a, b = _clients(servers)
    with swarm_episode({"civilian": a, "spy": b}, "game-1", meta={"task_family": "spy"}) as ep:
        assert ep.primary.server_url == a.url
        assert _chat(ep, "civilian").status_code == 200 and _chat(ep, "spy").status_code == 200
        out = ep.report({"civilian": 1.0, "spy": 0.0})
    assert [r["status"] for r in out.values()] == ["finished", "finished"]
    assert _status(a, ep.episode("civilian").episode_id)["rewards"] == {"civilian": 1.0}
    assert _status(b, ep.episode("spy").episode_id)["accepted"] is True


def test_an_error_in_the_block_drops_every_part(servers):
    a, b = _clients(servers)
    with pytest.raises(RuntimeError), swarm_episode({"civilian": a, "spy": b}, "game-2") as ep:
        _chat(ep, "spy")
        raise RuntimeError("the game crashed")
    for client, role in ((a, "civilian"), (b, "spy")):
        st = _status(client, ep.episode(role).episode_id)
        assert st["status"] == "aborted" and "the game crashed" in st["abort_reason"]


def test_frozen_roles_play_in_eval_episodes_and_routes_to_one_server_share_an_episode(servers):
    a, b = _clients(servers)
    with swarm_episode({"civilian": a, "spy": b}, "game-3", frozen=["spy"]) as ep:
        assert not ep.episode("civilian").eval and ep.episode("spy").eval
        out = ep.report({"civilian": 0.0, "spy": 1.0})
    assert sorted(r["accepted"] for r in out.values()) == [False, True]
    with swarm_episode({"civilian": a, "spy": a}, "game-4") as ep:
        assert len(ep.episodes) == 1 and ep.episode("spy") is ep.episode("civilian")
        ep.report({"civilian": 1.0, "spy": 0.0})
    with pytest.raises(ValueError, match="freeze all of them or none"):
        with swarm_episode({"civilian": a, "spy": a}, "game-5", frozen=["spy"]):
            pass
    with pytest.raises(ValueError, match="exactly the roles"):
        with swarm_episode({"civilian": a, "spy": b}, "game-6") as ep:
            ep.report({"civilian": 1.0})


def _parts(servers, task):
    """Two parts of one episode, registered with a 1 s deadline (primary on the first server)."""
    a, b = _clients(servers)
    pa = a.register(task, roles=["civilian"], timeout_s=1.0)
    pb = b.register(task, roles=["spy"], timeout_s=1.0)
    return a, b, pa, pb


def test_a_client_gone_after_the_primary_commit_still_gets_both_kept(servers):
    a, b, pa, pb = _parts(servers, "crash-after-commit")
    pa.prepare({"civilian": 1.0})
    pb.prepare({"spy": 0.0}, primary=pa)
    pa.commit()  # ... and the client dies here: B resolves its part from A at the deadline
    st = _wait_ended(b, pb.episode_id)
    assert st["status"] == "finished" and st["accepted"] is True and st["rewards"] == {"spy": 0.0}


@pytest.mark.parametrize("stage", ["both prepared", "only the primary prepared", "only the other prepared"])
def test_a_client_gone_before_the_primary_commit_gets_both_dropped(servers, stage):
    a, b, pa, pb = _parts(servers, f"crash-{stage.replace(' ', '-')}")
    if stage != "only the other prepared":
        pa.prepare({"civilian": 1.0})
    if stage != "only the primary prepared":
        pb.prepare({"spy": 0.0}, primary=pa)
    # ... the client dies: nobody commits
    for client, ep in ((a, pa), (b, pb)):
        st = _wait_ended(client, ep.episode_id)
        assert st["status"] == "aborted" and st["accepted"] is False, st
    with pytest.raises(SwarmAPIError) as e:  # a late client cannot commit the primary any more
        pa.commit()
    assert e.value.status in (409, 410)


def test_an_unreachable_primary_is_asked_until_the_grace_then_the_part_is_dropped(servers):
    _, b = _clients(servers)
    pb = b.register("no-primary", roles=["spy"], timeout_s=0.5)
    gone = {"url": "http://127.0.0.1:9", "episode_id": "ep-gone", "api_key": "sk-gone"}
    b._call("POST", f"/api/v1/episodes/{pb.episode_id}/prepare", json_body={"reward": {"spy": 1.0}, "primary": gone},
            key=pb.api_key)
    time.sleep(0.8)
    assert _status(b, pb.episode_id)["status"] == "prepared"  # past its deadline, inside the 1 s grace
    st = _wait_ended(b, pb.episode_id)
    assert st["status"] == "aborted" and "unreachable" in st["abort_reason"]


def test_async_swarm_episode_ends_every_part_together_or_drops_them(servers):
    import asyncio

    from swarmkit.client import AsyncSwarmClient, async_swarm_episode

    async def main():
        a, b = (AsyncSwarmClient(h.url, token=TOKEN, retry_for=10) for h in servers)
        async with a, b:
            routes = {"civilian": a, "spy": b}
            async with async_swarm_episode(routes, "async-game", frozen=["spy"]) as ep:
                assert ep.episode("spy").eval and not ep.episode("civilian").eval
                out = await ep.report({"civilian": 1.0, "spy": 0.0})
            with pytest.raises(RuntimeError):
                async with async_swarm_episode(routes, "async-crash") as crashed:
                    raise RuntimeError("boom")
            return out, [await crashed.episode(r).status() for r in ("civilian", "spy")]

    out, crashed = asyncio.run(main())
    assert sorted(r["accepted"] for r in out.values()) == [False, True]
    assert [c["status"] for c in crashed] == ["aborted", "aborted"]


def test_a_lost_answer_to_the_primary_commit_leaves_the_parts_to_their_servers(servers, monkeypatch):
    """The primary committed but its answer was lost: the client must not abort the other part
    (that would split the episode); the other server commits it from the primary at the deadline."""
    from swarmkit.client import ServerUnavailable
    from swarmkit.client.sync import Episode

    a, b = _clients(servers)
    real_commit = Episode.commit

    def commit_then_lose_the_answer(self):
        real_commit(self)
        raise ServerUnavailable("connection reset (the answer was lost)")

    with pytest.raises(ServerUnavailable), swarm_episode({"civilian": a, "spy": b}, "lost-ack", timeout_s=1.0) as ep:
        monkeypatch.setattr(Episode, "commit", commit_then_lose_the_answer)
        ep.report({"civilian": 1.0, "spy": 0.0})
    monkeypatch.setattr(Episode, "commit", real_commit)
    assert ep.in_doubt and not ep.committed
    assert _status(a, ep.primary.episode_id)["status"] == "finished"
    st = _wait_ended(b, ep.episode("spy").episode_id)
    assert st["status"] == "finished" and st["accepted"] is True  # resolved from the primary, not aborted


def test_peers_name_the_servers_a_primary_may_live_on():
    from swarmkit.server.routes.episodes import _peer_allowed

    assert _peer_allowed("http://127.0.0.1:8001", ["loopback"])
    assert _peer_allowed("http://localhost:8001/x", ["loopback"]) and _peer_allowed("http://[::1]:9", ["loopback"])
    assert not _peer_allowed("http://10.0.0.2:8000", ["loopback"])
    assert _peer_allowed("http://10.0.0.2:8000/", ["loopback", "http://10.0.0.2:8000"])
    assert not _peer_allowed("http://10.0.0.2:8001", ["http://10.0.0.2:8000"])
    assert _peer_allowed("https://swarm.example", ["https://swarm.example:443"])
    assert not _peer_allowed("http://127.0.0.1:8001", [])


def test_roles_of_one_server_with_different_adapters_are_parts_of_their_own():
    """On a server with model.adapters an episode trains one adapter: roles bound to different adapters
    get an episode each there, ordered by server then adapter (the primary first)."""
    from types import SimpleNamespace

    from swarmkit.client.multi import plan_parts

    a, b = SimpleNamespace(url="http://a"), SimpleNamespace(url="http://b")
    parts = plan_parts({"civilian": a, "spy": a, "judge": b}, adapters={"civilian": "civilians", "spy": "spies"})
    assert [(p[0].url, p[1], p[2], p[3]) for p in parts] == [
        ("http://a", ["civilian"], False, "civilians"), ("http://a", ["spy"], False, "spies"),
        ("http://b", ["judge"], False, None)]
    with pytest.raises(ValueError, match="freeze all of them or none"):  # one adapter: one episode for both
        plan_parts({"civilian": a, "spy": a}, frozen=["spy"], adapters={"civilian": "x", "spy": "x"})
    assert plan_parts({"civilian": a, "spy": a}, frozen=["spy"],
                      adapters={"civilian": "civilians", "spy": "spies"})[1][2] is True  # frozen: its own eval part
    with pytest.raises(ValueError, match="no route"):
        plan_parts({"civilian": a}, adapters={"spy": "spies"})


def test_parts_on_one_server_never_hold_its_drain(tmp_path, monkeypatch):
    """The spy game as two adapters of one server stalled for a drain's whole timeout: its first part was
    registered, a step's drain began and waited for that part, and the second part's registration waited
    for the drain. A later part whose server is busy now drops the parts registered so far, and the set
    is registered again once the step is over."""
    import asyncio

    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    cfg = validate_config(compose(["mode=server", "model=tiny", "model.lora_rank=8", "model.adapters=[civilians,spies]"]),
                          get_registry())
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path)}}, config=cfg, train=False)  # the real hf engine
    srv, drains, began = h.swarm, [], []
    real_register = SwarmClient.register

    def register(self, *args, **kwargs):
        ep = real_register(self, *args, **kwargs)
        if not began:  # a step begins right after the game's first part was registered
            began.append(True)

            async def drain_then_resume():
                t0 = time.monotonic()
                aborted = await srv.drain(timeout_s=20)
                drains.append((time.monotonic() - t0, aborted))
                srv.enter_weight_syncing()
                srv.resume_rolling()

            def step():
                srv.enter_rolling_post()
                asyncio.ensure_future(drain_then_resume())

            h.loop.call_soon_threadsafe(step)
            deadline = time.monotonic() + 5
            while srv.state.state == "ROLLING" and time.monotonic() < deadline:
                time.sleep(0.01)
        return ep

    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=30) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=60)
            monkeypatch.setattr(SwarmClient, "register", register)
            routes = {"civilian": c, "spy": c}
            with swarm_episode(routes, "pair-1", adapters={"civilian": "civilians", "spy": "spies"}) as ep:
                assert {ep.episode(r).adapter for r in routes} == {"civilians", "spies"}
                answers = ep.report({"civilian": 1.0, "spy": 0.0})
            assert all(a["status"] == "finished" for a in answers.values())
            seconds, aborted = drains[0]
            assert aborted == 0 and seconds < 5, drains  # the drain did not wait for a held part
            dropped = [e for e in srv.episodes.ended() if e.abort_reason and "registered again" in e.abort_reason]
            assert [e.adapter for e in dropped] == ["civilians"]
    finally:
        h.stop()
