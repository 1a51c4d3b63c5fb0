"""The logprob kernel: log-softmax of the trained tokens only, slice by slice of the vocabulary.

Logits are never materialised for the whole vocabulary and all tokens at once:
hidden states of the selected positions are multiplied with the output
embedding slice by slice inside :class:`SelectedLogprob`, whose backward
recomputes each slice (memory O(tokens · slice), not O(tokens · vocab)).
The same pass gives the policy's entropy at every selected position (the
metric ``entropy``, and the optional entropy bonus of the loss).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

#: logits elements computed at once by :class:`SelectedLogprob` (one vocabulary slice of all rows)
DEFAULT_LOGIT_CHUNK_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------- logprobs
def _chunk_stats(logits: torch.Tensor, acc: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Of one (M, Vc) logits slice, in ``acc``: the (M,) log-sum-exp and the (M,) entropy of the
    slice's own softmax. One exponential pass: with ``d = z − max``, ``e = exp(d)``, ``s = Σ e``:
    ``lse = max + log s`` and ``H = log s − Σ e·d / s`` (no difference of two large numbers)."""
    z = logits.to(acc)
    top = z.amax(dim=-1, keepdim=True)
    d = z - top
    e = torch.exp(d)
    total = e.sum(-1)
    log_total = torch.log(total)
    return top.squeeze(-1) + log_total, log_total - (e * d).sum(-1) / total


