"""Several inference replicas behind one server (``backend.replicas``).

Unit tests of the balancer and of :class:`ReplicaSet` over scripted engines (the
layer under test is the set: routing, retirement, sync); then a real server on
127.0.0.1 with two hf replicas of the tiny model, driven by the openai SDK:
affinity per episode, a training step that reaches both replicas, a replica
that breaks mid-run taken out of rotation while the server keeps serving; and
the main job learning with two replicas.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict

import pytest
from omegaconf import OmegaConf

from swarmkit.contract import SamplingParams
from swarmkit.contract.backend import ROUTING_KEY
from swarmkit.errors import ConfigError
from swarmkit.swarm.replicas import (
    Balancer,
    Replica,
    ReplicaError,
    ReplicaSet,
    build_replicas,
    check_replicable,
)
from swarmkit.testing.scripted import ScriptedBackend

TOKEN = "replica-admin-token-" + "x" * 12


class Breakable(ScriptedBackend):
    """A scripted engine that can be told to fail (an engine error) or to hang on a weight update."""

    def __init__(self, tokenizer, name: str):
        super().__init__(tokenizer, replies=[f"reply from {name}"])
        self.broken: Exception | None = None
        self.hang_sync = False
        self.updates: list[int] = []

    async def generate(self, prompt_ids, params):
        if self.broken is not None:
            raise self.broken
        return await super().generate(prompt_ids, params)

    async def stream(self, prompt_ids, params):
        if self.broken is not None:
            raise self.broken
        async for chunk in super().stream(prompt_ids, params):
            yield chunk

    async def update_weights(self, named_tensors=None, *, path=None, version):
        if self.hang_sync:
            await asyncio.sleep(3600)
        self.updates.append(version)
        self.policy_version = version


def _set(tokenizer, n=2, timeout=5.0):
    return ReplicaSet([Breakable(tokenizer, f"r{i}") for i in range(n)], sync_timeout_s=timeout)


async def _call(rs: ReplicaSet, key: str | None, stream: bool = False) -> str:
    token = ROUTING_KEY.set(key)
    try:
        params = SamplingParams(max_tokens=16)
        if stream:
            return "".join([c.text async for c in rs.stream([1, 2, 3], params)])
        return (await rs.generate([1, 2, 3], params))[0].text
    finally:
        ROUTING_KEY.reset(token)


# ---------------------------------------------------------------------- balancer
def test_balancer_binds_an_episode_to_one_replica_and_spreads_new_ones():
    reps = [Replica(i, None) for i in range(3)]  # type: ignore[arg-type]
    b = Balancer(reps)
    first = {k: b.pick(k).index for k in ("a", "b", "c")}
    assert sorted(first.values()) == [0, 1, 2]  # three new episodes, three replicas
    for _ in range(5):
        assert {k: b.pick(k).index for k in first} == first  # every later call: the same replica
    reps[1].in_flight = 4  # busy: new episodes go elsewhere, bound ones stay
    assert b.pick("d").index != 1 and b.pick("b").index == first["b"]
    b.forget("a")
    assert b.bound("a") is None and "a" not in reps[first["a"]].episodes


def test_balancer_rebinds_the_episodes_of_a_dead_replica_and_fails_when_none_is_left():
    reps = [Replica(i, None) for i in range(2)]  # type: ignore[arg-type]
    b = Balancer(reps)
    idx = b.pick("ep").index
    reps[idx].alive, reps[idx].error = False, "boom"
    assert b.pick("ep").index == 1 - idx
    reps[1 - idx].alive, reps[1 - idx].error = False, "bang"
    with pytest.raises(ReplicaError, match="no inference replica is alive.*boom|bang"):
        b.pick("ep")


def test_balancer_forgets_the_oldest_episodes_past_its_capacity():
    reps = [Replica(0, None)]  # type: ignore[arg-type]
    b = Balancer(reps, capacity=3)
    for k in "abcd":
        b.pick(k)
    assert b.bound("a") is None and b.bound("d") == 0 and len(reps[0].episodes) == 3


# ---------------------------------------------------------------------- the set
def test_calls_of_an_episode_stay_on_one_replica(tokenizer):
    rs = _set(tokenizer)

    async def go():
        seen = defaultdict(set)
        for ep in ("e1", "e2", "e3", "e4"):
            for _ in range(3):
                seen[ep].add(await _call(rs, ep))
                seen[ep].add(await _call(rs, ep, stream=True))
        return seen

    seen = asyncio.run(go())
    assert all(len(v) == 1 for v in seen.values()), seen
    assert {t for v in seen.values() for t in v} == {"reply from r0", "reply from r1"}  # both used


def test_a_broken_replica_is_retired_and_its_call_retried_on_another(tokenizer):
    rs = _set(tokenizer)

    async def go():
        await _call(rs, "ep")  # bound to some replica
        idx = rs.balancer.bound("ep")
        rs.replicas[idx].backend.broken = RuntimeError("CUDA error: an illegal memory access")
        text = await _call(rs, "ep")  # the engine error: retired, the call served by the other
        text_stream = await _call(rs, "ep2", stream=True)
        return idx, text, text_stream

    idx, text, text_stream = asyncio.run(go())
    other = f"reply from r{1 - idx}"
    assert text == other and text_stream == other
    st = rs.replica_status()
    assert not st[idx]["alive"] and "illegal memory access" in st[idx]["error"] and st[1 - idx]["alive"]
    assert rs.engine_stats()["replicas_alive"] == 1.0


def test_a_request_error_does_not_retire_a_replica(tokenizer):
    rs = _set(tokenizer)
    for rep in rs.replicas:
        rep.backend.broken = ValueError("prompt too long")
    with pytest.raises(ValueError, match="prompt too long"):
        asyncio.run(_call(rs, "ep"))
    assert all(r["alive"] for r in rs.replica_status())


def test_weight_sync_reaches_every_replica_and_names_one_that_does_not_confirm(tokenizer):
    rs = _set(tokenizer, n=3, timeout=0.3)

    async def go():
        await rs.update_weights([("w", 1)], version=1)
        rs.replicas[2].backend.hang_sync = True
        t0 = time.monotonic()
        with pytest.raises(ReplicaError, match=r"replica 2: did not confirm weights v2 within 0.3 s.*2 of 3"):
            await rs.update_weights([("w", 2)], version=2)
        assert time.monotonic() - t0 < 3
        await rs.update_weights([("w", 2)], version=2)  # the cycle's retry: the replicas left take it

    asyncio.run(go())
    assert [r.backend.updates for r in rs.replicas] == [[1, 2, 2], [1, 2, 2], [1]]
    assert rs.policy_version == 2 and not rs.replica_status()[2]["alive"]
    assert "did not confirm" in rs.replica_status()[2]["error"]


def test_build_replicas_places_each_on_its_device(tokenizer):
    made = []

    def make(cfg):
        made.append(cfg)
        return ScriptedBackend(tokenizer)

    rs = build_replicas(make, {"name": "hf", "device": "auto"}, 2, ["cuda:0", "cuda:1"], 60.0)
    assert [c["device"] for c in made] == ["cuda:0", "cuda:1"]
    assert [r["device"] for r in rs.replica_status()] == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="no 'device' option"):
        build_replicas(make, {"name": "x"}, 2, ["a", "b"], 60.0)


def test_replica_keys_are_validated_for_any_backend():
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    cfg = validate_config(compose(["model=tiny", "+backend.replicas=2", "+backend.replica_devices=[cpu,cpu]"]),
                          get_registry())
    assert cfg.backend.replicas == 2 and list(cfg.backend.replica_devices) == ["cpu", "cpu"]
    plain = validate_config(compose(["model=tiny"]), get_registry())
    assert "replicas" not in plain.backend  # unchanged when not asked for
    with pytest.raises(ConfigError) as err:
        validate_config(compose(["model=tiny", "+backend.replicas=0", "+backend.replica_devices=[cpu]",
                                 "+backend.replica_sync_timeout_s=0"]), get_registry())
    text = str(err.value)
    assert "backend.replicas: must be >= 1" in text and "1 device(s) listed for backend.replicas=0" in text
    assert "replica_sync_timeout_s: must be > 0" in text


# ---------------------------------------------------------------------- a real server, two hf replicas
@pytest.fixture
def two_replica_server(train_cfg, tmp_path):
    from swarmkit.apps.serve import start_server_thread

    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.backend.device = "cpu"
    cfg.backend.batch_wait_s = 0.002
    cfg.backend.replicas = 2
    cfg.batching.batch_size, cfg.batching.rollouts_per_task = 2, 2
    cfg.trainer.total_steps = 0
    cfg.logger = []
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path)}}, config=cfg)
    yield h
    h.stop()


def _record_routes(rs: ReplicaSet) -> dict[str, set[int]]:
    """Wrap each replica's engine to note which episode each call came from (the engines still run)."""
    routes: dict[str, set[int]] = defaultdict(set)
    for rep in rs.replicas:
        eng, i = rep.backend, rep.index
        real_generate, real_stream = eng.generate, eng.stream

        async def generate(ids, params, _g=real_generate, _i=i):
            routes[ROUTING_KEY.get()].add(_i)
            return await _g(ids, params)

        def stream(ids, params, _s=real_stream, _i=i):
            routes[ROUTING_KEY.get()].add(_i)
            return _s(ids, params)

        eng.generate, eng.stream = generate, stream
    return routes


