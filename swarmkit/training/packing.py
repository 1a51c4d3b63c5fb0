"""Packing samples into micro-batches, and the weights that make accumulation exact.

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
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarmkit.contract.samples import TrainSample


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
    prox_logprobs: torch.Tensor | None = None  # (k,) the weights before the step (decoupled loss)
    old_values: torch.Tensor | None = None  # (k,)
    returns: torch.Tensor | None = None  # (k,)
    #: (k,) 1.0 where the rollout recorded a logprob (and, see mark_current_tokens, the current weights sampled it)
    recorded: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return len(self.select)


def prepare_sample(s: TrainSample) -> Prepared:
    """Turn a TrainSample (token-aligned lists) into a :class:`Prepared`.

    Position p predicts token p+1, which is trained when ``loss_mask[p+1]``.
    """
    n = len(s.input_ids)
    sel = [p for p in range(n - 1) if s.loss_mask[p + 1]]
    old = torch.tensor([float("nan") if s.old_logprobs[p + 1] is None else float(s.old_logprobs[p + 1])
                        for p in sel], dtype=torch.float32)
    adv = [s.advantages[p + 1] for p in sel]
    return Prepared(
        input_ids=list(s.input_ids), select=sel, targets=[s.input_ids[p + 1] for p in sel], old_logprobs=old,
        advantages=torch.tensor(adv, dtype=torch.float32), reward=float(s.reward),
        recorded=(~torch.isnan(old)).float(),
    )


def mark_current_tokens(sample: TrainSample, prepared: Prepared, version: int) -> None:
    """Narrow ``prepared.recorded`` to the trained tokens the weights of ``version`` sampled: the
    tokens whose engine logprobs measure the train/inference mismatch alone, not the policy lag."""
    versions = sample.token_versions()
    current = torch.tensor([float(versions[q + 1] == version) for q in prepared.select])
    base = prepared.recorded if prepared.recorded is not None else torch.ones(prepared.k)
    prepared.recorded = base * current


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
    prox_logprobs: torch.Tensor | None = None  # (B, T)
    old_values: torch.Tensor | None = None  # (B, T)
    returns: torch.Tensor | None = None  # (B, T)
    recorded: torch.Tensor | None = None  # (B, T) the tokens mismatch_kl counts (Prepared.recorded)

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

    def lt(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

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
        tokens=real, ref_logprobs=opt("ref_logprobs"), prox_logprobs=opt("prox_logprobs"), old_values=opt("old_values"),
        returns=opt("returns"), recorded=opt("recorded"),
    )


# --------------------------------------------------------------------------- loss weights
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