def _chunk_grad(logits: torch.Tensor, lse: torch.Tensor, go: torch.Tensor, local: torch.Tensor,
                hit: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """d(Σ go·logp)/d logits of one slice: ``go · (onehot(target) − softmax)``, in the logits dtype."""
    p = torch.exp(logits.to(acc) - lse[:, None]) * (-go[:, None])
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == local[:, None]
    p = p + (onehot & hit[:, None]).to(acc) * go[:, None]
    return p.to(logits.dtype)


def _chunk_grad_entropy(logits: torch.Tensor, lse: torch.Tensor, go: torch.Tensor, local: torch.Tensor,
                        hit: torch.Tensor, ge: torch.Tensor, ent: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """d(Σ go·logp + Σ ge·H)/d logits of one slice, in the logits dtype.

    With ``logq = z − lse`` and ``q = exp(logq)``: ``dH/dz = −q · (logq + H)``, so the slice's
    gradient is ``go · (onehot(target) − q) − ge · q · (logq + H)``.
    """
    logq = logits.to(acc) - lse[:, None]
    q = torch.exp(logq)
    g = -q * (go[:, None] + ge[:, None] * (logq + ent[:, None]))
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == local[:, None]
    g = g + (onehot & hit[:, None]).to(acc) * go[:, None]
    return g.to(logits.dtype)


#: the slice functions, eager; :func:`_kernels` compiles them on CUDA
_EAGER: dict[str, Callable[..., Any]] = {"stats": _chunk_stats, "grad": _chunk_grad,
                                         "grad_entropy": _chunk_grad_entropy}
_KERNELS: dict[str, Any] = {}


def _kernels(device: torch.device) -> dict[str, Callable[..., Any]]:
    """The slice functions by name: ``torch.compile``-d on CUDA (one fused pass over the bf16 slice,
    no fp32 copy), eager elsewhere or where compiling fails (``SWARMKIT_COMPILE_LOGPROB=0`` disables it)."""
    if device.type != "cuda" or os.environ.get("SWARMKIT_COMPILE_LOGPROB", "1") == "0":
        return _EAGER
    if not _KERNELS:
        try:
            _KERNELS.update({name: torch.compile(fn, dynamic=True) for name, fn in _EAGER.items()})
        except Exception:  # noqa: BLE001 - no compiler: eager
            _KERNELS.update(_EAGER)
    return _KERNELS


def _call(name: str, device: torch.device, *args: Any) -> Any:
    """Run kernel ``name`` (compiled when possible); a compile/runtime failure falls back to eager for good."""
    fn = _kernels(device)[name]
    eager = _EAGER[name]
    if fn is eager:
        return eager(*args)
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - inductor missing / failed: eager from now on
        import warnings

        warnings.warn(f"compiled logprob kernel failed ({type(exc).__name__}: {exc}); using eager", stacklevel=2)
        _KERNELS.update(_EAGER)
        return eager(*args)


class SelectedLogprob(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T)[i, targets[i]]`` and the entropy of row ``i``'s softmax,
    computed slice by slice of the vocabulary.

    Inputs: ``hidden`` (M, H), ``weight`` (V, H), ``targets`` (M,) int64.
    Outputs: logprobs (M,) and entropies (M,), float32 (float64 for float64 inputs). Matmuls run in
    ``compute_dtype`` (bf16 on GPU), log-sum-exp and softmax in float32. The vocabulary is cut into
    slices of ``chunk`` rows of ``weight``, so every matmul has all M rows (large K for the weight
    gradient, which is written once per slice instead of accumulated); per-slice log-sum-exps and
    entropies are combined at the end (with ``w_c = exp(lse_c − lse)`` the mass of slice ``c``:
    ``H = Σ_c w_c · (H_c − log w_c)``). Backward
    recomputes each slice's logits, so only ``hidden``, ``weight``, ``targets`` and the (M,)
    log-sum-exp and entropy are kept (memory O(M · chunk), not O(M · V)) — unless ``keep_logits``:
    then the slices computed in forward are kept (M · V in ``compute_dtype``) and reused, trading
    that memory for one of the head's four matmuls. An output the loss does not use costs nothing
    in backward (the entropy when there is no entropy bonus).
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int, compute_dtype: torch.dtype, keep_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        m, v = hidden.shape[0], weight.shape[0]
        dev = hidden.device
        acc = torch.promote_types(compute_dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        kept: list[torch.Tensor] = []
        with torch.autocast(dev.type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            picked = torch.zeros(m, dtype=acc, device=dev)
            lses, ents = [], []
            for s in range(0, v, chunk):
                e = min(v, s + chunk)
                logits = h @ w[s:e].T  # (M, Vc) in compute dtype
                lse_c, ent_c = _call("stats", dev, logits, acc)
                lses.append(lse_c)
                ents.append(ent_c)
                local = targets - s
                hit = (local >= 0) & (local < e - s)
                val = logits.gather(1, local.clamp(0, e - s - 1)[:, None]).squeeze(1).to(acc)
                picked = torch.where(hit, val, picked)
                if keep_logits:
                    kept.append(logits)
            if len(lses) == 1:
                lse, ent = lses[0], ents[0]
            else:  # slice c holds probability mass w_c = exp(lse_c - lse): H = Σ_c w_c (H_c − log w_c)
                stacked = torch.stack(lses, dim=1)  # (M, slices)
                lse = torch.logsumexp(stacked, dim=1)
                log_w = stacked - lse[:, None]
                ent = (torch.exp(log_w) * (torch.stack(ents, dim=1) - log_w)).sum(1)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.chunk = chunk
        ctx.compute_dtype = compute_dtype
        ctx.kept = kept  # the logits slices, when kept: backward skips their recompute
        return picked - lse, ent

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor | None,
                 grad_ent: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        cd = ctx.compute_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_out is None and grad_ent is None) or not (need_h or need_w):
            ctx.kept = []
            return None, None, None, None, None, None
        acc = lse.dtype
        dev = hidden.device
        v = weight.shape[0]
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=dev) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_w else None
        with torch.autocast(dev.type, enabled=False):
            h = hidden.to(cd)
            w = weight.to(cd)
            go = grad_out.to(acc) if grad_out is not None else torch.zeros_like(lse)
            ge = grad_ent.to(acc) if grad_ent is not None else None
            for s in range(0, v, ctx.chunk):
                e = min(v, s + ctx.chunk)
                wc = w[s:e]
                local = targets - s
                hit = (local >= 0) & (local < e - s)
                logits = ctx.kept[s // ctx.chunk] if ctx.kept else h @ wc.T
                if ctx.kept:
                    ctx.kept[s // ctx.chunk] = None  # free each kept slice once used
                if ge is None:
                    g = _call("grad", dev, logits, lse, go, local, hit, acc)  # (M, Vc) in cd
                else:
                    g = _call("grad_entropy", dev, logits, lse, go, local, hit, ge, ent, acc)
                del logits
                if grad_h is not None:
                    grad_h += g @ wc
                if grad_w is not None:
                    grad_w[s:e] = g.T @ h
        ctx.kept = []
        return (grad_h.to(hidden.dtype) if grad_h is not None else None), grad_w, None, None, None, None


def selected_logprobs_and_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    compute_dtype: torch.dtype | None = None, chunk_elements: int = DEFAULT_LOGIT_CHUNK_ELEMENTS,
    keep_logits_bytes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob (M,) of ``targets`` (M,) and entropy (M,) of the softmax of each row of the logits
    ``hidden (M, H) @ weight (V, H).T``; both differentiable in ``hidden`` and ``weight``.

    ``entropy[i] = −Σ_v p_iv log p_iv`` with ``p_i = softmax(logits_i)``, in nats: the policy's
    uncertainty at the position that predicts ``targets[i]`` (it does not depend on the target).
    Computed in the pass that gives the log-sum-exp, one vocabulary slice of about
    ``chunk_elements`` logits at a time, so memory stays O(M · slice): no (M, V) probability tensor
    is kept. When the (M, V) logits in ``compute_dtype`` fit in ``keep_logits_bytes`` and a
    gradient is needed, forward keeps them and backward skips recomputing them (one matmul of the
    head fewer).
    """
    cd = compute_dtype or hidden.dtype
    chunk = max(1, chunk_elements // max(1, hidden.shape[0]))  # vocabulary rows per slice
    if chunk >= 256:
        chunk = chunk // 128 * 128  # aligned slices for the matmuls
    chunk = min(chunk, weight.shape[0])
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    nbytes = hidden.shape[0] * weight.shape[0] * torch.empty((), dtype=cd).element_size()
    keep = bool(grad and keep_logits_bytes > 0 and nbytes <= keep_logits_bytes)
    lp, ent = SelectedLogprob.apply(hidden, weight, targets, chunk, cd, keep)  # type: ignore[no-untyped-call]
    return lp, ent


def selected_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
    compute_dtype: torch.dtype | None = None, chunk_elements: int = DEFAULT_LOGIT_CHUNK_ELEMENTS,
    keep_logits_bytes: int = 0,
) -> torch.Tensor:
    """Log-prob (M,) of ``targets`` (M,) under logits ``hidden (M,H) @ weight (V,H).T`` (the first
    output of :func:`selected_logprobs_and_entropy`)."""
    return selected_logprobs_and_entropy(hidden, weight, targets, compute_dtype, chunk_elements,
                                         keep_logits_bytes)[0]


def logits_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (...,) in nats of ``softmax(logits)`` over the last dimension, from full logits (...,
    V): the direct form, for heads the chunked kernel does not cover (an output bias)."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(torch.exp(logp) * logp).sum(-1)