def test_two_hf_replicas_serve_with_affinity_train_and_survive_a_dead_one(two_replica_server):
    import openai

    from swarmkit.client import SwarmClient

    h = two_replica_server
    with SwarmClient(h.url, token=TOKEN, retry_for=30) as c:
        c.start()
        c.wait_for_state("ROLLING", timeout=120)
        rs = h.swarm.backend
        assert isinstance(rs, ReplicaSet) and len(rs.replicas) == 2
        routes = _record_routes(rs)

        def episode(i: int, stream: bool) -> str:
            with c.episode(f"task-{i // 2}") as ep:
                agent = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
                messages = [{"role": "user", "content": f"count to {i}"}]
                for _ in range(3):  # three turns, each sending the history back
                    if stream:
                        parts = agent.chat.completions.create(model="m", messages=messages, max_tokens=6,
                                                              stream=True)
                        text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
                    else:
                        text = agent.chat.completions.create(model="m", messages=messages,
                                                             max_tokens=6).choices[0].message.content
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
                ep.report(float(i % 2))
                return ep.episode_id

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(lambda i: episode(i, i % 2 == 0), range(4)))
        assert all(len(routes[e]) == 1 for e in ids), dict(routes)  # every call of an episode: one replica
        assert {next(iter(routes[e])) for e in ids} == {0, 1}  # concurrent episodes spread over both
        end = time.monotonic() + 120
        while c.status()["global_step"] < 1 and time.monotonic() < end:
            time.sleep(0.2)
        st = c.status()
        assert st["global_step"] >= 1
        assert [r["policy_version"] for r in st["replicas"]] == [st["policy_version"]] * 2  # both updated
        assert st["engine"]["replicas_alive"] == 2

        # issue 31: a near-zero temperature is greedy; it used to crash the sampler and retire both replicas
        with c.episode("task-tiny-t") as ep:
            agent = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
            for t in (1e-45, 5e-324):
                agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=t)
            ep.report(0.0)
        assert c.status()["engine"]["replicas_alive"] == 2

        # replica 1's engine breaks: the server takes it out and keeps serving from replica 0
        rs.replicas[1].backend.generate = _raise  # type: ignore[method-assign]
        rs.replicas[1].backend.stream = _raise_stream  # type: ignore[method-assign]
        with ThreadPoolExecutor(4) as pool:
            more = list(pool.map(lambda i: episode(i, i % 2 == 0), range(4, 8)))
        st = c.status()
        assert st["state"] != "OFFLINE" and st["replicas"][0]["alive"] and not st["replicas"][1]["alive"]
        assert "device lost" in st["replicas"][1]["error"] and st["engine"]["replicas_alive"] == 1
        assert len(more) == 4
        text = h.swarm.status()
        assert json.dumps(text)  # the status stays JSON
        metrics = c._http.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
        assert 'swarmkit_replica_up{replica="1"} 0.0' in metrics and 'swarmkit_replica_up{replica="0"} 1.0' in metrics


