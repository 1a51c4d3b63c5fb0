"""The ``hf`` backend: logprobs, sampling controls, dynamic batching, streaming, weight updates."""

from __future__ import annotations

import asyncio
import json

import pytest

#: where the hf engine runs in these tests (SWARMKIT_TEST_DEVICE=cuda runs the suite on a GPU, float32)
TEST_DEVICE = __import__("os").environ.get("SWARMKIT_TEST_DEVICE", "cpu")
#: the engine's backend.pipeline in these tests (SWARMKIT_TEST_PIPELINE=on runs them with one decode step in
#: flight on the CPU too; auto: on where CUDA graphs run)
TEST_PIPELINE = __import__("os").environ.get("SWARMKIT_TEST_PIPELINE", "auto")

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.testing import BackendConformance, build_test_model  # noqa: E402
from swarmkit_plugins.backend_hf.engine import HFBackend  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_test_model(tmp_path_factory.mktemp("hf-model"))


@pytest.fixture(scope="module")
def suite(model_dir):
    cfg = {"device": TEST_DEVICE, "dtype": "float32", "batch_wait_s": 0.02, "max_batch_size": 32,
           "pipeline": TEST_PIPELINE}
    with BackendConformance.started(HFBackend, config=cfg, model={"path": str(model_dir), "max_context": 64},
                                    reference_dir=model_dir, tol=1e-4) as s:
        yield s


def sp(**kw):
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", 12)
    return SamplingParams(**kw)


def test_tiny_builtin_generates():
    async def go():
        b = HFBackend(config={"device": "cpu"}, model={"path": "builtin:tiny"})
        await b.start()
        try:
            ids = b.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                  add_generation_prompt=True, tokenize=False)
            out = await b.generate(b.tokenizer(ids)["input_ids"], sp(max_tokens=4))
            assert len(out) == 1 and 1 <= len(out[0].token_ids) <= 4
            assert b.dtype == torch.float32 and b.device.type == "cpu"
        finally:
            await b.close()
        with pytest.raises(RuntimeError):
            await b.generate([1, 2], sp())
    asyncio.run(go())


def test_logprobs_match_forward_pass(suite):
    for p in suite.prompts[:4]:
        out_greedy = out = suite.generate(p)[0]
        suite.assert_matches_reference(p, out, greedy=True, what="greedy")
        for seed in (0, 1):
            out = suite.generate(p, temperature=0.7, top_p=0.8, seed=seed)[0]
            suite.assert_matches_reference(p, out, greedy=False, what="sampled")
        # a tiny top_p keeps only the most likely token: sampling becomes greedy
        nucleus = suite.generate(p, temperature=1.5, top_p=1e-6, seed=0)[0]
        assert nucleus.token_ids == out_greedy.token_ids


def test_greedy_determinism_and_seeds(suite):
    p = suite.prompts[0]
    assert suite.generate(p)[0].token_ids == suite.generate(p)[0].token_ids
    a = suite.generate(p, temperature=1.0, seed=42)[0]
    assert a.token_ids == suite.generate(p, temperature=1.0, seed=42)[0].token_ids
    others = {tuple(suite.generate(p, temperature=1.0, seed=s)[0].token_ids) for s in range(4)}
    assert len(others) > 1


def test_stop_strings_and_ids(suite):
    suite.check_stop_strings()
    suite.check_stop_token_ids()
    p = suite.prompts[1]
    full = suite.generate(p, max_tokens=20)[0]
    # a stop string that appears at once: empty text, one token
    out = suite.generate(p, max_tokens=20, stop=[full.text[0]])[0]
    assert out.text == "" and out.finish_reason == "stop" and len(out.token_ids) >= 1


def test_max_tokens_and_context(suite):
    p = suite.prompts[2]
    out = suite.generate(p, max_tokens=3)[0]
    assert len(out.token_ids) <= 3
    long_prompt = (p * 20)[:60]  # max_context is 64: only 4 tokens fit
    out = suite.generate(long_prompt, max_tokens=50)[0]
    assert len(out.token_ids) <= 4
    with pytest.raises(ValueError):
        suite.generate((p * 30)[:64])
    with pytest.raises(ValueError):
        suite.generate([])
    with pytest.raises(ValueError):
        suite.generate(p, max_tokens=0)


