"""Engine-independent training core shared by the FSDP2 and DeepSpeed engines.

- :class:`PolicyModel` wraps a Hugging Face causal LM (plain or peft) and
  returns, for a *packed* row of samples, the log-probability of each trained
  token only. Logits are never materialised for the whole vocabulary and all
  tokens at once: hidden states of the selected positions are multiplied with
  the output embedding slice by slice of the vocabulary inside
  :class:`SelectedLogprob`, whose backward recomputes each slice (memory
  O(tokens · slice), not O(tokens · vocab)).
- :func:`plan_micro_batches` packs samples into micro-batches of at most
  ``token_budget`` tokens (first-fit decreasing) and spreads them over ranks.
- :func:`micro_batch_tensors` builds one micro-batch of packed rows (R, C):
  ``position_ids`` restart at 0 for every sample, and with
  ``attention_mask=None`` transformers turns those restarts into a
  block-diagonal causal mask (sdpa / eager, CPU or GPU) or varlen attention
  (flash-attention 2), so samples never attend to one another. C is the
  longest sample of the micro-batch, so attention costs R·C² rather than
  (Σ len)², and rows that hold a single sample need no mask at all.
- :func:`loss_weight` makes gradient accumulation over micro-batches (and
  ranks) equal to one big batch for each loss aggregation mode.
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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


def _kernels(device: torch.device):
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


def _call(name: str, device: torch.device, *args):
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
    def forward(ctx, hidden, weight, targets, chunk: int, compute_dtype: torch.dtype,  # type: ignore[override]
                keep_logits: bool = False):
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
    def backward(ctx, grad_out):  # type: ignore[override]
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
                if need_h:
                    grad_h += g @ wc
                if need_w:
                    grad_w[s:e] = g.T @ h
        ctx.kept = []
        return (grad_h.to(hidden.dtype) if need_h else None), grad_w, None, None, None, None


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
    return SelectedLogprob.apply(hidden, weight, targets, chunk, cd, keep)


def _causal_lm(lm: nn.Module) -> nn.Module:
    """The transformers ``*ForCausalLM`` inside a peft model (or the model itself)."""
    get_base = getattr(lm, "get_base_model", None)
    return get_base() if callable(get_base) else lm


class PolicyModel(nn.Module):
    """A causal LM that scores packed samples: ``forward`` returns trained-token logprobs.

    ``lm`` is a transformers causal LM or a peft model around one. With
    ``value_head`` a scalar head on the last hidden state gives PPO values.
    """

    def __init__(self, lm: nn.Module, compute_dtype: torch.dtype, value_head: bool = False,
                 chunk_elements: int = DEFAULT_LOGIT_CHUNK_ELEMENTS, keep_logits_bytes: int = 0):
        super().__init__()
        self.lm = lm
        self.compute_dtype = compute_dtype
        self.chunk_elements = chunk_elements
        self.keep_logits_bytes = keep_logits_bytes
        hidden = _causal_lm(lm).config.hidden_size
        self.value_head = nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def causal_lm(self) -> nn.Module:
        return _causal_lm(self.lm)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, select: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Score one packed row.

        :param input_ids: (R, C) packed token ids.
        :param position_ids: (R, C), restarting at 0 at each sample.
        :param select: (M,) flattened positions whose *next* token is trained.
        :param targets: (M,) the token at ``select + 1``.
        :returns: logprobs (M,) float32 and values (M,) float32 or None.
        """
        clm = self.causal_lm
        decoder = getattr(clm, clm.base_model_prefix)
        out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)
        last = out.last_hidden_state
        hidden = last.reshape(-1, last.shape[-1]).index_select(0, select)  # (M, H)
        head = clm.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            logits = head(hidden).float()
            lp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        else:
            lp = selected_logprobs(hidden, head.weight, targets, self.compute_dtype, self.chunk_elements,
                                   self.keep_logits_bytes)
        values = None
        if self.value_head is not None:
            values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return lp, values

    def decoder_layers(self) -> list[nn.Module]:
        clm = self.causal_lm
        return list(getattr(getattr(clm, clm.base_model_prefix), "layers", []))

    def compile_layers(self, backend: str = "inductor") -> int:
        """``torch.compile`` every decoder layer's ``forward`` in place; returns how many.

        The layers share one code object, so they share compiled graphs (one per input
        shape kind: static, then dynamic after the first new shape). Only ``forward`` is
        replaced: module hooks (FSDP2's unshard/reshard, gradient checkpointing) stay
        outside the compiled region and parameter names do not change. What it fuses is
        the memory-bound work between the matmuls: RMSNorm, rotary, SiLU gate, residuals.
        """
        layers = self.decoder_layers()
        failed: list[str] = []  # shared by this model's layers: one failure sends them all to eager
        for layer in layers:
            if "forward" not in layer.__dict__:
                layer.forward = _compiled_forward(layer.forward, torch.compile(layer.forward, backend=backend),
                                                  failed)
        self.compile_failed = failed
        return len(layers)


