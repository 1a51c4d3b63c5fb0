"""AsyncSwarmClient against a real server (a thread on 127.0.0.1, the hf backend, the tiny model).

Agents talk to it through ``openai.AsyncOpenAI`` over real sockets; retries
are provoked by putting the server in ROLLING_POST (its real 503 +
Retry-After) and observed through ``on_retry`` and the ``swarmkit.client``
log. Each test drives its own event loop with :func:`asyncio.run`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from swarmkit.apps.serve import start_server_thread  # noqa: E402
from swarmkit.client import (  # noqa: E402
    AsyncEpisode,
    AsyncSwarmClient,
    RetryEvent,
    ServerUnavailable,
    SwarmAPIError,
    SwarmClient,
)
from swarmkit.client._common import Retry  # noqa: E402

TOKEN = "async-client-test-admin-token"
TINY = ["model=tiny", "backend=hf", "backend.device=cpu", "backend.batch_wait_s=0.01"]


@pytest.fixture(scope="module")
def train_cfg():
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    return validate_config(compose(TINY), get_registry())


@pytest.fixture(scope="module")
def handle(train_cfg, tmp_path_factory):
    """A ROLLING server with the tiny model (no training: accepted episodes stay in memory)."""
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("async-run"))}},
                            config=train_cfg, train=False)

    async def boot():
        async with AsyncSwarmClient(h.url, token=TOKEN) as c:
            await c.start()
            await c.wait_for_state("ROLLING", timeout=60)

    asyncio.run(boot())
    yield h
    h.stop()


def on_loop(handle, fn, *args):
    handle.loop.call_soon_threadsafe(fn, *args)


def busy_for(handle, seconds: float) -> threading.Thread:
    """ROLLING_POST now (new episodes get 503 + Retry-After), back to ROLLING after ``seconds``."""
    srv = handle.swarm
    on_loop(handle, srv.enter_rolling_post)
    deadline = time.monotonic() + 2
    while srv.state.state != "ROLLING_POST" and time.monotonic() < deadline:
        time.sleep(0.01)

    def resume():
        time.sleep(seconds)
        on_loop(handle, srv.enter_weight_syncing)
        time.sleep(0.05)
        on_loop(handle, srv.resume_rolling)

    t = threading.Thread(target=resume, daemon=True)
    t.start()
    return t


def test_full_episode_with_async_openai(handle):
    async def main():
        async with AsyncSwarmClient(handle.url, token=TOKEN) as client:
            st = await client.status()
            assert st["state"] == "ROLLING"
            assert (await client.health())["state"] == "ROLLING"
            async with client.episode(task_id="t1", meta={"who": "async"}) as ep:
                assert isinstance(ep, AsyncEpisode) and not ep.ended
                llm = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
                try:
                    r = await llm.chat.completions.create(
                        model="swarm", messages=[{"role": "user", "content": "2+2?"}], max_tokens=6)
                finally:
                    await llm.close()
                assert r.usage.completion_tokens >= 1
                res = await ep.report(0.75)
            assert res["accepted"] is True and res["reward"] == 0.75 and ep.ended
            assert (await ep.status())["status"] == "finished"
            tls = await ep.timelines()
            assert len(tls) == 1 and tls[0]["blocks"][-1]["author"] == "llm"
            assert len(tls[0]["blocks"][-1]["token_ids"]) == r.usage.completion_tokens
            objs = await ep.timelines(as_objects=True)
            assert objs[0].blocks[-1].token_ids == tls[0]["blocks"][-1]["token_ids"]
            with pytest.raises(SwarmAPIError) as e:
                await ep.report(1.0)
            assert e.value.status == 409 and e.value.code == "episode_already_ended"

    asyncio.run(main())


def test_concurrent_episodes_with_gather(handle):
    n = 4

    barrier = asyncio.Barrier(n)
    running: list[int] = []

    async def one(client: AsyncSwarmClient, i: int) -> tuple[str, dict, int]:
        async with client.episode(task_id=f"g{i}") as ep:
            await barrier.wait()  # all n episodes are open at once
            running.append(len(handle.swarm.episodes.running()))
            async with openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0) as llm:
                r = await llm.chat.completions.create(
                    model="swarm", messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=5)
            res = await ep.report(i / n)
            return ep.episode_id, res, len((await ep.timelines())[0]["blocks"][-1]["token_ids"]) - \
                r.usage.completion_tokens

    async def main():
        async with AsyncSwarmClient(handle.url, token=TOKEN) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))

    out = asyncio.run(main())
    ids = [o[0] for o in out]
    assert len(set(ids)) == n
    assert [o[1]["reward"] for o in out] == [i / n for i in range(n)]
    assert all(o[1]["accepted"] for o in out) and all(o[2] == 0 for o in out)
    assert min(running) >= n


def test_exceptions_and_missing_rewards_abort_the_episode(handle):
    async def main():
        async with AsyncSwarmClient(handle.url, token=TOKEN, retry_for=10) as client:
            with pytest.raises(RuntimeError, match="env broke"):
                async with client.episode(task_id="a1") as ep:
                    raise RuntimeError("env broke")
            info = await ep.status()
            assert info["status"] == "aborted" and "env broke" in info["abort_reason"]

            async with client.episode(task_id="a2") as ep2:
                pass
            assert (await ep2.status())["status"] == "aborted"

            async with client.episode(task_id="a3") as ep3:
                assert (await ep3.abort("tool failed"))["status"] == "aborted"
            async with client.episode(task_id="a4", eval=True) as ev:
                assert (await ev.report(1.0))["accepted"] is False

            async with client.episode(task_id="game", roles=["wolf", "seer"]) as g:
                assert g.key_for("seer") != g.key_for("wolf") and g.api_key == g.key_for("wolf")
                res = await g.report({"wolf": 1.0, "seer": 0.0})
            assert res["rewards"] == {"wolf": 1.0, "seer": 0.0}

            # a cancelled task aborts its episode too
            started = asyncio.Event()
            box: dict = {}

            async def agent():
                async with client.episode(task_id="a5") as ep5:
                    box["ep"] = ep5
                    started.set()
                    await asyncio.sleep(30)

            task = asyncio.create_task(agent())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await box["ep"].status())["status"] == "aborted"

    asyncio.run(main())


def test_ready_votes_and_heartbeat_reach_the_server(handle):
    async def main():
        async with AsyncSwarmClient(handle.url, client_id="async-voter") as client:
            await client.ready(True)
            assert handle.swarm.clients.all()["async-voter"].ready is True
            await client.ready(False)
            assert handle.swarm.clients.all()["async-voter"].ready is False
            assert (await client.heartbeat())["client_id"] == "async-voter"
            with pytest.raises(SwarmAPIError) as e:
                await client.stop()  # no admin token
            assert e.value.status == 401

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_register_retries_while_the_server_trains_and_says_so(handle, caplog, kind):
    events: list[RetryEvent] = []
    caplog.set_level(logging.DEBUG, logger="swarmkit.client")
    t0 = time.monotonic()
    resumer = busy_for(handle, 1.2)
    if kind == "async":
        async def main():
            async with AsyncSwarmClient(handle.url, retry_for=20, on_retry=events.append) as client:
                async with client.episode(task_id="busy") as ep:
                    return await ep.report(1.0)

        res = asyncio.run(main())
    else:
        with SwarmClient(handle.url, retry_for=20, on_retry=events.append) as client, \
                client.episode(task_id="busy") as ep:
            res = ep.report(1.0)
    resumer.join()
    assert res["accepted"] is True and time.monotonic() - t0 >= 1.0
    assert events, "no retry was reported"
    first = events[0]
    assert (first.method, first.path, first.status, first.state) == ("POST", "/api/v1/episodes", 503, "ROLLING_POST")
    assert first.attempt == 2 and first.wait_s >= 0.5 and first.waited_s < 1.0
    assert "server_busy" in first.reason
    assert [e.attempt for e in events] == list(range(2, len(events) + 2))
    retries = [r for r in caplog.records if r.name == "swarmkit.client" and "retrying" in r.getMessage()]
    assert len(retries) == len(events)
    # a normal weight sync: the first retry of each server state at INFO (with what it means), the others at
    # DEBUG (issue 36); a retry may land in WEIGHT_SYNCING after ROLLING_POST, a state of its own
    firsts = {e.attempt for e in events if e.state not in {f.state for f in events if f.attempt < e.attempt}}
    assert [r.levelno for r in retries] == [logging.INFO if e.attempt in firsts else logging.DEBUG for e in events]
    line = retries[0].getMessage()
    assert line.startswith("server in ROLLING_POST (503 server_busy), retrying POST /api/v1/episodes in ")
    assert "(attempt 2, " in line and " s waited)" in line and "training a step (normal)" in line


def test_busy_server_gives_a_clear_error_after_the_retry_budget(handle):
    srv = handle.swarm
    on_loop(handle, srv.enter_rolling_post)
    try:
        async def main():
            async with AsyncSwarmClient(handle.url, retry_for=1.5) as c:
                await c.register("t")

        t0 = time.monotonic()
        with pytest.raises(ServerUnavailable, match="server_busy"):
            asyncio.run(main())
        assert time.monotonic() - t0 < 4
    finally:
        on_loop(handle, srv.enter_weight_syncing)
        on_loop(handle, srv.resume_rolling)
        time.sleep(0.1)


def test_unreachable_server_retries_are_reported_then_fail(caplog):
    caplog.set_level(logging.INFO, logger="swarmkit.client")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    events: list[RetryEvent] = []

    async def main():
        async with AsyncSwarmClient(f"http://127.0.0.1:{port}", token="x", retry_for=1.0,
                                    on_retry=events.append) as c:
            await c.status()

    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable, match="ConnectError"):
        asyncio.run(main())
    assert 0.8 < time.monotonic() - t0 < 4
    assert len(events) >= 3 and all(e.status is None and e.state is None for e in events)
    waits = [e.wait_s for e in events]
    assert waits[1] > waits[0]  # exponential backoff (0.1, 0.2, 0.4 ... with +-20 % jitter)
    assert any(r.getMessage().startswith("server unreachable (ConnectError") for r in caplog.records)


def test_an_on_retry_callback_that_raises_stops_the_retries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def give_up(event: RetryEvent) -> None:
        raise KeyboardInterrupt(f"gave up at attempt {event.attempt}")

    async def main():
        async with AsyncSwarmClient(f"http://127.0.0.1:{port}", retry_for=30, on_retry=give_up) as c:
            await c.health()

    with pytest.raises(KeyboardInterrupt, match="attempt 2"):
        asyncio.run(main())


def test_the_backoff_schedule_is_shared_and_honours_retry_after():
    now = [0.0]
    r = Retry("http://h", "GET", "/p", budget=10.0, clock=lambda: now[0], jitter=lambda: 0.5)
    waits = []
    for _ in range(6):
        waits.append(r.after_error(httpx.ConnectError("refused")))
        now[0] += waits[-1]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0])
    busy = httpx.Response(503, headers={"Retry-After": "3"},
                          json={"error": {"message": "server busy (WEIGHT_SYNCING: ...)", "code": "server_busy"}})
    assert r.after_busy(busy) == pytest.approx(3.0)
    now[0] = 9.99
    with pytest.raises(ServerUnavailable, match=r"8 attempts\); last: 503 server_busy"):
        r.after_busy(busy)


def test_controller_calls_through_the_async_client(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="swarmkit.client")
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN, "run_dir": str(tmp_path)}})
    try:
        async def main():
            async with AsyncSwarmClient(h.url, token=TOKEN) as c:
                assert (await c.wait_for_state("OFFLINE", timeout=5))["state"] == "OFFLINE"
                with pytest.raises(SwarmAPIError) as e:
                    await c.configure(["model.nope=1"])
                assert e.value.status == 422
                cfg = tmp_path / "cfg.yaml"
                cfg.write_text("model:\n  path: builtin:tiny\n")
                assert (await c.configure(str(cfg)))["config"]["model"]["path"] == "builtin:tiny"
                assert (await c.configure(TINY))["config"]["model"]["path"] == "builtin:tiny"
                await c.start()
                await c.wait_for_state("ROLLING", timeout=60)
                async with c.episode("after-start") as ep:
                    assert (await ep.report(0.0))["status"] == "finished"
                assert (await c.stop())["state"] == "OFFLINE"
                with pytest.raises(TimeoutError, match="still OFFLINE"):
                    await c.wait_for_state("ROLLING", timeout=0.3)

        asyncio.run(main())
    finally:
        h.stop()
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the server")]
    assert "waiting for the server to be ROLLING: it is OFFLINE (" in waits[-1]