def test_n_samples_and_top_logprobs(suite):
    suite.check_n_samples()
    suite.check_top_logprobs()


def test_concurrent_requests_are_batched_and_uncontaminated(suite):
    b = suite.backend
    prompts = [suite.prompts[i % 8][: 2 + i % 5] + suite.prompts[(i + 3) % 8][: i % 3] for i in range(16)]
    solo = [suite.generate(p)[0] for p in prompts]
    solo_sampled = [suite.generate(p, temperature=1.0, seed=i)[0] for i, p in enumerate(prompts)]
    b.reset_stats()

    async def together():
        reqs = [b.generate(p, sp()) for p in prompts]
        reqs += [b.generate(p, sp(temperature=1.0, seed=i)) for i, p in enumerate(prompts)]
        return await asyncio.gather(*reqs)

    res = suite.harness.run(together())
    sequential = sum(len(o.token_ids) for o in solo + solo_sampled)
    assert b.stats["forward_passes"] < sequential / 4, b.stats
    assert b.stats["max_batch_seen"] >= 16, b.stats
    for i in range(16):
        suite.assert_same_greedy(solo[i], res[i][0], f"greedy {i}")
        assert res[16 + i][0].token_ids == solo_sampled[i].token_ids, f"seeded {i}"
        suite.assert_matches_reference(prompts[i], res[i][0], greedy=True, what="batched")


def test_continuous_batching_admits_late_requests(suite):
    """A request arriving while another decodes joins the running batch (no waiting for it)."""
    b = suite.backend
    long_p, short_p = suite.prompts[0], suite.prompts[3]
    solo_short = suite.generate(short_p, max_tokens=4)[0]

    async def go():
        order = []
        async def run(p, n, tag, delay):
            await asyncio.sleep(delay)
            out = await b.generate(p, sp(max_tokens=n, stop_token_ids=[]))
            order.append(tag)
            return out[0]
        long_task = asyncio.ensure_future(run(long_p, 40, "long", 0))
        first = await asyncio.wait_for(_first_chunk(b, long_p), 30)
        short = await run(short_p, 4, "short", 0)
        await long_task
        return order, short, first

    b.reset_stats()
    order, short, _ = suite.harness.run(go())
    assert order[0] == "short"
    suite.assert_same_greedy(solo_short, short, "late joiner")
    assert b.stats["max_batch_seen"] >= 2


def test_batch_window_gathers_a_staggered_burst_up_to_its_cap(model_dir):
    """An idle engine waits while requests keep arriving (gap ``batch_wait_s``), at most ``batch_wait_max_s``."""
    prompt = [5, 6, 7, 8]

    async def staggered(b, count, every):
        async def one(i):
            await asyncio.sleep(i * every)
            return await b.generate(prompt, sp(max_tokens=2, stop_token_ids=[]))
        b.reset_stats()
        await asyncio.gather(*(one(i) for i in range(count)))
        return dict(b.stats)

    async def go():
        b = HFBackend(config={"device": "cpu", "batch_wait_s": 0.08, "batch_wait_max_s": 2.0},
                      model={"path": str(model_dir), "max_context": 64})
        await b.start()
        try:
            burst = await staggered(b, 6, 0.01)  # 6 calls 10 ms apart: one window, one prefill
            b.batch_wait_max_s = 0.1  # calls keep coming for 0.5 s: the cap closes the window
            capped = await staggered(b, 11, 0.05)
        finally:
            await b.close()
        return burst, capped

    burst, capped = asyncio.run(go())
    assert burst["prefill_passes"] == 1 and burst["max_batch_seen"] == 6, burst
    assert capped["prefill_passes"] >= 2, capped


async def _first_chunk(b, p):
    async for chunk in b.stream(p, sp(max_tokens=2)):
        return chunk


