"""The logprob kernel: log-softmax of the trained tokens only, slice by slice of the vocabulary.

Logits are never materialised for the whole vocabulary and all tokens at once:
hidden states of the selected positions are multiplied with the output
embedding slice by slice inside :class:`SelectedLogprob`, whose backward
recomputes each slice (memory O(tokens · slice), not O(tokens · vocab)).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

#: logits elements computed at once by :class:`SelectedLogprob` (one vocabulary slice of all rows)
DEFAULT_LOGIT_CHUNK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------- logprobs
def _chunk_lse(logits: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """(M,) log-sum-exp in ``acc`` of one (M, Vc) logits slice."""
    return torch.logsumexp(logits.to(acc), dim=-1)


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, go: torch.Tensor, local: torch.Tensor,
                hit: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """d(Σ go·logp)/d logits of one slice: ``go · (onehot(target) − softmax)``, in the logits dtype."""
    p = torch.exp(logits.to(acc) - lse[:, None]) * (-go[:, None])
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == local[:, None]
    p = p + (onehot & hit[:, None]).to(acc) * go[:, None]
    return p.to(logits.dtype)


_KERNELS: dict[str, Any] = {}


def _kernels(device: torch.device) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """(lse, grad) slice functions: ``torch.compile``-d on CUDA (one fused pass over the bf16 slice,
    no fp32 copy), eager elsewhere or where compiling fails (``SWARMKIT_COMPILE_LOGPROB=0`` disables it)."""
    if device.type != "cuda" or os.environ.get("SWARMKIT_COMPILE_LOGPROB", "1") == "0":
        return _chunk_lse, _chunk_grad
    if "lse" not in _KERNELS:
        try:
            _KERNELS["lse"] = torch.compile(_chunk_lse, dynamic=True)
            _KERNELS["grad"] = torch.compile(_chunk_grad, dynamic=True)
        except Exception:  # noqa: BLE001 - no compiler: eager
            _KERNELS["lse"], _KERNELS["grad"] = _chunk_lse, _chunk_grad
    return _KERNELS["lse"], _KERNELS["grad"]


def _call(name: str, device: torch.device, *args: Any) -> torch.Tensor:
    """Run kernel ``name`` (compiled when possible); a compile/runtime failure falls back to eager for good."""
    lse_fn, grad_fn = _kernels(device)
    fn = lse_fn if name == "lse" else grad_fn
    eager = _chunk_lse if name == "lse" else _chunk_grad
    if fn is eager:
        return eager(*args)
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - inductor missing / failed: eager from now on
        import warnings

        warnings.warn(f"compiled logprob kernel failed ({type(exc).__name__}: {exc}); using eager", stacklevel=2)
        _KERNELS["lse"], _KERNELS["grad"] = _chunk_lse, _chunk_grad
        return eager(*args)


class SelectedLogprob(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[i, targets[i]]`` computed slice by slice of the vocabulary.

    Inputs: ``hidden`` (M, H), ``weight`` (V, H), ``targets`` (M,) int64.
    Output: (M,) float32 (float64 for float64 inputs). Matmuls run in ``compute_dtype`` (bf16 on GPU),
    log-sum-exp and softmax in float32. The vocabulary is cut into slices of ``chunk`` rows of
    ``weight``, so every matmul has all M rows (large K for the weight gradient, which is written
    once per slice instead of accumulated); per-slice log-sum-exps are combined at the end. Backward
    recomputes each slice's logits, so only ``hidden``, ``weight``, ``targets`` and the (M,)
    log-sum-exp are kept (memory O(M · chunk), not O(M · V)) — unless ``keep_logits``: then the
    slices computed in forward are kept (M · V in ``compute_dtype``) and reused, trading that
    memory for one of the head's four matmuls.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, compute_dtype: torch.dtype, keep_logits: bool = False) -> torch.Tensor:
        m, v = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        acc = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        kept: list[torch.Tensor] = []
        with torch.autocast(dev.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            picked = torch.zeros(m, dtype=acc, device=dev)
            lses = []
            for s in range(0, v, chunk):
                e = min(v, s + chunk)
                logits = h @ w[s:e].T  # (M, Vc) in compute dtype
                lses.append(_call("lse", dev, logits, acc))
                local = targets - s
                hit = (local >= 0) & (local < e - s)
                val = logits.gather(1, local.clamp(0, e - s - 1)[:, None]).squeeze(1).to(acc)
                picked = torch.where(hit, val, picked)
                if keep_logits:
                    kept.append(logits)
            lse = lses[0] if len(lses) == 1 else torch.logsumexp(torch.stack(lses, dim=1), dim=1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        ctx.compute_dtype = compute_dtype
        ctx.kept = kept  # the logits slices, when kept: backward skips their recompute
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        cd = ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        acc = lse.dtype
        dev = hidden.device
        v = weight.shape[0]
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=dev) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_w else None
        with torch.autocast(dev.type, enabled=False):
            h = hidden.to(cd)
            w = weight.to(cd)
            go = grad_out.to(acc)
            for s in range(0, v, ctx.chunk):
                e = min(v, s + ctx.chunk)
                wc = w[s:e]
                local = targets - s
                hit = (local >= 0) & (local < e - s)
                logits = ctx.kept[s // ctx.chunk] if ctx.kept else h @ wc.T
                if ctx.kept:
                    ctx.kept[s // ctx.chunk] = None  # free each kept slice once used
                g = _call("grad", dev, logits, lse, go, local, hit, acc)  # (M, Vc) in cd
                del logits
                if grad_h is not None:
                    grad_h += g @ wc
                if grad_w is not None:
                    grad_w[s:e] = g.T @ h
        ctx.kept = []
        return (grad_h.to(hidden.dtype) if grad_h is not None else None), grad_w, None, None, None, None


def selected_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    compute_dtype: torch.dtype | None = None, chunk_elements: int = DEFAULT_LOGIT_CHUNK_ELEMENTS,
    keep_logits_bytes: int = 0,
) -> torch.Tensor:
    """Log-prob (M,) of ``targets`` (M,) under logits ``hidden (M,H) @ weight (V,H).T``.

    When the (M, V) logits in ``compute_dtype`` fit in ``keep_logits_bytes`` and a gradient is
    needed, forward keeps them and backward skips recomputing them (one matmul of the head fewer).
    """
    cd = compute_dtype or hidden.dtype
    chunk = max(1, chunk_elements // max(1, hidden.shape[0]))  # vocabulary rows per slice
    if chunk >= 256:
        chunk = chunk // 128 * 128  # aligned slices for the matmuls
    chunk = min(chunk, weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    nbytes = hidden.shape[0] * weight.shape[0] * torch.empty((), dtype=cd).element_size()
    keep = bool(grad and keep_logits_bytes > 0 and nbytes <= keep_logits_bytes)
    out: torch.Tensor = SelectedLogprob.apply(hidden, weight, targets, chunk, cd, keep)  # type: ignore[no-untyped-call]
    return out
