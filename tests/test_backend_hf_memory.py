"""The ``hf`` engine's KV-cache memory budget (``backend.kv_cache_memory``): the sizing maths, requests that
wait for room instead of running the machine out of memory, and the clear error for one that can never fit."""

from __future__ import annotations

import asyncio

import pytest

from swarmkit_plugins.backend_hf.budget import (
    AUTO_CPU_CAP,
    MemorySpec,
    budget_bytes,
    cache_shape,
    kv_bytes_per_token,
    longest_sequence,
    parse_memory,
)
from swarmkit_plugins.backend_hf.schema import HFBackendConfig

GiB = 1024 ** 3
#: where the engine tests run (SWARMKIT_TEST_DEVICE=cuda: on a GPU, CUDA graphs included)
TEST_DEVICE = __import__("os").environ.get("SWARMKIT_TEST_DEVICE", "cpu")


# --------------------------------------------------------------------------- the maths (pure)
@pytest.mark.parametrize(("text", "spec"), [
    ("auto", MemorySpec("auto")), ("AUTO", MemorySpec("auto")),
    ("4GiB", MemorySpec("bytes", 4 * GiB)), ("4g", MemorySpec("bytes", 4 * GiB)), ("4 G", MemorySpec("bytes", 4 * GiB)),
    ("512MB", MemorySpec("bytes", 512_000_000)), ("1.5GiB", MemorySpec("bytes", int(1.5 * GiB))),
    ("4294967296", MemorySpec("bytes", 4 * GiB)), (4294967296, MemorySpec("bytes", 4 * GiB)),
    ("0.3", MemorySpec("share", 0.3)), ("1.0", MemorySpec("share", 1.0)),
])
def test_kv_cache_memory_is_parsed_as_auto_a_size_or_a_share(text, spec):
    assert parse_memory(text) == spec


@pytest.mark.parametrize("text", ["", "lots", "4XB", "0", "0GiB", "1.5", "0.0", "-1", "4 GiB extra"])
def test_a_bad_kv_cache_memory_is_refused_with_the_options(text):
    with pytest.raises(ValueError, match="kv_cache_memory"):
        parse_memory(text)


def test_a_bad_kv_cache_memory_is_a_config_problem_before_any_model_loads():
    assert HFBackendConfig(kv_cache_memory="4GiB").problems() == []
    (problem,) = HFBackendConfig(kv_cache_memory="lots").problems()
    assert problem.startswith("backend.kv_cache_memory 'lots'")


def test_the_auto_budget_is_half_the_free_device_memory_on_cuda_and_bounded_on_a_cpu():
    auto = MemorySpec("auto")
    assert budget_bytes(auto, cuda=True, free_bytes=60 * GiB) == 30 * GiB
    assert budget_bytes(auto, cuda=False, free_bytes=8 * GiB) == 2 * GiB  # a quarter of the available RAM
    assert budget_bytes(auto, cuda=False, free_bytes=500 * GiB) == AUTO_CPU_CAP  # ... at most 4 GiB
    assert budget_bytes(MemorySpec("share", 0.3), cuda=False, free_bytes=10 * GiB) == 3 * GiB
    assert budget_bytes(MemorySpec("bytes", 12345), cuda=True, free_bytes=60 * GiB) == 12345


def test_bytes_per_token_of_smollm2():
    # SmolLM2-135M: 30 layers, 3 key/value heads of 64, float32 on a CPU: 45 KiB a token, so the old cache of
    # 32 slots x 8192 positions was 12 GB (the OOM this budget fixes)
    per_token = kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64, element_size=4)
    assert per_token == 46080
    assert 32 * 8193 * per_token > 12e9


