"""Fewer matmuls per decoder layer: the q/k/v projections (and the MLP's gate/up) as one matmul each.

A transformers decoder layer calls ``q_proj``, ``k_proj`` and ``v_proj`` on the same hidden
states one after the other (and ``gate_proj`` then ``up_proj`` in its MLP). On a GPU a decode
step of a small model is bound by the number of kernels, not by bytes (docs/benchmarks.md: ~170
GEMMs per step of a 24-layer model), so :func:`fuse_projections` concatenates each group's
weights (and biases) into one tensor, makes the modules' parameters *views* of it, and replaces
their ``forward``: the group's first module computes the one matmul for all of them and returns
its slice; each later one returns its own slice when called on the very tensor the first one saw
(else it computes its own matmul, so any call order stays correct).

The parameters stay what they were (names, shapes, values), and copying into them (weight sync,
LoRA merge and restore) writes the fused storage in place, so captured CUDA graphs stay valid.
Apply it after the model is on its device and dtype, and before anything else wraps the modules'
``forward`` (the per-row adapters of :mod:`.multi_lora` wrap the fused one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

#: the projection groups fused when a module has all of them, in the order the layer calls them
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(model: nn.Module, groups: Sequence[Sequence[str]] = GROUPS) -> int:
    """Fuse every group of ``groups`` found as plain ``nn.Linear`` children of one module (same input
    size, dtype, device, all with or all without bias); returns how many groups were fused."""
    fused = 0
    for parent in model.modules():
        for names in groups:
            mods = [getattr(parent, n, None) for n in names]
            if _fusable(mods):
                _fuse([m for m in mods if m is not None])
                fused += 1
    return fused


def _fusable(mods: list[Any]) -> bool:
    if not all(type(m) is nn.Linear for m in mods):  # subclasses (quantized, LoRA-wrapped) are left alone
        return False
    w0 = mods[0].weight
    return all(m.in_features == mods[0].in_features and m.weight.dtype == w0.dtype and m.weight.device == w0.device
               and (m.bias is None) == (mods[0].bias is None) for m in mods)


class _Group:
    """One fused group: the concatenated weight ``[sum(out), in]`` and bias, each member's column span,
    and the outputs of the last fused matmul with the input it was computed from."""

    def __init__(self, mods: list[nn.Linear]):
        with torch.no_grad():
            self.weight = torch.cat([m.weight.detach() for m in mods], dim=0)
            self.bias = torch.cat([m.bias.detach() for m in mods]) if mods[0].bias is not None else None
        self.spans: list[tuple[int, int]] = []
        lo = 0
        for m in mods:
            self.spans.append((lo, lo + m.out_features))
            lo += m.out_features
        self.last_input: torch.Tensor | None = None
        self.outputs: list[torch.Tensor] = []

    def first(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        self.last_input = x
        self.outputs = [out[..., lo:hi] for lo, hi in self.spans]
        return self.outputs[0]

    def member(self, i: int, mod: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if self.last_input is x and self.outputs:
            out = self.outputs[i]
            if i == len(self.spans) - 1:  # the group's last member: drop the references
                self.last_input, self.outputs = None, []
            return out
        return F.linear(x, mod.weight, mod.bias)


def _fuse(mods: list[nn.Linear]) -> None:
    group = _Group(mods)
    for i, (mod, (lo, hi)) in enumerate(zip(mods, group.spans, strict=True)):
        mod.weight.data = group.weight[lo:hi]  # a view: copies into the parameter land in the fused weight
        if group.bias is not None and mod.bias is not None:
            mod.bias.data = group.bias[lo:hi]
        if i == 0:
            mod.forward = group.first  # type: ignore[method-assign]
        else:
            mod.forward = (lambda x, i=i, mod=mod: group.member(i, mod, x))  # type: ignore[method-assign]
