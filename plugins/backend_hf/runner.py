"""The forward passes of the ``hf`` engine over the slot cache: prefill, and decode with CUDA graphs.

:class:`SlotRunner` owns the model's inputs for the slot cache. A decode step runs
rows ``0..B-1`` (slot = row; free slots in that range compute a throw-away row) over
the first ``L`` cached positions; ``B`` and ``L`` are rounded up to buckets, and on
CUDA each ``(B, L)`` is captured once as a CUDA graph (``torch.cuda.CUDAGraph``) and
replayed: one launch for the whole forward instead of hundreds. The graph reads its
inputs from two static device buffers (token ids and positions, filled with one copy
per step), builds the attention mask itself and writes the logits to a static output.
Weight swaps copy into the live parameters, so a captured graph stays valid; a cache
that is reshaped (new storage, :meth:`SlotRunner.reshape`: rare, in large steps, see
:mod:`.budget`) drops the graphs, which are captured again on demand.
A prefill runs eagerly (its shapes vary) and writes into the same slots.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from swarmkit_plugins.backend_hf.slots import SlotCache, additive_mask

log = logging.getLogger(__name__)

#: the smallest attended window of a decode step (positions)
MIN_WINDOW = 64


def bucket(n: int, limit: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)``, capped at ``limit`` (``n <= limit``)."""
    b = max(int(floor), 1)
    while b < n:
        b *= 2
    return min(b, int(limit))


class SlotRunner:
    """Prefill and decode forwards of ``model`` over ``cache`` (see the module docstring)."""

    def __init__(self, model: Any, cache: SlotCache, *, graphs: bool, logits_to_keep: bool):
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.dtype = cache.dtype
        self.use_graphs = bool(graphs) and self.device.type == "cuda"
        self.logits_to_keep = logits_to_keep
        cfg = model.config
        types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        self.window = int(getattr(cfg, "sliding_window", 0) or 0) if "sliding_attention" in types else 0
        rows = cache.slots
        #: the decode inputs: row 0 token ids, row 1 positions (one host-to-device copy per step)
        self.io = torch.zeros((2, rows), dtype=torch.long, device=self.device)
        self.rows = torch.arange(rows, device=self.device)
        self._arange = torch.arange(cache.capacity, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self.capture_s = 0.0
        #: storage changes since the start (each drops the captured graphs)
        self.reshapes = 0
        self.graph_failed: str | None = None

    # ------------------------------------------------------------------ storage
    def reshape(self, slots: int, capacity: int, moves: dict[int, int] | None = None, length: int = 0) -> None:
        """New cache storage (:meth:`SlotCache.reshape`): the captured graphs point at the old one and are
        dropped first (captured again on demand); the input buffers follow the new number of slots."""
        self._graphs.clear()
        self.cache.reshape(slots, capacity, moves, length)
        self.io = torch.zeros((2, slots), dtype=torch.long, device=self.device)
        self.rows = torch.arange(slots, device=self.device)
        self._arange = torch.arange(capacity, device=self.device)
        self.reshapes += 1

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------ forwards
    def _masks(self, allowed: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor) -> Any:
        """The additive mask ``[B, 1, T, L]`` from ``allowed [B, T, L]``: a 4D mask is used as given by every
        transformers model; one with sliding-window layers gets a mask per attention type (a dict, which
        such models take as prepared)."""
        full = additive_mask(allowed, self.dtype)[:, None]
        if not self.window:
            return full
        near = cols[None, None, :] > (pos[:, :, None] - self.window)
        return {"full_attention": full, "sliding_attention": additive_mask(allowed & near, self.dtype)[:, None]}

    def _logits(self, ids: torch.Tensor, pos: torch.Tensor, masks: Any) -> torch.Tensor:
        kwargs: dict[str, Any] = {"logits_to_keep": 1} if self.logits_to_keep else {}
        out = self.model(input_ids=ids, position_ids=pos, attention_mask=masks, past_key_values=self.cache,
                         use_cache=True, **kwargs)
        return out.logits[:, -1]

    def _decode_body(self, b: int, length: int) -> torch.Tensor:
        pos = self.io[1, :b]
        cols = self._arange[:length]
        allowed = (cols[None, :] <= pos[:, None])[:, None, :]  # [B, 1, L]
        self.cache.plan(self.rows[:b, None], pos[:, None], None, length)
        return self._logits(self.io[0, :b, None], pos[:, None], self._masks(allowed, pos[:, None], cols))

    def decode(self, ids: list[int], pos: list[int]) -> torch.Tensor:
        """Logits ``[B', V]`` of one decode step; ``ids[r]``/``pos[r]`` for row (slot) ``r``, ``B' = len(ids)``
        (free slots: any id, position 0). Rows past ``B'`` up to the bucket are computed and dropped."""
        n = len(ids)
        b = bucket(n, self.cache.slots)
        length = bucket(max(pos) + 1, self.cache.capacity, MIN_WINDOW)
        host = torch.zeros((2, b), dtype=torch.long)
        host[0, :n] = torch.tensor(ids, dtype=torch.long)
        host[1, :n] = torch.tensor(pos, dtype=torch.long)
        self.io[:, :b].copy_(host, non_blocking=True)
        if self.use_graphs and self.graph_failed is None:
            graph = self._graphs.get((b, length)) or self._capture(b, length)
            if graph is not None:
                graph[0].replay()
                return graph[1][:n]
        return self._decode_body(b, length)[:n]

    def _capture(self, b: int, length: int) -> tuple[Any, torch.Tensor] | None:
        t0 = time.perf_counter()
        try:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up (idempotent: the same rows write the same keys at the same places)
                    self._decode_body(b, length)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._decode_body(b, length)
            self._pool = graph.pool()
        except Exception as exc:  # noqa: BLE001 - eager decoding still works
            self.graph_failed = f"{type(exc).__name__}: {exc}"
            log.warning("hf backend: CUDA graph capture failed, decoding eagerly: %s", self.graph_failed)
            torch.cuda.synchronize(self.device)
            return None
        self._graphs[(b, length)] = (graph, out)
        self.capture_s += time.perf_counter() - t0
        log.debug("hf backend: captured decode graph B=%d L=%d in %.2fs", b, length, time.perf_counter() - t0)
        return self._graphs[(b, length)]

    def prefill(self, prompts: list[list[int]], slots: list[int], pad_id: int) -> torch.Tensor:
        """Run ``prompts`` (one per slot, left-padded together) into ``slots``; logits ``[N, V]`` of each
        prompt's last token."""
        n = len(prompts)
        width = max(len(p) for p in prompts)
        length = bucket(width, self.cache.capacity, MIN_WINDOW)
        ids = torch.full((n, width), pad_id, dtype=torch.long)
        pos = torch.full((n, width), -1, dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
            pos[r, width - len(p):] = torch.arange(len(p))
        ids, pos = ids.to(self.device), pos.to(self.device)
        valid = pos >= 0
        slot_t = torch.tensor(slots, dtype=torch.long, device=self.device)
        write_pos = torch.where(valid, pos, torch.full_like(pos, self.cache.capacity))  # padding: the trash column
        write_rows = slot_t[:, None].expand(n, width)
        cols = self._arange[:length]
        # a padding query attends to position 0 only (its output is thrown away; no all -inf row)
        allowed = torch.where(valid[:, :, None], cols[None, None, :] <= pos[:, :, None], cols[None, None, :] == 0)
        self.cache.plan(write_rows, write_pos, slot_t, length)
        rope_pos = pos.clamp(min=0)
        return self._logits(ids, rope_pos, self._masks(allowed, rope_pos, cols))