def _compiled_forward(eager, compiled, failed: list[str]):
    """A layer forward that runs ``compiled`` and, if compiling fails (no Triton, no C++ compiler, an
    unsupported op), warns once and runs ``eager`` for good; errors of the model itself still raise."""
    from torch._dynamo.exc import TorchDynamoException

    def forward(*args, **kwargs):
        if failed:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except TorchDynamoException as exc:
            import warnings

            failed.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            warnings.warn(f"torch.compile of the decoder layers failed ({failed[0]}); running eager. "
                          "Set optim.compile=false to skip compiling.", stacklevel=2)
            return eager(*args, **kwargs)

    forward.__wrapped__ = eager  # type: ignore[attr-defined]
    return forward


# --------------------------------------------------------------------------- packing
@dataclass
class MicroPlan:
    """Sample indices of each micro-batch, per rank; equal count on every rank."""

    per_rank: list[list[list[int]]]  # rank -> micro-batch -> sample indices

    @property
    def steps(self) -> int:
        return len(self.per_rank[0]) if self.per_rank else 0


def plan_micro_batches(lengths: Sequence[int], token_budget: int, world: int) -> MicroPlan:
    """Pack samples (by ``lengths``) into micro-batches of ≤ ``token_budget`` tokens.

    First-fit decreasing; a sample longer than the budget gets a bin of its
    own. Bins are dealt to ranks greedily by token load (largest first) so
    every rank runs the same number of micro-steps; a rank short of bins gets
    an empty bin (the engine runs it with weight 0 so collectives stay matched).
    Deterministic for given lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= token_budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    per_rank: list[list[list[int]]] = [[] for _ in range(world)]
    rank_load = [0] * world
    for b in sorted(range(len(bins)), key=lambda b: (-loads[b], b)):
        # fewest bins first, then least tokens, so bin counts differ by at most one
        r = min(range(world), key=lambda r: (len(per_rank[r]), rank_load[r], r))
        per_rank[r].append(sorted(bins[b]))
        rank_load[r] += loads[b]
    steps = max((len(p) for p in per_rank), default=0)
    for p in per_rank:
        while len(p) < steps:
            p.append([])
    return MicroPlan(per_rank)


@dataclass
class Prepared:
    """One sample reduced to what training needs; ``k`` = its trained tokens.

    ``select[j]`` is the position (within the sample) whose next token
    ``targets[j]`` is trained; per-token tensors are (k,).
    """

    input_ids: list[int]
    select: list[int]
    targets: list[int]
    old_logprobs: torch.Tensor  # (k,) NaN where the rollout did not record one
    advantages: torch.Tensor  # (k,)
    reward: float = 0.0
    ref_logprobs: torch.Tensor | None = None  # (k,)
    old_values: torch.Tensor | None = None  # (k,)
    returns: torch.Tensor | None = None  # (k,)

    @property
    def k(self) -> int:
        return len(self.select)


def prepare_sample(s: Any) -> Prepared:
    """Turn a TrainSample (token-aligned lists) into a :class:`Prepared`.

    Position p predicts token p+1, which is trained when ``loss_mask[p+1]``.
    """
    n = len(s.input_ids)
    sel = [p for p in range(n - 1) if s.loss_mask[p + 1]]
    old = [s.old_logprobs[p + 1] for p in sel]
    adv = [s.advantages[p + 1] for p in sel]
    return Prepared(
        input_ids=list(s.input_ids), select=sel, targets=[s.input_ids[p + 1] for p in sel],
        old_logprobs=torch.tensor([float("nan") if v is None else float(v) for v in old], dtype=torch.float32),
        advantages=torch.tensor(adv, dtype=torch.float32), reward=float(getattr(s, "reward", 0.0) or 0.0),
    )


@dataclass
class MicroBatch:
    """Packed rows of one micro-batch and the padded (B, T) per-token tensors its loss needs.

    B = samples in the row, T = most trained tokens of one sample. ``rows`` /
    ``cols`` place the (M,) selected-token outputs of the model into (B, T).
    ``tokens`` = 0 marks a dummy micro-batch (weight 0, keeps collectives matched).
    """

    input_ids: torch.Tensor  # (R, C) packed rows
    position_ids: torch.Tensor  # (R, C)
    select: torch.Tensor  # (M,) indices into the flattened R·C positions
    targets: torch.Tensor  # (M,)
    rows: torch.Tensor  # (M,)
    cols: torch.Tensor  # (M,)
    mask: torch.Tensor  # (B, T) float
    old_logprobs: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B, T)
    sample_index: list[int]
    tokens: int  # real (non-pad) tokens; 0 for a dummy
    ref_logprobs: torch.Tensor | None = None  # (B, T)
    old_values: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T)

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """Place (M,) values into a zero (B, T) tensor (differentiable)."""
        out = flat.new_zeros(self.mask.shape)
        return out.index_put((self.rows, self.cols), flat)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """(M,) values back to one (k,) tensor per sample of the row."""
        return [flat[self.rows == r] for r in range(self.mask.shape[0])]


def _pad(rows: list[torch.Tensor], t: int) -> torch.Tensor:
    out = torch.zeros(len(rows), t)
    for r, x in enumerate(rows):
        out[r, : x.numel()] = x
    return out


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit-decreasing of sample ``lengths`` into rows of ``capacity`` tokens (indices)."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                rows[r].append(i)
                loads[r] += lengths[i]
                break
        else:
            rows.append([i])
            loads.append(lengths[i])
    return rows


def micro_batch_tensors(prepared: Sequence[Prepared], index: Sequence[int], device: torch.device,
                        pad_id: int = 0) -> MicroBatch:
    """Pack ``prepared[i] for i in index`` into an (R, C) batch of packed rows.

    C is the longest sample; samples are packed first-fit into R rows of C
    tokens, position ids restart at 0 per sample, and a row's tail padding
    *continues* the positions of its last sample: causal attention keeps real
    tokens from seeing it, and a row holding one sample is not "packed", so
    when every row holds one sample transformers needs no mask at all (plain
    causal sdpa / flash). Attention costs R·C², never (Σ len)².
    An empty ``index`` gives a 2-token dummy row (one selected token, all-zero mask).
    """
    items = [prepared[i] for i in index]
    ids: list[int] = []
    pos: list[int] = []
    select: list[int] = []
    targets: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    if items:
        cap = max(len(p.input_ids) for p in items)
        for row in pack_rows([len(p.input_ids) for p in items], cap):
            start = len(ids)
            for r in row:
                p = items[r]
                off = len(ids)
                ids.extend(p.input_ids)
                pos.extend(range(len(p.input_ids)))
                select.extend(off + q for q in p.select)
                targets.extend(p.targets)
                rows.extend([r] * p.k)
                cols.extend(range(p.k))
            pad = cap - (len(ids) - start)
            ids.extend([pad_id] * pad)
            pos.extend(range(pos[-1] + 1, pos[-1] + 1 + pad))
        n_rows = len(ids) // cap
    real = sum(len(p.input_ids) for p in items)
    lt = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    if not items:
        z = torch.zeros(1, 1, device=device)
        return MicroBatch(lt([pad_id, pad_id])[None], lt([0, 1])[None], lt([0]), lt([pad_id]), lt([0]),
                          lt([0]), z, z.clone(), z.clone(), [], 0)
    t = max(p.k for p in items)
    mask = _pad([torch.ones(p.k) for p in items], t)

    def opt(name: str) -> torch.Tensor | None:
        vals = [getattr(p, name) for p in items]
        return None if any(v is None for v in vals) else _pad(vals, t).to(device)

    return MicroBatch(
        input_ids=lt(ids).view(n_rows, cap), position_ids=lt(pos).view(n_rows, cap), select=lt(select),
        targets=lt(targets),
        rows=lt(rows), cols=lt(cols), mask=mask.to(device),
        old_logprobs=_pad([p.old_logprobs for p in items], t).to(device),
        advantages=_pad([p.advantages for p in items], t).to(device), sample_index=list(index),
        tokens=real, ref_logprobs=opt("ref_logprobs"), old_values=opt("old_values"),
        returns=opt("returns"),
    )


# --------------------------------------------------------------------------- loss weights
def loss_agg_mode(algo: Any) -> str:
    return str(getattr(algo, "loss_agg", None) or "token-mean")


def loss_units(prepared: Sequence[Prepared], mode: str) -> float:
    """What the algorithm's loss averages over: trained tokens (token-mean) or sequences."""
    if mode == "token-mean":
        return float(sum(p.k for p in prepared))
    return float(sum(1 for p in prepared if p.k > 0))


def loss_weight(units: float, total_units: float, world: int) -> float:
    """Weight of one micro-batch loss so the accumulated gradient equals the full batch's.

    The algorithm's loss of a micro-batch is a mean over its own units; the
    full mini-batch loss is ``Σ units_i/total · loss_i``. Data-parallel
    reduction *averages* gradients over ``world`` ranks, hence the ``world``
    factor.
    """
    if total_units <= 0:
        return 0.0
    return units / total_units * world


def split_mini_batches(n: int, mini_batches: int, seed: int) -> list[list[int]]:
    """Shuffle ``range(n)`` with ``seed`` and cut it into ``mini_batches`` near-equal parts."""
    idx = list(range(n))
    if mini_batches > 1:
        random.Random(seed).shuffle(idx)
    k = max(1, min(mini_batches, n))
    size = math.ceil(n / k) if n else 0
    return [idx[i:i + size] for i in range(0, n, size)] if n else []


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` = bfloat16 on CUDA, float32 elsewhere."""
    if name in ("auto", None, ""):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
            "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}[name]
