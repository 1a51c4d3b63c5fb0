"""Per-row LoRA adapters over one served base (``model.adapters``).

Every linear layer that ``model.lora_target_modules`` names gets the deltas of all adapters
stacked: ``A`` ``[N+1, r, in]``, ``B`` ``[N+1, out, r]``, ``scale`` ``[N+1]`` (index 0 is
"no adapter": zeros). Before each forward the engine writes each batch row's adapter index
into one device buffer (``rows``), and the layer adds, row by row::

    y[b] = x[b] @ W.T + scale[i_b] · (x[b] @ A[i_b].T) @ B[i_b].T      i_b = rows[b]

as two batched matmuls over the gathered ``A`` / ``B`` of the rows. So one forward serves a
decode batch whatever adapters its rows use (no split into per-adapter batches, the slot
cache's rows stay slots, and a captured CUDA graph stays valid: it reads the same ``rows``
buffer and the stacked tensors, which weight swaps copy into in place).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from swarmkit.training.lora import pattern_key


class MultiLora:
    """The stacked adapters of a served model and the per-row index buffer (see the module docstring)."""

    def __init__(self, model: nn.Module, names: Sequence[str], rank: int, targets: Sequence[str], rows: int,
                 capacity: int | None = None):
        """``capacity``: the adapters it has room for (``model.max_adapters``; at least ``names``)."""
        self.names = list(names)
        self.index = {n: i + 1 for i, n in enumerate(self.names)}
        self.capacity = max(int(capacity or 0), len(self.names))
        self.rank = int(rank)
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        #: adapter index of each batch row (0: none); rows past a forward's batch are not read
        self.rows = torch.zeros(int(rows), dtype=torch.long, device=self.device)
        self.layers: dict[str, _LayerLora] = {}
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and pattern_key(list(targets), name) is not None:
                self.layers[name] = _LayerLora(mod, self.capacity + 1, self.rank, self.rows)
        if not self.layers:
            raise ValueError(f"model.lora_target_modules {list(targets)} names no linear layer of the served model")

    def set_rows(self, indices: Sequence[int]) -> None:
        """The adapter index of rows ``0..len-1`` for the coming forward (one host-to-device copy)."""
        host = torch.zeros(len(indices), dtype=torch.long)
        host[:] = torch.tensor(list(indices), dtype=torch.long)
        self.rows[: len(indices)].copy_(host, non_blocking=True)

    @torch.no_grad()
    def add(self, name: str) -> None:
        """Serve adapter ``name`` too, in a free slot (zeros: the base until :meth:`load` fills it)."""
        if name in self.index:
            raise ValueError(f"adapter '{name}' is served already")
        free = sorted(set(range(1, self.capacity + 1)) - set(self.index.values()))
        if not free:
            raise ValueError(f"no room for adapter '{name}': this engine holds at most {self.capacity} adapters "
                             f"({', '.join(self.names)}); start the server with a larger model.max_adapters")
        self.index[name] = free[0]
        self.names.append(name)
        self._clear(free[0])

    @torch.no_grad()
    def remove(self, name: str) -> None:
        """Stop serving adapter ``name`` and free its slot (rows that still name it add nothing)."""
        i = self.index.pop(name)
        self.names.remove(name)
        self._clear(i)

    def _clear(self, i: int) -> None:
        for layer in self.layers.values():
            layer.a[i].zero_()
            layer.b[i].zero_()
            layer.scale[i] = 0.0

    @torch.no_grad()
    def load(self, name: str, lora: Sequence[tuple[str, Any, Any, float]]) -> None:
        """Serve ``lora`` — ``(module, A [r, in], B [out, r], scale)`` per adapted module — as adapter ``name``.

        Every adapted layer must be given (a layer left out would keep the adapter's old delta)."""
        i = self.index.get(name)
        if i is None:
            raise KeyError(f"unknown adapter '{name}'; this engine serves {self.names}")
        given = {_strip(m): (a, b, s) for m, a, b, s in lora}
        unknown = sorted(set(given) - set(self.layers))
        missing = sorted(set(self.layers) - set(given))
        if unknown or missing:
            raise ValueError(f"adapter '{name}': modules not served {unknown[:3]}, served but not given {missing[:3]}")
        for mod_name, (a, b, s) in given.items():
            self.layers[mod_name].set(i, torch.as_tensor(a), torch.as_tensor(b), float(s))


class _LayerLora:
    """One linear layer's stacked adapters; its ``forward`` is replaced by base + the row's delta."""

    def __init__(self, linear: nn.Linear, count: int, rank: int, rows: torch.Tensor):
        w = linear.weight
        out_f, in_f = w.shape
        self.a = torch.zeros(count, rank, in_f, dtype=w.dtype, device=w.device)
        self.b = torch.zeros(count, out_f, rank, dtype=w.dtype, device=w.device)
        self.scale = torch.zeros(count, dtype=w.dtype, device=w.device)
        self.rows = rows
        base = linear.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            return base(x) + row_lora_delta(x, self.a, self.b, self.scale, self.rows[: x.shape[0]])

        linear.forward = forward  # type: ignore[method-assign]

    def set(self, i: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        if tuple(a.shape) != tuple(self.a.shape[1:]) or tuple(b.shape) != tuple(self.b.shape[1:]):
            raise ValueError(f"LoRA shapes A {tuple(a.shape)} / B {tuple(b.shape)} != served "
                             f"{tuple(self.a.shape[1:])} / {tuple(self.b.shape[1:])} (model.lora_rank?)")
        self.a[i].copy_(a.to(self.a.dtype))
        self.b[i].copy_(b.to(self.b.dtype))
        self.scale[i] = scale


def row_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """``scale[i] · (x @ A[i].T) @ B[i].T`` per row, ``i = rows[row]``.

    x ``[R, T, in]``; a ``[N, r, in]``; b ``[N, out, r]``; scale ``[N]``; rows ``[R]`` → ``[R, T, out]``.
    """
    h = torch.bmm(x, a[rows].transpose(1, 2))  # [R, T, r]
    return torch.bmm(h, b[rows].transpose(1, 2)) * scale[rows][:, None, None]


_PEFT = re.compile(r"^(base_model\.model\.)")


def _strip(module: str) -> str:
    return _PEFT.sub("", module)
