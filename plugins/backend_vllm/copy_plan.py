"""In-place weight sync at the cost of a device copy: a copy plan recorded from the model's own ``load_weights``.

vLLM's ``load_weights`` walks every pushed tensor through Python weight loaders (q/k/v stacked into
``qkv_proj``, gate/up into ``gate_up_proj``, the vocabulary padded). On an H100 that took 10× a device copy
of the same tensors (0.028 s against 0.0028 s at 0.5B, 290 tensors): the time is the loaders', not the
copies'. What the loaders do to the parameters is always the same set of copies, from (views of) the pushed
tensors into (views of) the parameters. So the first push runs ``load_weights`` under a recorder that notes
each copy; a later push of tensors with the same names, shapes and layouts replays those copies with one
``torch._foreach_copy_`` (which casts to the parameter's dtype as ``copy_`` does).

A loader that does anything a replay would not reproduce leaves no plan, and every push then goes through
``load_weights`` as before: a copy from a tensor that is not a view of a pushed one (a converted copy), a copy
into something that is not a parameter or buffer of the model, an indexed assignment, or an in-place op
other than a copy or a fill with a constant. A plan also dies when the parameters are re-allocated (vLLM's
``reload_weights``): it checks the parameters' storages before every replay.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

#: in-place methods a weight loader may call that a replay need not repeat (a constant fill is done already)
_CONSTANT_FILLS = frozenset({"fill_", "zero_"})
#: in-place methods that change no values
_HARMLESS = frozenset({"requires_grad_", "share_memory_", "retain_grad"})


@dataclass(frozen=True)
class _Source:
    """Where a recorded copy read from: a view of pushed tensor ``name`` (``whole``: the tensor itself)."""

    name: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # relative to the pushed tensor's own storage offset
    whole: bool


@dataclass
class CopyPlan:
    """The copies ``load_weights`` made for pushed tensors of one :func:`signature`, to replay for the next ones."""

    signature: tuple[Any, ...]
    dsts: list[Any]  # views of the model's parameters, in the order load_weights wrote them
    sources: list[_Source]
    missing: list[str]  # the parameters no pushed tensor reached (load_weights said so when recorded)
    storages: tuple[int, ...]  # the parameters' storage addresses when recorded

    def replay(self, named: dict[str, Any]) -> None:
        srcs = [named[s.name] if s.whole else
                named[s.name].as_strided(s.size, s.stride, named[s.name].storage_offset() + s.offset)
                for s in self.sources]
        with torch.no_grad():
            torch._foreach_copy_(self.dsts, srcs)


def signature(named: Sequence[tuple[str, Any]]) -> tuple[Any, ...]:
    """What a plan depends on: each pushed tensor's name, shape, layout, dtype and device, and which of them
    share a storage (tied weights)."""
    groups: dict[int, int] = {}
    out = []
    for name, t in named:
        group = groups.setdefault(t.untyped_storage().data_ptr(), len(groups))
        out.append((name, tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype), str(t.device), group))
    return tuple(out)


def parameter_storages(model: Any) -> tuple[int, ...]:
    """The storage address of every parameter and buffer of ``model`` (a re-allocation changes them)."""
    return tuple(t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers()))


def load_in_place(model: Any, named: list[tuple[str, Any]], plan: CopyPlan | None) -> tuple[list[str], CopyPlan | None]:
    """Copy the HF-named ``named`` into ``model``'s parameters: by replaying ``plan`` when it fits them, else with
    the model's ``load_weights`` (recording a plan for the next push). Returns the parameters no tensor reached
    and the plan to keep (None: this model's loaders cannot be replayed)."""
    sig, storages = signature(named), parameter_storages(model)
    if plan is not None and plan.signature == sig and plan.storages == storages:
        plan.replay(dict(named))
        return plan.missing, plan
    recorder = _Recorder(named, frozenset(storages))
    with torch.no_grad(), recorder:
        loaded = model.load_weights(iter(named))
    missing = [] if loaded is None else sorted({n for n, _ in model.named_parameters()} - set(loaded))
    if recorder.refused is not None:
        log.info("vllm backend: weight pushes go through load_weights (its loaders do %s, which a copy plan "
                 "cannot replay)", recorder.refused)
        return missing, None
    return missing, CopyPlan(sig, recorder.dsts, recorder.sources, missing, storages)


class _Recorder(TorchFunctionMode):
    """Notes every ``copy_`` while ``load_weights`` runs, and whatever a replay could not repeat."""

    def __init__(self, named: list[tuple[str, Any]], targets: frozenset[int]) -> None:
        super().__init__()
        self.pushed = {t.untyped_storage().data_ptr(): (name, t) for name, t in reversed(named)}
        self.targets = targets
        self.dsts: list[Any] = []
        self.sources: list[_Source] = []
        self.refused: str | None = None

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if self.refused is None:
            if func is torch.Tensor.copy_:
                self._note_copy(args[0], args[1])
            elif name == "__setitem__":
                self.refused = "an indexed assignment"
            elif name.endswith("_") and not name.startswith("__") and name not in _HARMLESS:
                if name not in _CONSTANT_FILLS or any(isinstance(a, torch.Tensor) for a in args[1:]):
                    self.refused = f"an in-place {name}"
        return func(*args, **(kwargs or {}))

    def _note_copy(self, dst: Any, src: Any) -> None:
        if not isinstance(src, torch.Tensor):
            self.refused = "a copy from a Python value"
            return
        if dst.untyped_storage().data_ptr() not in self.targets:
            self.refused = "a copy into a tensor that is not the model's"
            return
        origin = self.pushed.get(src.untyped_storage().data_ptr())
        if origin is None:
            self.refused = "a copy from a tensor that is not a view of a pushed one"
            return
        name, pushed = origin
        whole = (src.shape == pushed.shape and src.stride() == pushed.stride()
                 and src.storage_offset() == pushed.storage_offset())
        self.dsts.append(dst)
        self.sources.append(_Source(name, tuple(src.shape), tuple(src.stride()),
                                    src.storage_offset() - pushed.storage_offset(), whole))
