"""The vLLM backend's copy plan (``swarmkit_plugins.backend_vllm.copy_plan``): a replay of ``load_weights``'
copies must leave the parameters exactly as ``load_weights`` would, and anything a replay cannot repeat must
leave no plan. A small torch module stands in for a vLLM model here (its loaders stack q/k/v into one
parameter and pad a vocabulary, as vLLM's do); tests/test_backend_conformance_vllm.py runs the same checks on
vLLM's own Qwen2 loaders, and the GPU conformance suite pushes through it."""

from __future__ import annotations

import pytest
import torch

from swarmkit_plugins.backend_vllm.copy_plan import load_in_place


class Stacked(torch.nn.Module):
    """q/k/v into one ``qkv`` parameter (each a row block), an embedding padded to 12 rows, a norm. ``mode``
    picks a loader that a replay cannot repeat."""

    def __init__(self, mode: str = "ok") -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4, dtype=torch.bfloat16))
        self.embed = torch.nn.Parameter(torch.zeros(12, 4))
        self.norm = torch.nn.Parameter(torch.zeros(4))
        self.mode = mode

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name in ("q.weight", "k.weight", "v.weight"):
                row = {"q": 0, "k": 4, "v": 8}[name[0]]
                self.qkv.data.narrow(0, row, 4).copy_(w)  # casts to bfloat16, as vLLM's loaders do
                loaded.add("qkv")
            elif name == "embed.weight":
                self.embed[: w.shape[0]].data.copy_(w)
                self.embed[w.shape[0]:].data.fill_(0)
                loaded.add("embed")
            elif name == "norm.weight":
                if self.mode == "converted":
                    w = w * 1.0  # a new tensor: no view of the pushed one
                if self.mode == "setitem":
                    self.norm.data[:] = w
                elif self.mode == "scaled":
                    self.norm.data.copy_(w)
                    self.norm.data.mul_(2)
                else:
                    self.norm.data.copy_(w)
                loaded.add("norm")
        return loaded


def _weights(seed: int, tie: bool = False) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(12, 4, generator=g)
    out = [("q.weight", qkv[0:4]), ("k.weight", qkv[4:8]), ("v.weight", qkv[8:12]),  # views of one tensor
           ("embed.weight", torch.randn(10, 4, generator=g)), ("norm.weight", torch.randn(4, generator=g))]
    if tie:
        out.append(("lm_head.weight", out[3][1]))
    return out


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
def test_a_replay_leaves_what_load_weights_leaves(tie):
    model, reference = Stacked(), Stacked()
    missing, plan = load_in_place(model, _weights(0, tie), None)
    assert plan is not None and missing == [] and len(plan.dsts) == 5
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    again, kept = load_in_place(model, _weights(1, tie), plan)
    assert kept is plan and again == []
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages  # nothing re-allocated
    reference.load_weights(iter(_weights(1, tie)))
    for name, value in _params(reference).items():
        assert torch.equal(_params(model)[name], value), name


def test_other_tensors_record_again():
    """Another layout, another dtype or fewer tensors: not the recorded push, so load_weights runs (and
    records anew); a model whose parameters were re-allocated too."""
    model = Stacked()
    _, plan = load_in_place(model, _weights(0), None)
    contiguous = [(n, t.clone()) for n, t in _weights(1)]  # the q/k/v are no longer views of one tensor
    _, second = load_in_place(model, contiguous, plan)
    assert second is not None and second is not plan
    _, third = load_in_place(model, [(n, t.double()) for n, t in contiguous], second)
    assert third is not second
    _, fourth = load_in_place(model, contiguous[:3], third)
    assert fourth is not third and len(fourth.dsts) == 3
    model.norm = torch.nn.Parameter(torch.zeros(4))  # what vLLM's reload_weights does to every parameter
    _, fifth = load_in_place(model, contiguous[:3], fourth)
    assert fifth is not fourth
    reference = Stacked()
    reference.load_weights(iter(contiguous[:3]))
    load_in_place(model, contiguous[:3], fifth)
    assert torch.equal(model.qkv, reference.qkv)


@pytest.mark.parametrize("mode", ["converted", "setitem", "scaled"])
def test_loaders_a_replay_cannot_repeat_leave_no_plan(mode):
    """A copy from a converted tensor, an indexed assignment, an in-place op on a value: every push goes
    through load_weights (and lands)."""
    model, reference = Stacked(mode), Stacked(mode)
    _, plan = load_in_place(model, _weights(0), None)
    assert plan is None
    load_in_place(model, _weights(1), plan)
    reference.load_weights(iter(_weights(1)))
    assert torch.equal(model.norm, reference.norm)


def test_a_copy_into_a_tensor_that_is_not_the_models_leaves_no_plan():
    class Staging(Stacked):
        def load_weights(self, weights):
            for name, w in weights:
                if name == "norm.weight":
                    staging = torch.empty(4)
                    staging.copy_(w)
                    self.norm.data.copy_(staging)
            return {"norm"}

    _, plan = load_in_place(Staging(), _weights(0), None)
    assert plan is None