def test_streaming(suite):
    suite.check_streaming()
    b = suite.backend
    p = suite.prompts[4]

    async def early_exit():
        got = []
        async for c in b.stream(p, sp(max_tokens=30)):
            got.append(c)
            if len(got) == 2:
                break
        await asyncio.sleep(0.05)
        return got

    got = suite.harness.run(early_exit())
    assert len(got) == 2
    assert suite.generate(p, max_tokens=3)[0].token_ids  # the backend keeps serving

    async def times():
        stamps = []
        loop = asyncio.get_running_loop()
        async for _ in b.stream(p, sp(max_tokens=20, stop_token_ids=[])):
            stamps.append(loop.time())
        return stamps

    stamps = suite.harness.run(times())
    assert len(stamps) >= 2 and stamps[-1] > stamps[0]  # chunks arrive one by one, not in a burst

    with pytest.raises(ValueError):
        suite.harness.run(_first_chunk_n2(b, p))


async def _first_chunk_n2(b, p):
    async for c in b.stream(p, sp(n=2)):
        return c


def test_update_weights_in_place(suite, tmp_path):
    suite.check_weight_update()
    b = suite.backend
    p = suite.prompts[5]
    before = suite.generate(p)[0]
    with pytest.raises(KeyError):
        suite.update([("no.such.weight", torch.zeros(1))])
    name, t = next(iter(suite.ref.state_dict().items()))
    with pytest.raises(ValueError):
        suite.update([(name, torch.zeros(3, 3))])
    # a partial update from a safetensors folder, with FSDP-style prefixes stripped
    from safetensors.torch import save_file

    w = suite.ref.state_dict()["model.layers.0.mlp.down_proj.weight"]
    save_file({"module.model.layers.0.mlp.down_proj.weight": (w * 3).contiguous()}, str(tmp_path / "w.safetensors"))
    v = suite.update(path=str(tmp_path))
    assert b.policy_version == v
    try:  # the served weight is on the engine's device, the reference's on the CPU
        assert b.model.model.layers[0].mlp.down_proj.weight.cpu().allclose(w.cpu() * 3)
    finally:  # the suite's engine is shared by the module's tests: never leave it with the tripled weight
        suite.update([("model.layers.0.mlp.down_proj.weight", w)])
    suite.assert_same_greedy(before, suite.generate(p)[0], "restored")


def test_lora_adapter_merge_replace_unload(suite, tmp_path):
    suite.check_lora_adapter()
    import copy

    from peft import LoraConfig, get_peft_model

    b = suite.backend
    p = suite.prompts[6]
    base = suite.generate(p)[0]
    q = b.model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    folders = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        pm = get_peft_model(copy.deepcopy(suite.ref), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                                 init_lora_weights=False))
        pm.save_pretrained(tmp_path / f"a{seed}")
        folders.append((tmp_path / f"a{seed}", pm.eval()))
    suite.update(path=str(folders[0][0]))
    suite.update(path=str(folders[1][0]))  # replaces the first adapter, does not stack
    out = suite.generate(p)[0]
    suite.assert_matches_reference(p, out, greedy=True, model=folders[1][1], what="second adapter")
    assert json.loads((folders[1][0] / "adapter_config.json").read_text())["r"] == 2
    suite.harness.run(b.unload_lora(version=b.policy_version + 1))
    suite._version = b.policy_version
    assert b.model.model.layers[0].self_attn.q_proj.weight.equal(q)
    suite.assert_same_greedy(base, suite.generate(p)[0], "after unload")


def test_a_near_zero_temperature_is_greedy_and_harms_no_other_request(suite):
    """Issue 31 (critical): ``temperature: 1e-45`` used to overflow the sampler (logits / t = inf, softmax NaN)
    and fail every sequence of the batch. Below GREEDY_TEMPERATURE a request decodes greedily, and the others
    in the same batch sample as usual."""
    b = suite.backend
    p = suite.prompts[2]
    greedy = suite.generate(p, max_tokens=6, temperature=0.0)[0]

    async def together():
        tiny = [b.generate(p, sp(max_tokens=6, temperature=t, stop_token_ids=[]))
                for t in (1e-45, 5e-324, 1e-300, 9e-6)]
        normal = [b.generate(q, sp(max_tokens=6, temperature=1.0, seed=i)) for i, q in enumerate(suite.prompts[:4])]
        return await asyncio.gather(*tiny, *normal)

    res = suite.harness.run(together())
    for out in res[:4]:
        assert out[0].token_ids[:len(greedy.token_ids)] == greedy.token_ids[:len(out[0].token_ids)]
    assert all(len(o[0].token_ids) >= 1 for o in res[4:])