def test_cache_shape_takes_large_steps_and_tighter_shapes_only_when_the_budget_asks():
    big = 1 << 40
    # plenty of room: powers of two (capacity from 256)
    assert cache_shape(3, 300, positions=big, max_slots=32, limit=8192) == (4, 512)
    # the current shape's dimensions are kept where that costs at most twice the larger of it and the new one
    assert cache_shape(1, 10, positions=big, max_slots=32, limit=8192, current=(32, 256)) == (32, 256)
    assert cache_shape(3, 300, positions=big, max_slots=32, limit=8192, current=(32, 256)) == (32, 512)
    assert cache_shape(9, 300, positions=big, max_slots=32, limit=8192, current=(8, 1024)) == (16, 1024)
    # ... but one long sequence does not take every slot's worth of it
    assert cache_shape(1, 5000, positions=big, max_slots=32, limit=8192, current=(32, 256)) == (1, 8192)
    assert cache_shape(5, 300, positions=big, max_slots=32, limit=8192, current=(2, 8192)) == (8, 512)
    # the capacity never passes the context (limit), unless a sequence needs more
    assert cache_shape(1, 5000, positions=big, max_slots=32, limit=6000) == (1, 6000)
    # tight: the current shape is given up, then the power-of-two count, then the power-of-two length
    assert cache_shape(2, 300, positions=16 * 513, max_slots=32, limit=8192, current=(32, 256)) == (2, 512)
    assert cache_shape(3, 5000, positions=3 * 8193, max_slots=32, limit=8192) == (3, 8192)
    assert cache_shape(3, 5000, positions=3 * 6001, max_slots=32, limit=8192) == (3, 6000)
    assert cache_shape(3, 5000, positions=3 * 5001, max_slots=32, limit=8192) == (3, 5000)
    # no room: the sequence waits (None)
    assert cache_shape(3, 5000, positions=3 * 5001 - 1, max_slots=32, limit=8192) is None
    assert cache_shape(33, 10, positions=big, max_slots=32, limit=8192) is None
    assert longest_sequence(5001) == 5000


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 17, 32])
@pytest.mark.parametrize("longest", [1, 255, 256, 257, 1000, 4096, 8000])
@pytest.mark.parametrize("positions", [300, 2000, 9000, 70000, 1 << 30])
def test_a_cache_shape_always_holds_its_sequences_within_the_budget(count, longest, positions):
    shape = cache_shape(count, longest, positions=positions, max_slots=32, limit=8192, current=(8, 512))
    fits = count * (longest + 1) <= positions
    assert (shape is not None) == fits
    if shape is not None:
        slots, capacity = shape
        assert slots >= count and capacity >= longest and slots * (capacity + 1) <= positions and slots <= 32


# --------------------------------------------------------------------------- the slot cache
def test_a_reshape_moves_the_running_slots_with_what_they_cached():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from swarmkit_plugins.backend_hf.slots import SlotCache

    cache = SlotCache(layers=2, slots=4, capacity=8, kv_heads=1, head_dim=2, dtype=torch.float32,
                      device=torch.device("cpu"))
    for t in (*cache.keys, *cache.values):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape))
    before = [t.clone() for t in cache.keys]
    cache.reshape(2, 16, {3: 0, 1: 1}, length=5)
    assert (cache.slots, cache.capacity) == (2, 16) and cache.keys[0].shape == (2, 1, 17, 2)
    for old, new in zip(before, cache.keys, strict=True):
        assert torch.equal(new[0, :, :5], old[3, :, :5]) and torch.equal(new[1, :, :5], old[1, :, :5])
        assert not new[:, :, 5:].any()
    assert cache.nbytes() == 2 * 17 * cache.bytes_per_token()


# --------------------------------------------------------------------------- the engine
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.testing import build_test_model  # noqa: E402
from swarmkit_plugins.backend_hf.engine import HFBackend  # noqa: E402

#: the test model caches 1 KiB a token (2 layers x 2 key/value heads x 32 x float32 x keys and values):
#: 600 KiB hold 600 positions, two sequences of up to 299 tokens each
BUDGET = "600KiB"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_test_model(tmp_path_factory.mktemp("hf-model"))


def _prompt(i: int, n: int) -> list[int]:
    return [(31 * i + 7 * k + 3) % 400 + 3 for k in range(n)]


def _params(seed: int, max_tokens: int) -> SamplingParams:
    # EOS (id 2) suppressed so every sequence runs to max_tokens: the longest the cache must hold
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, logit_bias={2: -100.0})


