"""The one LoRA merge: peft's exact scaling, the same weights from every path.

An adapter with ``alpha_pattern`` and ``rank_pattern`` (patterns peft resolves
by "first key that matches the end of the module name") is merged by
peft's own ``merge_and_unload``, by :func:`swarmkit.training.lora.adapter_deltas`
(what the ``hf`` and ``vllm`` backends use for ``update_weights(path=...)``),
by the ``hf`` backend itself, and by the trainer's export
(:func:`merge_lora_state` with the live peft layers' scalings): all equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

from swarmkit.models import tiny_model_dir
from swarmkit.training.lora import adapter_deltas, lora_scale, merge_lora_state, pattern_key

torch.set_num_threads(1)

PATTERNS = {
    "r": 4, "lora_alpha": 8,
    # first matching key wins, as in peft: layer 0's q_proj takes 32, every other q_proj 16
    "alpha_pattern": {"layers.0.self_attn.q_proj": 32, "q_proj": 16},
    "rank_pattern": {"v_proj": 2},
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    torch.manual_seed(3)
    cfg = LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False, **PATTERNS)
    pm = get_peft_model(copy.deepcopy(base), cfg)
    folder = tmp_path_factory.mktemp("adapter")
    pm.save_pretrained(folder)
    merged = copy.deepcopy(pm).merge_and_unload().state_dict()
    return folder, base, pm, merged


def test_pattern_keys_follow_peft():
    from peft.utils.other import get_pattern_key

    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj"]
    for name in names:
        ours = pattern_key(list(PATTERNS["alpha_pattern"]), name)
        assert (ours or name) == get_pattern_key(list(PATTERNS["alpha_pattern"]), name)
    assert lora_scale(PATTERNS, names[0]) == 32 / 4
    assert lora_scale(PATTERNS, names[1]) == 16 / 4
    assert lora_scale(PATTERNS, "model.layers.1.self_attn.v_proj") == 8 / 2
    assert lora_scale({**PATTERNS, "use_rslora": True}, names[1]) == 16 / 2


def test_adapter_deltas_equal_peft_merge(adapter):
    folder, base, _, merged = adapter
    deltas, replaced = adapter_deltas(folder)
    assert not replaced and len(deltas) == 4  # q_proj and v_proj of 2 layers
    ours = dict(base.state_dict())
    for module, delta in deltas.items():
        ours[module + ".weight"] = ours[module + ".weight"] + delta
    for name, want in merged.items():
        torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=name)


def test_trainer_export_merge_equals_peft_merge(adapter):
    from peft.tuners.lora import LoraLayer

    _, _, pm, merged = adapter
    scalings = {name: float(m.scaling["default"]) for name, m in pm.get_base_model().named_modules()
                if isinstance(m, LoraLayer)}
    ours = merge_lora_state(pm.state_dict(), scalings)
    assert set(ours) == set(merged)
    for name, want in merged.items():
        torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-6, msg=name)


def test_hf_backend_serves_the_peft_merge(adapter):
    from swarmkit.testing import BackendHarness
    from swarmkit_plugins.backend_hf.engine import HFBackend

    folder, _, _, merged = adapter
    backend = HFBackend(config={"device": "cpu"}, model={"path": str(tiny_model_dir())})
    h = BackendHarness()
    try:
        h.run(backend.start())
        h.run(backend.update_weights(path=str(folder), version=1))
        served = backend.model.state_dict()
        for name, want in merged.items():
            torch.testing.assert_close(served[name], want, rtol=0, atol=1e-6, msg=name)
    finally:
        h.run(backend.close())
        h.close()
