"""The hf engine serving several LoRA adapters per row over one base (model.adapters)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarmkit.contract import SamplingParams
from swarmkit_plugins.backend_hf.engine import HFBackend
from swarmkit_plugins.backend_hf.multi_lora import row_lora_delta

MODEL = {"path": "builtin:tiny", "lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}
CFG = {"device": "cpu", "dtype": "float32", "batch_wait_s": 0.05, "max_batch_size": 8}


def random_lora(backend: HFBackend, seed: int) -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    """Large random deltas for every adapted layer (so adapters change what is sampled)."""
    g = torch.Generator().manual_seed(seed)
    assert backend._lora is not None
    out = []
    for name, layer in backend._lora.layers.items():
        _, r, d_in = layer.a.shape
        d_out = layer.b.shape[1]
        out.append((name, torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g), 2.0))
    return out


def merged(base: dict[str, torch.Tensor], lora) -> list[tuple[str, torch.Tensor]]:
    return [(m + ".weight", base[m + ".weight"] + s * b @ a) for m, a, b, s in lora]


def test_row_lora_delta_is_each_rows_own_adapter():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 6, generator=g)
    a, b = torch.randn(3, 2, 6, generator=g), torch.randn(3, 4, 2, generator=g)
    scale = torch.tensor([0.0, 1.5, 2.0])
    rows = torch.tensor([2, 0, 1])
    got = row_lora_delta(x, a, b, scale, rows)
    for r, i in enumerate(rows.tolist()):
        torch.testing.assert_close(got[r], scale[i] * x[r] @ a[i].T @ b[i].T)


@pytest.mark.parametrize("pipeline", ["off", "on"])
def test_each_request_is_served_by_its_adapter_in_one_mixed_batch(pipeline):
    """pipeline=on: the adapters' engine decodes with one fused step in flight (its rows' adapter indices set for
    the step launched), against the serial reference."""
    async def go():
        multi = HFBackend(config={**CFG, "pipeline": pipeline}, model={**MODEL, "adapters": ["left", "right"]})
        ref = HFBackend(config=CFG, model=MODEL)  # one model: the adapter merged into its weights
        await multi.start()
        await ref.start()
        try:
            loras = {"left": random_lora(multi, 1), "right": random_lora(multi, 2)}
            await multi.update_adapter("left", loras["left"], version=3, policy_version=5)
            await multi.update_adapter("right", loras["right"], version=2)
            assert multi.adapter_versions == {"left": 3, "right": 2} and multi.policy_version == 5
            prompt = multi.tokenizer("the quick brown fox")["input_ids"]

            def sp(adapter):
                return SamplingParams(max_tokens=8, temperature=0.0, adapter=adapter)

            # one burst: the three requests share prefill and decode batches
            outs = await asyncio.gather(*(multi.generate(prompt, sp(a)) for a in ("left", None, "right")))
            assert multi.stats["prefill_passes"] == 1 and multi.stats["max_batch_seen"] >= 2
            by = dict(zip(("left", None, "right"), (o[0] for o in outs), strict=True))
            assert by["left"].token_versions == [3] * len(by["left"].token_ids)
            assert by["right"].token_versions == [2] * len(by["right"].token_ids)
            assert by[None].token_versions == [5] * len(by[None].token_ids)
            assert multi.stats["fused_steps"] > 0 if pipeline == "on" else multi.stats["fused_steps"] == 0
            base = (await ref.generate(prompt, sp(None)))[0]
            assert base.token_ids == by[None].token_ids
            torch.testing.assert_close(torch.tensor(base.logprobs), torch.tensor(by[None].logprobs), atol=1e-4, rtol=0)
            weights = {k: v.clone() for k, v in ref.model.state_dict().items()}
            for name in ("left", "right"):
                await ref.update_weights(named_tensors=merged(weights, loras[name]), version=1)
                want = (await ref.generate(prompt, sp(None)))[0]
                assert want.token_ids == by[name].token_ids, name
                torch.testing.assert_close(torch.tensor(want.logprobs), torch.tensor(by[name].logprobs),
                                           atol=1e-4, rtol=0)
            assert by["left"].token_ids != by["right"].token_ids or by["left"].logprobs != by["right"].logprobs
            with pytest.raises(ValueError, match="'nope' is not served"):
                await multi.generate(prompt, sp("nope"))
            with pytest.raises(ValueError, match="echo"):
                await multi.score_prompt(prompt)
            with pytest.raises(ValueError, match="serves no adapters"):
                await ref.update_adapter("left", loras["left"], version=1)
            with pytest.raises(ValueError, match="served but not given"):
                await multi.update_adapter("left", loras["left"][:1], version=4)
        finally:
            await multi.close()
            await ref.close()
    asyncio.run(go())


def test_an_adapter_added_at_run_time_serves_the_base_then_its_lora():
    """add_adapter (POST /api/v1/admin/adapters): a free slot of model.max_adapters, version 0, the base's
    answer until update_adapter fills it; the adapters already served are untouched; no room past the cap."""
    async def go():
        multi = HFBackend(config=CFG, model={**MODEL, "adapters": ["left"], "max_adapters": 2})
        await multi.start()
        try:
            prompt = multi.tokenizer("the quick brown fox")["input_ids"]

            def sp(adapter):
                return SamplingParams(max_tokens=8, temperature=0.0, adapter=adapter)

            left = random_lora(multi, 1)
            await multi.update_adapter("left", left, version=3)
            before = (await multi.generate(prompt, sp("left")))[0]
            base = (await multi.generate(prompt, sp(None)))[0]
            await multi.add_adapter("right")
            assert multi.adapter_versions == {"left": 3, "right": 0}
            fresh, again = await asyncio.gather(multi.generate(prompt, sp("right")), multi.generate(prompt, sp("left")))
            assert fresh[0].token_ids == base.token_ids and fresh[0].token_versions == [0] * len(base.token_ids)
            assert again[0].token_ids == before.token_ids and again[0].logprobs == pytest.approx(before.logprobs, abs=1e-5)
            await multi.update_adapter("right", left, version=1)  # the same LoRA as left: the same answer
            assert (await multi.generate(prompt, sp("right")))[0].token_ids == before.token_ids
            with pytest.raises(ValueError, match="served already"):
                await multi.add_adapter("left")
            with pytest.raises(ValueError, match="at most 2 adapters"):
                await multi.add_adapter("third")
            assert multi.adapter_versions == {"left": 3, "right": 1}
        finally:
            await multi.close()
    asyncio.run(go())