def test_sampling_fields_no_sampler_can_compute_are_refused(suite):
    b = suite.backend
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")},
                {"repetition_penalty": float("inf")}, {"logit_bias": {3: float("nan")}}):
        with pytest.raises(ValueError):
            suite.harness.run(b.generate(suite.prompts[0], sp(max_tokens=2, **bad)))
    # any integer seed is usable (reduced modulo 2**64), none crashes a stream
    out = suite.harness.run(b.generate(suite.prompts[0], sp(max_tokens=2, temperature=1.0, seed=2**64 + 5)))
    assert len(out[0].token_ids) == 2


def test_one_request_with_many_continuations_does_not_hold_every_slot(suite):
    """Issue 31 (generation amplification): ``n`` continuations of one request take at most half the slots
    while another request waits, so a short call is not held up for all of a long request's tokens."""
    b = suite.backend
    p = suite.prompts[1]

    async def go():
        big = asyncio.ensure_future(b.generate(p, sp(n=b.max_batch_size * 2, max_tokens=40, temperature=1.0,
                                                     stop_token_ids=[])))
        await asyncio.sleep(0.05)
        t0 = b.stats["decode_steps"]
        await b.generate(p, sp(max_tokens=2))
        steps_for_short = b.stats["decode_steps"] - t0
        big.cancel()
        return steps_for_short

    steps = suite.harness.run(go())
    assert steps <= 45, steps  # admitted within the big request's first wave (40 tokens), not after its last


def test_the_inverse_cdf_draw_is_exact_and_never_picks_a_zero():
    """The sampler draws a row's token at one host uniform per row (sampler.inverse_cdf): each token's
    share of 40,000 draws is its probability within 4 standard errors, and a token of probability zero
    (filtered by top-k/top-p) is never drawn, at the edges of the interval either."""
    import random

    from swarmkit_plugins.backend_hf.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]] * 40_000)
    rng = random.Random(0)
    u = torch.tensor([rng.random() for _ in range(40_000)])
    counts = torch.bincount(inverse_cdf(probs * 7.0, u), minlength=6).double() / 40_000  # not normalised
    p = probs[0].double()
    assert torch.all((counts - p).abs() <= 4 * (p * (1 - p) / 40_000).sqrt() + 1e-12)
    edges = inverse_cdf(probs[:3], torch.tensor([1e-12, 0.05, 1.0 - 1e-12], dtype=torch.float64))
    assert edges.tolist() == [1, 1, 4]


def _engine(model_dir, pipeline, **cfg):
    return HFBackend(config={"device": TEST_DEVICE, "dtype": "float32", "batch_wait_s": 0.02, "max_batch_size": 16,
                             "pipeline": pipeline, **cfg}, model={"path": str(model_dir), "max_context": 128})


