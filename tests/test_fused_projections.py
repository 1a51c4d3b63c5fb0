"""The hf engine's fused projections (plugins/backend_hf/fused.py): the same logits as the unfused model, the
parameters stay views of the fused weight (an in-place copy reaches the fused matmul), any call order works."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from swarmkit_plugins.backend_hf.fused import fuse_projections


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def test_fused_model_gives_the_unfused_logits_and_follows_in_place_weight_copies():
    plain = _model()
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 4  # 2 layers x (qkv, gate/up)
    ids = torch.randint(0, 97, (3, 11))
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    # the parameters are views of the fused weight: a copy into one (weight sync) changes the fused matmul
    names = dict(fused.named_parameters())
    q = names["model.layers.0.self_attn.q_proj.weight"]
    k = names["model.layers.0.self_attn.k_proj.weight"]
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    with torch.no_grad():
        for (n, p), (_, src) in zip(fused.named_parameters(), plain.named_parameters(), strict=True):
            src.mul_(1.5) if n.endswith("proj.weight") else None
            p.copy_(src)
    with torch.inference_mode():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-5)
    assert set(fused.state_dict()) == set(plain.state_dict())


def test_members_called_out_of_order_or_on_other_inputs_compute_their_own():
    lin = [nn.Linear(8, n, bias=True) for n in (4, 2, 2)]
    ref = [copy.deepcopy(m) for m in lin]
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = lin
    assert fuse_projections(parent) == 1
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(parent.k_proj(y), ref[1](y))  # before the first member: its own matmul
        torch.testing.assert_close(parent.q_proj(x), ref[0](x))
        torch.testing.assert_close(parent.v_proj(y), ref[2](y))  # another input: its own matmul
        torch.testing.assert_close(parent.k_proj(x), ref[1](x))  # the input the fused matmul saw: its slice
        torch.testing.assert_close(parent.v_proj(x), ref[2](x))


@pytest.mark.parametrize("bias", [(True, False), None])
def test_groups_that_differ_are_left_alone(bias):
    parent = nn.Module()
    if bias is None:  # a missing member
        parent.q_proj, parent.k_proj = nn.Linear(8, 4), nn.Linear(8, 2)
    else:
        parent.gate_proj, parent.up_proj = nn.Linear(8, 4, bias=bias[0]), nn.Linear(8, 4, bias=bias[1])
    assert fuse_projections(parent) == 0
