"""An engine step that raises never leaves anything waiting: the requests in that step fail with a clear error
and the engine goes on; an engine that cannot go on (its steps keep failing, its worker died) fails every
pending and later request at once, the server stops with the cause (``/api/v1/health`` says so) and a main job
exits non-zero with it in the console."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.errors import EngineError  # noqa: E402
from swarmkit.testing import build_test_model  # noqa: E402
from swarmkit_plugins.backend_hf.engine import HFBackend  # noqa: E402

TOKEN = "engine-failure-admin-" + "x" * 16
#: where the engine tests run (SWARMKIT_TEST_DEVICE=cuda: on a GPU, CUDA graphs included)
TEST_DEVICE = os.environ.get("SWARMKIT_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_test_model(tmp_path_factory.mktemp("hf-model"))


def _params(seed: int = 0, max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens)


def _engine(model_dir, **cfg) -> HFBackend:
    return HFBackend(config={"device": TEST_DEVICE, "dtype": "float32", "batch_wait_s": 0.0, **cfg},
                     model={"path": str(model_dir)})


def _fail_decode(engine: HFBackend, times: int | None) -> list[int]:
    """Make the engine's decode step raise ``times`` times (None: always); returns the call counter. Both
    decode paths fail: the serial one (``decode``) and the fused one of the pipeline (``step``, on CUDA)."""
    calls = [0]

    def failing(real):
        def call(*args, **kwargs):
            calls[0] += 1
            if times is None or calls[0] <= times:
                raise RuntimeError("injected decode failure")
            return real(*args, **kwargs)
        return call
    engine._runner.decode = failing(engine._runner.decode)
    engine._runner.step = failing(engine._runner.step)
    return calls


def test_a_step_that_fails_once_fails_its_requests_with_the_cause_and_the_engine_goes_on(model_dir):
    async def go():
        b = _engine(model_dir)
        await b.start()
        try:
            _fail_decode(b, times=1)
            with pytest.raises(EngineError, match="injected decode failure") as info:
                await asyncio.wait_for(b.generate([5, 6, 7], _params()), 30)
            assert not info.value.dead and b.failure() is None
            (out,) = await asyncio.wait_for(b.generate([5, 6, 7], _params()), 30)
            assert len(out.token_ids) == 6 and b.stats["failed_steps"] == 1
        finally:
            await b.close()
    asyncio.run(go())


def test_an_engine_whose_steps_keep_failing_fails_every_pending_and_later_request_at_once(model_dir):
    async def go():
        b = _engine(model_dir, max_batch_size=1)  # one at a time: the others wait in the queue
        await b.start()
        try:
            _fail_decode(b, times=None)
            results = await asyncio.wait_for(asyncio.gather(
                *(b.generate([5 + i, 6, 7], _params(i)) for i in range(4)), return_exceptions=True), 30)
            assert all(isinstance(r, EngineError) for r in results), results
            assert "injected decode failure" in (b.failure() or "")
            assert sum(r.dead for r in results) >= 3  # the first may fail before the engine is given up
            t0 = time.monotonic()
            for call in (b.generate([1, 2], _params()), b.score_prompt([1, 2, 3]),
                         b.update_weights([], version=1)):
                with pytest.raises(EngineError, match="serves no more requests") as info:
                    await asyncio.wait_for(call, 5)
                assert info.value.dead
            with pytest.raises(EngineError):
                async for _ in b.stream([1, 2], _params()):
                    pass
            assert time.monotonic() - t0 < 1.0
        finally:
            await asyncio.wait_for(b.close(), 30)
    asyncio.run(go())


def test_a_worker_that_crashes_outside_a_step_settles_every_request(model_dir):
    """A bug in the loop's own bookkeeping (not a forward) used to end the worker thread and leave every future
    unsettled forever."""
    async def go():
        b = _engine(model_dir)
        await b.start()
        try:
            def broken():
                raise KeyError("bookkeeping bug")
            b._take_joiners = broken
            with pytest.raises(EngineError, match="bookkeeping bug"):
                await asyncio.wait_for(b.generate([5, 6, 7], _params()), 30)
            assert "KeyError" in (b.failure() or "")
        finally:
            await asyncio.wait_for(b.close(), 30)
    asyncio.run(go())


def test_a_server_whose_engine_dies_answers_with_the_cause_and_goes_offline(serve_tiny_hf, tmp_path):
    with serve_tiny_hf(tmp_path, TOKEN) as (h, client):
        engine = h.swarm.backend
        with client.episode("dies") as ep:
            _fail_decode(engine, times=None)
            r = httpx.post(f"{ep.base_url}/chat/completions", timeout=30,
                           headers={"Authorization": f"Bearer {ep.api_key}"},
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert r.status_code in (500, 503), r.text[:300]
            assert "injected decode failure" in r.json()["error"]["message"]
            deadline = time.monotonic() + 20
            while client.status()["state"] != "OFFLINE" and time.monotonic() < deadline:
                time.sleep(0.05)
            status = client.status()
            assert status["state"] == "OFFLINE"
            assert status["last_error"].startswith("the inference engine failed: ")
            assert "injected decode failure" in status["last_error"]
            health = httpx.get(f"{h.url}/api/v1/health", timeout=10).json()
            assert health == {"state": "OFFLINE", "global_step": 0, "error": "the inference engine failed"}


@pytest.mark.slow
def test_the_main_job_exits_1_with_the_cause_when_its_engine_dies(tmp_path):
    """``python -m swarmkit`` (mode=local, the tiny model) whose engine's decode always raises: the job stops
    within seconds, exit status 1, the cause in the console (before: it ran forever, every episode failing, and
    once stopped waited out its clients' hour of retries)."""
    script = tmp_path / "faulty.py"
    script.write_text(textwrap.dedent("""
        import sys
        from swarmkit_plugins.backend_hf import runner

        def decode(self, ids, pos):
            raise RuntimeError("injected decode failure")
        runner.SlotRunner.decode = decode
        from swarmkit.__main__ import main
        main(sys.argv[1:])
    """))
    env = dict(os.environ, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script), "model=tiny", "task=token_rule", "task.eval_size=4", "task.max_tokens=8",
         "batching.batch_size=4", "batching.rollouts_per_task=8", "trainer.total_steps=3", "server.port=0",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 1, (out.stdout[-2000:], out.stderr[-3000:])
    assert "error: the server went OFFLINE: the inference engine failed" in out.stderr
    assert "injected decode failure" in out.stderr
    assert time.monotonic() - t0 < 120