def test_one_step_in_flight_decodes_what_the_serial_path_does(model_dir):
    """backend.pipeline=on (step t+1 launched before step t is processed, fused forward + sampling, fed from
    the device) gives the serial path's tokens, logprobs, texts and finish reasons for the same requests:
    greedy and seeded, n > 1, stop strings and ids, plain and non-plain rows in one batch, a request joining
    mid-flight, streaming, and cancelled requests beside them."""

    async def workload(b, stop_text, stop_id):
        prompts = [b.tokenizer(t)["input_ids"] for t in ("What is 12 + 7?", "The weather in Paris is",
                                                          "hello world apple banana", "0 1 2 3 4 5")]
        calls = []
        for i, p in enumerate(prompts):
            calls.append(b.generate(p, sp(max_tokens=4 + 5 * i, stop_token_ids=[])))
            calls.append(b.generate(p, sp(temperature=1.0, seed=i, max_tokens=18)))
            calls.append(b.generate(p, sp(temperature=0.7, seed=10 + i, n=3, max_tokens=7 + 2 * i)))
        calls.append(b.generate(prompts[0], sp(max_tokens=20, stop=[stop_text])))
        calls.append(b.generate(prompts[0], sp(max_tokens=20, stop_token_ids=[stop_id])))
        calls.append(b.generate(prompts[1], sp(temperature=0.9, top_p=0.8, seed=5, max_tokens=15)))  # non-plain

        async def late(delay, p, **kw):
            await asyncio.sleep(delay)
            return await b.generate(p, sp(**kw))

        async def streamed(p, **kw):
            chunks = [c async for c in b.stream(p, sp(**kw))]
            return [type(chunks[-1])(token_ids=[t for c in chunks for t in c.token_ids],
                                     logprobs=[x for c in chunks for x in c.logprobs],
                                     text="".join(c.text for c in chunks), finish_reason=chunks[-1].finish_reason,
                                     token_versions=[v for c in chunks for v in c.token_versions])]

        async def cancelled(p):
            task = asyncio.ensure_future(b.generate(p, sp(max_tokens=100, temperature=1.0, stop_token_ids=[])))
            await asyncio.sleep(0.03)
            task.cancel()
            gen = b.stream(p, sp(max_tokens=100, stop_token_ids=[]))
            got = [await gen.__anext__() for _ in range(2)]
            await gen.aclose()  # a consumer that leaves early
            return got

        calls += [late(0.03, prompts[2], temperature=1.0, seed=77, max_tokens=12),
                  late(0.05, prompts[3], temperature=1.0, seed=78, max_tokens=6, top_logprobs=2),  # non-plain
                  streamed(prompts[2], temperature=1.0, seed=3, max_tokens=16, stop=[stop_text]),
                  cancelled(prompts[3])]
        outs = await asyncio.gather(*calls)
        outs.append(await b.generate(prompts[1], sp(temperature=1.0, seed=9, max_tokens=10)))  # still serving
        return outs[:-2] + outs[-1:]

    async def go():
        serial, piped = _engine(model_dir, "off"), _engine(model_dir, "on")
        await serial.start()
        await piped.start()
        try:
            assert not serial.pipelined and piped.pipelined
            full = (await serial.generate(serial.tokenizer("What is 12 + 7?")["input_ids"], sp(max_tokens=20)))[0]
            stop_text, stop_id = full.text[3:5], full.token_ids[6]
            return (await workload(serial, stop_text, stop_id), await workload(piped, stop_text, stop_id),
                    dict(piped.stats))
        finally:
            await serial.close()
            await piped.close()

    want, got, stats = asyncio.run(go())
    assert stats["fused_steps"] >= 10 and stats["fused_steps"] < stats["decode_steps"], stats  # both paths ran
    assert len(want) == len(got)
    for i, (ws, gs) in enumerate(zip(want, got, strict=True)):
        assert len(ws) == len(gs), i
        for w, g in zip(ws, gs, strict=True):
            assert g.token_ids == w.token_ids, (i, w.token_ids, g.token_ids)
            assert (g.text, g.finish_reason) == (w.text, w.finish_reason), i
            assert g.token_versions == w.token_versions and len(g.logprobs) == len(w.token_ids), i
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    assert any(o.finish_reason == "stop" and o.text for o in want[-6]), want[-6]  # the stop string hit