def _started(model_dir, **cfg):
    return HFBackend(config={"device": TEST_DEVICE, "dtype": "float32", "batch_wait_s": 0.05, "max_batch_size": 8,
                             "kv_cache_memory": BUDGET, **cfg}, model={"path": str(model_dir)})


def test_more_long_requests_than_the_budget_holds_wait_and_match_running_alone(model_dir):
    """Six requests of 200 + 80 tokens at once, a budget of two: all complete, never more than two at a time,
    the cache never over the budget, each the same tokens and logprobs as when it ran alone."""
    async def go():
        b = _started(model_dir)
        await b.start()
        try:
            assert b.kv_budget_bytes == 600 * 1024 and b._cache.nbytes() <= b.kv_budget_bytes
            sizes: list[int] = []
            reshape = b._runner.reshape

            def watched(*a, **kw):
                reshape(*a, **kw)
                sizes.append(b._cache.nbytes())
            b._runner.reshape = watched
            jobs = [(_prompt(i, 200), _params(i, 80)) for i in range(6)]
            together = await asyncio.gather(*(b.generate(p, sp) for p, sp in jobs))
            assert b.stats["max_batch_seen"] == 2 and b.stats["kv_waits"] >= 1
            assert sizes and max(sizes) <= b.kv_budget_bytes
            alone = [await b.generate(p, sp) for p, sp in jobs]
            for (x,), (y,) in zip(together, alone, strict=True):
                assert len(x.token_ids) == 80 and x.token_ids == y.token_ids
                assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)
            assert b.engine_stats()["kv_budget_bytes"] == 600 * 1024
        finally:
            await b.close()
    asyncio.run(go())


def test_a_running_sequence_keeps_its_cache_when_a_longer_one_reshapes_it(model_dir):
    """A short request and a long one share the first batch (slots 0 and 1); the short one ends, a request too
    long for the cache's capacity joins: the cache is reshaped and the running one moves from slot 1 to 0 with
    what it had cached. Both generate what they generate alone."""
    async def go():
        b = _started(model_dir)
        await b.start()
        try:
            short, running, late = (_prompt(0, 10), _params(0, 2)), (_prompt(1, 20), _params(1, 150)), \
                (_prompt(2, 200), _params(2, 60))
            first = asyncio.ensure_future(b.generate(*short))  # slot 0
            task = asyncio.ensure_future(b.generate(*running))  # slot 1
            await first
            assert not task.done()
            moves: list[dict[int, int]] = []
            reshape = b._runner.reshape

            def watched(slots, capacity, moved=None, length=0):
                moves.append(dict(moved or {}))
                reshape(slots, capacity, moved, length)
            b._runner.reshape = watched
            late_out = await b.generate(*late)
            run_out = await task
            assert moves == [{1: 0}]
            assert run_out[0].token_ids == (await b.generate(*running))[0].token_ids
            assert late_out[0].token_ids == (await b.generate(*late))[0].token_ids
        finally:
            await b.close()
    asyncio.run(go())


def test_a_prompt_that_can_never_fit_the_budget_is_refused_with_the_option_named(model_dir):
    async def go():
        b = _started(model_dir)
        await b.start()
        try:
            with pytest.raises(ValueError, match=r"backend\.kv_cache_memory=600KiB \(600\.0 KiB\) holds 599 tokens"):
                await b.generate(_prompt(0, 700), _params(0, 4))
            # a prompt that fits gets the room the budget leaves (like the context: finish_reason "length")
            (out,) = await b.generate(_prompt(0, 590), _params(0, 50))
            assert len(out.token_ids) == 9 and out.finish_reason == "length"
        finally:
            await b.close()
    asyncio.run(go())


def test_a_budget_too_small_for_any_sequence_fails_the_start(model_dir):
    async def go():
        b = _started(model_dir, kv_cache_memory="32KiB")
        with pytest.raises(ValueError, match="kv_cache_memory=32KiB .* needs at least 65"):
            await b.start()
    asyncio.run(go())
