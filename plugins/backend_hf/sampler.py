"""Batched token sampling on the device: one pass for every row of a decode step.

:func:`sample` takes the raw logits of ``B`` rows and each row's sampling fields and
returns the chosen tokens, their raw logprobs and whether the row's logits were
unusable, as device tensors; :func:`to_host` brings them over in one copy.

Semantics (as the engine documents them): logprobs are the log-softmax of the raw
logits; a temperature below :data:`~swarmkit.contract.backend.GREEDY_TEMPERATURE` is
greedy (argmax of the shaped logits); otherwise ``top_k`` (ties kept), ``min_p`` and
``top_p`` (the smallest prefix of the sorted, already filtered probabilities reaching
``top_p``) filter ``softmax(shaped / temperature)``, and a token is drawn by
inverting the cumulative distribution at one uniform number per row (the first
token whose float64 running sum reaches ``u · sum``), which draws from ``p``
exactly. The uniforms come from the host (each row's ``draw``: a seeded
sequence's own ``random.Random``, else the engine's), so a seeded row's tokens
do not depend on what else is in the batch, and a decode step launches the same
few kernels whatever the number of seeded rows (a generator per row cost one
launch per row and step: on a GPU where launches are dear, most of a step at
128 rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmkit.contract.backend import GREEDY_TEMPERATURE


@dataclass
class RowSampling:
    """The sampling fields of one row (one sequence at one step)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    draw: float = 0.5  # this row's uniform number in (0, 1) for this step (unused when greedy)


@dataclass
class Sampled:
    """``tokens [B]`` (long), ``logprobs [B]`` (float32, raw), ``bad [B]`` (bool: non-finite logits),
    ``top`` (values ``[B, k]``, ids ``[B, k]``) or None."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    bad: torch.Tensor
    top: tuple[torch.Tensor, torch.Tensor] | None


def sample(raw: torch.Tensor, shaped: torch.Tensor, rows: list[RowSampling], top_logprobs: int = 0) -> Sampled:
    """Sample one token per row. ``raw``/``shaped``: ``[B, V]`` logits before/after bias and penalties."""
    raw = raw.float()
    shaped = shaped.float()
    b, v = raw.shape
    dev = raw.device
    logprobs = torch.log_softmax(raw, dim=-1)
    bad = ~torch.isfinite(raw).all(dim=-1)
    tokens = torch.argmax(shaped, dim=-1)
    hot = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_TEMPERATURE]
    if hot:
        # one host-to-device copy per step: each hot row's temperature, uniform and row index
        host = torch.tensor([[rows[i].temperature for i in hot], [rows[i].draw for i in hot], hot],
                            dtype=torch.float64, pin_memory=dev.type == "cuda")
        per_row = host.to(dev, non_blocking=True)
        idx = per_row[2].long() if len(hot) < b else None
        x = shaped if idx is None else shaped.index_select(0, idx)
        probs = torch.softmax(x / per_row[0, :, None].float(), dim=-1)
        probs = _filter(probs, [rows[i] for i in hot])
        drawn = inverse_cdf(probs, per_row[1])
        if idx is None:
            tokens = drawn
        else:
            tokens = tokens.index_copy(0, idx, drawn)
    lps = logprobs.gather(1, tokens[:, None])[:, 0]
    top = None
    if top_logprobs > 0:
        vals, ids = torch.topk(logprobs, min(top_logprobs, v), dim=-1)
        top = (vals, ids)
    return Sampled(tokens=tokens, logprobs=lps, bad=bad, top=top)


def sample_plain(raw: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample` for rows with no filter, no shaping and no top logprobs, as fixed-shape tensor maths
    (no host copy, no branch on the data), so a CUDA graph can capture it with the forward.

    ``raw [B, V]`` logits; ``temperature [B]`` (float64; greedy below ``GREEDY_TEMPERATURE``); ``u [B]``
    (float64) each row's uniform. Returns ``[B, 3]`` float64: token, its raw logprob, 1.0 where the row's
    logits are not finite. Every row goes through the same operations as a hot row of :func:`sample`, so
    the tokens are the same for the same draws (a greedy row's draw is computed and not used)."""
    raw = raw.float()
    logprobs = torch.log_softmax(raw, dim=-1)
    bad = ~torch.isfinite(raw).all(dim=-1)
    hot = temperature >= GREEDY_TEMPERATURE
    temp = torch.where(hot, temperature, torch.ones_like(temperature))  # no division by ~0 in greedy rows
    drawn = inverse_cdf(torch.softmax(raw / temp[:, None].float(), dim=-1), u)
    tokens = torch.where(hot, drawn, torch.argmax(raw, dim=-1))
    lps = logprobs.gather(1, tokens[:, None])[:, 0]
    return torch.stack([tokens.double(), lps.double(), bad.double()], dim=1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``probs [R, V]`` (non-negative, not necessarily normalised), ``u [R]`` in (0, 1): per row the first
    token whose running sum (float64) reaches ``u · sum``, i.e. a draw from ``probs / sum``; a token of
    probability zero is never drawn (its running sum equals its predecessor's)."""
    cum = probs.double().cumsum(dim=-1)
    target = (u.double() * cum[:, -1])[:, None]
    return torch.searchsorted(cum, target)[:, 0].clamp_max(probs.shape[-1] - 1)


def _filter(probs: torch.Tensor, rows: list[RowSampling]) -> torch.Tensor:
    """``probs [R, V]`` with each row's ``top_k``, ``min_p`` and ``top_p`` applied (not renormalised)."""
    if all(r.top_k <= 0 and r.min_p <= 0 and r.top_p >= 1.0 for r in rows):
        return probs
    dev = probs.device
    v = probs.shape[-1]
    sp, si = torch.sort(probs, dim=-1, descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    ks = [r.top_k if 0 < r.top_k < v else 0 for r in rows]
    if any(ks):
        k = torch.tensor([kk if kk else v for kk in ks], device=dev)
        kth = sp.gather(1, (k - 1)[:, None])
        keep &= sp >= kth
    if any(r.min_p > 0 for r in rows):
        mp = torch.tensor([r.min_p for r in rows], device=dev, dtype=sp.dtype)
        keep &= sp >= mp[:, None] * sp[:, :1]
    sp = sp * keep
    if any(r.top_p < 1.0 for r in rows):
        tp = torch.tensor([r.top_p for r in rows], device=dev, dtype=sp.dtype)
        cum = torch.cumsum(sp, dim=-1)
        sp = sp.masked_fill((cum - sp) >= tp[:, None], 0.0)  # keep the smallest prefix reaching top_p
    return torch.zeros_like(probs).scatter_(1, si, sp)


def to_host(s: Sampled) -> tuple[list[int], list[float], list[bool], list[list[tuple[int, float]]] | None]:
    """The sampled values as Python lists, in one device-to-host copy."""
    parts = [s.tokens.to(torch.float64)[:, None], s.logprobs.to(torch.float64)[:, None],
             s.bad.to(torch.float64)[:, None]]
    k = 0
    if s.top is not None:
        k = s.top[0].shape[1]
        parts += [s.top[0].to(torch.float64), s.top[1].to(torch.float64)]
    host = torch.cat(parts, dim=1).cpu().tolist()
    toks = [int(r[0]) for r in host]
    lps = [float(r[1]) for r in host]
    bad = [bool(r[2]) for r in host]
    tops = None
    if k:
        tops = [[(int(r[3 + k + j]), float(r[3 + j])) for j in range(k)] for r in host]
    return toks, lps, bad, tops