def test_a_weight_swap_between_pipelined_steps_labels_tokens_with_the_weights_that_computed_them(model_dir):
    """With a step in flight, a swap lands between two steps: the tokens labelled with the old version are the
    old weights' (the solo greedy continuation), those labelled new the new weights' (a zero final norm: all
    logits 0, so token 0 at logprob -log V), old ones first."""
    import math

    async def go():
        b = _engine(model_dir, "on")
        await b.start()
        try:
            b._eos_ids = frozenset()  # run to max_tokens
            p = b.tokenizer("The weather in Paris is")["input_ids"]
            vocab = b.model.get_input_embeddings().num_embeddings
            norm = "model.norm.weight"
            original = b.model.state_dict()[norm].detach().clone()
            for max_tokens in (48, 100):
                solo = (await b.generate(p, sp(max_tokens=max_tokens)))[0]
                chunks = []
                async for c in b.stream(p, sp(max_tokens=max_tokens)):
                    chunks.append(c)
                    if len(chunks) == 3:
                        await b.update_weights([(norm, torch.zeros_like(original))], version=b.policy_version + 1)
                new = b.policy_version
                await b.update_weights([(norm, original)], version=new + 1)
                ids = [t for c in chunks for t in c.token_ids]
                lps = [x for c in chunks for x in c.logprobs]
                vers = [v for c in chunks for v in c.token_versions]
                if vers[-1] == new:
                    return ids, lps, vers, solo, new, vocab
            raise AssertionError("the swap never landed mid-generation")
        finally:
            await b.close()

    ids, lps, vers, solo, new, vocab = asyncio.run(go())
    k = vers.index(new)
    assert 3 <= k < len(ids) and vers == sorted(vers) and set(vers) == {new - 1, new}, vers
    assert ids[:k] == solo.token_ids[:k]
    torch.testing.assert_close(torch.tensor(lps[:k]), torch.tensor(solo.logprobs[:k]), atol=1e-5, rtol=0)
    assert ids[k:] == [0] * (len(ids) - k)
    assert all(abs(x + math.log(vocab)) < 1e-4 for x in lps[k:]), lps[k:]


class _FakeGraph:
    """A CPU stand-in for a captured CUDA graph: replaying runs the captured body on the same static buffers."""

    def __init__(self, body, b, length, out):
        self.body, self.b, self.length, self.out = body, b, length, out

    def replay(self):
        self.out.copy_(self.body(self.b, self.length))


def _fake_graphs(runner, fail_fused=False):
    """Make ``runner`` take its CUDA-graph branches on the CPU: a capture runs the body twice (the warm-up, which
    writes the cache and the feedback as on a GPU) and keeps it to replay; ``fail_fused``: fused captures fail."""
    captured = []

    def capture(b, length, fused=False):
        if fused and fail_fused:
            runner.fused_failed = "RuntimeError: injected"
            return None
        body = runner._step_body if fused else runner._decode_body
        for _ in range(2):
            out = body(b, length)
        graph = _FakeGraph(body, b, length, out.clone())
        store = runner._fused if fused else runner._graphs
        store[(b, length)] = (graph, graph.out)
        captured.append((fused, b, length))
        return store[(b, length)]

    runner.use_graphs = True
    runner._capture = capture
    return captured


@pytest.mark.parametrize("fail_fused", [False, True])
def test_pipelined_steps_over_graphs_capture_from_host_rows_only(model_dir, fail_fused):
    """The engine's graph branches, on the CPU with stand-in graphs: a fused step whose shape (rows, window) is
    new is captured only with every row's input from the host (the step in flight is drained first: a
    capture's warm-up consumes the feedback; the runner refuses otherwise, which would fail the requests), as
    sequences cross window buckets and finish; the tokens are the serial path's. A failed capture of the fused
    step leaves the engine decoding the serial way."""
    prompts = [[5 + i, 6, 7, 8, 9 + i] * (1 + i % 3) for i in range(6)]

    def params(i):
        return sp(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=20 + 17 * (5 - i), stop_token_ids=[])

    async def go():
        serial, piped = _engine(model_dir, "off"), _engine(model_dir, "on")
        await serial.start()
        await piped.start()
        try:
            serial._eos_ids = piped._eos_ids = frozenset()
            captured = _fake_graphs(piped._runner, fail_fused)
            want = [(await serial.generate(p, params(i)))[0] for i, p in enumerate(prompts)]
            got = await asyncio.gather(*(piped.generate(p, params(i)) for i, p in enumerate(prompts)))
            return want, [g[0] for g in got], captured, dict(piped.stats)
        finally:
            await serial.close()
            await piped.close()

    want, got, captured, stats = asyncio.run(go())
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and len(w.token_ids) >= 20
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    fused = [c for c in captured if c[0]]
    if fail_fused:
        assert not fused and stats["fused_steps"] == 1 and captured, (captured, stats)  # then decode graphs
    else:
        assert len({c[2] for c in fused}) >= 2 and len({c[1] for c in fused}) >= 2, captured  # windows, widths
        assert stats["fused_steps"] == stats["decode_steps"], stats