async def _raise(*_a, **_k):
    raise RuntimeError("device lost")


def _raise_stream(*_a, **_k):
    async def gen():
        raise RuntimeError("device lost")
        yield  # pragma: no cover

    return gen()


@pytest.mark.slow  # about 40 s: the slow step of .ci/run
def test_the_main_job_learns_with_two_replicas(tmp_path):
    from test_learning import run_token_rule_job

    run_token_rule_job(tmp_path, "+backend.replicas=2", "backend.device=cpu")
    replicas = json.loads((tmp_path / "summary.json").read_text())["replicas"]
    assert [r["alive"] for r in replicas] == [True, True]
    assert all(r["calls"] > 50 for r in replicas), replicas  # both served (eval and training)
    assert [r["policy_version"] for r in replicas] == [30, 30]  # and both got every step's weights


def test_an_update_every_replica_refuses_retires_none(tokenizer):
    rs = _set(tokenizer, n=2)

    async def bad_update(*_a, **_k):
        raise RuntimeError("tensors share memory")

    for rep in rs.replicas:
        rep.backend.update_weights = bad_update
    with pytest.raises(ReplicaError, match="failed on every replica \\(all kept in rotation\\)"):
        asyncio.run(rs.update_weights([("w", 1)], version=1))
    assert all(r["alive"] for r in rs.replica_status()) and rs.policy_version == 0


def test_a_backend_that_cannot_run_twice_in_a_process_refuses_replicas():
    class Single(ScriptedBackend):
        replicable = False

    check_replicable(Single, "single", 1)
    with pytest.raises(ValueError, match="backend 'single' cannot run several engines in one server process"):
        check_replicable(Single, "single", 2)
    check_replicable(ScriptedBackend, "scripted", 4)
    from swarmkit_plugins.backend_vllm.engine import VLLMBackend  # imports no vllm

    with pytest.raises(ValueError, match="backend 'vllm' cannot run several engines"):
        check_replicable(VLLMBackend, "vllm", 2)
