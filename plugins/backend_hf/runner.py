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

The *fused step* (:meth:`SlotRunner.step`) is a decode step with the sampling of the plain case
(temperature or greedy only, :func:`~.sampler.sample_plain`) inside the same graph, and its own
inputs on the device: one packed host-to-device copy per step (``step_in``, float64 ``[5, B]``:
token id, position, temperature, uniform draw and ``use_host`` per row) and a feedback buffer
(``fed``: each row's last sampled token and next position, written by the step itself). A row with
``use_host = 0`` continues from ``fed``, so the engine can launch step ``t + 1`` before it has read
step ``t``'s tokens; the step's ``[rows, 3]`` output (token, logprob, bad) goes to a pinned host
tensor with one copy, and a CUDA event says when it has landed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from swarmkit_plugins.backend_hf.sampler import sample_plain
from swarmkit_plugins.backend_hf.slots import SlotCache, additive_mask

log = logging.getLogger(__name__)

#: the smallest attended window of a decode step (positions)
MIN_WINDOW = 64

#: the rows of a fused step's packed input (``SlotRunner.step_in``), and a padding row's values
IN_IDS, IN_POS, IN_TEMP, IN_DRAW, IN_HOST = range(5)
IN_PAD = (0.0, 0.0, 0.0, 0.5, 1.0)


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
        #: the fused step's inputs: the packed host rows (IN_*; a step of B rows reads the first 5·B values as
        #: [5, B], so its input is one contiguous copy), and the device feedback (row 0 the last sampled
        #: token ids, row 1 the next positions), written by each fused step for the next one
        self.step_in = torch.zeros(5 * rows, dtype=torch.float64, device=self.device)
        self.fed = torch.zeros((2, rows), dtype=torch.long, device=self.device)
        self._arange = torch.arange(cache.capacity, device=self.device)
        self._graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._fused: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self._pool: Any = None
        self.capture_s = 0.0
        #: storage changes since the start (each drops the captured graphs)
        self.reshapes = 0
        self.graph_failed: str | None = None
        #: why the fused step could not be captured (the engine then decodes the serial way, with graphs)
        self.fused_failed: str | None = None

    # ------------------------------------------------------------------ storage
    def reshape(self, slots: int, capacity: int, moves: dict[int, int] | None = None, length: int = 0) -> None:
        """New cache storage (:meth:`SlotCache.reshape`): the captured graphs point at the old one and are
        dropped first (captured again on demand); the input buffers follow the new number of slots."""
        self._graphs.clear()
        self._fused.clear()
        self.cache.reshape(slots, capacity, moves, length)
        self.io = torch.zeros((2, slots), dtype=torch.long, device=self.device)
        self.rows = torch.arange(slots, device=self.device)
        self.step_in = torch.zeros(5 * slots, dtype=torch.float64, device=self.device)
        self.fed = torch.zeros((2, slots), dtype=torch.long, device=self.device)
        self._arange = torch.arange(capacity, device=self.device)
        self.reshapes += 1

    @property
    def graphs(self) -> int:
        return len(self._graphs) + len(self._fused)

    @property
    def _replaying(self) -> bool:
        return self.use_graphs and self.graph_failed is None

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

    def _forward_rows(self, ids: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """Logits ``[B, V]`` of one decode step of rows (slots) ``0..B-1``: ``ids``/``pos`` ``[B]`` (long)."""
        b = ids.shape[0]
        cols = self._arange[:length]
        allowed = (cols[None, :] <= pos[:, None])[:, None, :]  # [B, 1, L]
        self.cache.plan(self.rows[:b, None], pos[:, None], None, length)
        return self._logits(ids[:, None], pos[:, None], self._masks(allowed, pos[:, None], cols))

    def _decode_body(self, b: int, length: int) -> torch.Tensor:
        return self._forward_rows(self.io[0, :b], self.io[1, :b], length)

    def _step_body(self, b: int, length: int) -> torch.Tensor:
        """The fused step over rows ``0..B-1``: inputs from ``step_in`` (or ``fed`` where ``use_host`` is 0),
        forward, plain sampling, feedback; returns ``[B, 3]`` float64 (token, logprob, bad)."""
        inp = self.step_in[: 5 * b].view(5, b)
        use_host = inp[IN_HOST] > 0.5
        ids = torch.where(use_host, inp[IN_IDS].long(), self.fed[0, :b])
        pos = torch.where(use_host, inp[IN_POS].long(), self.fed[1, :b])
        out = sample_plain(self._forward_rows(ids, pos, length), inp[IN_TEMP], inp[IN_DRAW])
        self.fed[0, :b].copy_(out[:, 0].long())
        # a finished sequence's wasted next row stays within its cache room; at worst it writes the trash column
        self.fed[1, :b].copy_((pos + 1).clamp_max(self.cache.capacity))
        return out

    def step_shape(self, rows: int, max_pos: int) -> tuple[int, int]:
        """``(B, L)`` of a decode step (serial or fused) of ``rows`` rows whose largest position is ``max_pos``."""
        return bucket(rows, self.cache.slots), bucket(max_pos + 1, self.cache.capacity, MIN_WINDOW)

    @property
    def fused_ok(self) -> bool:
        """Whether fused steps run as graphs where graphs run (False after a failed capture of one)."""
        return self.fused_failed is None

    def step_ready(self, rows: int, max_pos: int) -> bool:
        """Whether a fused step of this shape runs without a capture (a capture needs ``use_host = 1`` on
        every row: its warm-up runs consume the feedback)."""
        return not (self._replaying and self.fused_ok) or self.step_shape(rows, max_pos) in self._fused

    def step(self, inputs: list[list[float]], max_pos: int) -> tuple[torch.Tensor, Any]:
        """Launch one fused step: ``inputs`` the five IN_* rows, one value per row (slot) ``0..R-1``;
        ``max_pos`` the largest position any row reads (host-known, also for rows fed on the device).

        Returns ``(out, event)``: ``out [R, 3]`` float64 on the host (token, logprob, bad), complete once
        ``event`` (a CUDA event; None on the CPU, where the step has run already) has completed."""
        n = len(inputs[IN_IDS])
        b, length = self.step_shape(n, max_pos)
        cuda = self.device.type == "cuda"
        host = torch.tensor([row + [pad] * (b - n) for row, pad in zip(inputs, IN_PAD, strict=True)],
                            dtype=torch.float64, pin_memory=cuda)
        self.step_in[: 5 * b].copy_(host.view(-1), non_blocking=True)  # `host` is kept until it is copied
        out: torch.Tensor | None = None
        if self._replaying and self.fused_ok:
            graph = self._fused.get((b, length))
            if graph is None:
                if not all(v == 1.0 for v in inputs[IN_HOST]):
                    raise RuntimeError("a fused step must be captured with every row's input from the host")
                graph = self._capture(b, length, fused=True)
            if graph is not None:
                graph[0].replay()
                out = graph[1]
        if out is None:
            out = self._step_body(b, length)
        if not cuda:  # computed: copied out of the step's buffer (a graph's output is overwritten next step)
            return out[:n].clone(), None
        dst = torch.empty((n, 3), dtype=torch.float64, pin_memory=True)
        dst.copy_(out[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return dst, event

    def decode(self, ids: list[int], pos: list[int]) -> torch.Tensor:
        """Logits ``[B', V]`` of one decode step; ``ids[r]``/``pos[r]`` for row (slot) ``r``, ``B' = len(ids)``
        (free slots: any id, position 0). Rows past ``B'`` up to the bucket are computed and dropped."""
        n = len(ids)
        b, length = self.step_shape(n, max(pos))
        host = torch.zeros((2, b), dtype=torch.long)
        host[0, :n] = torch.tensor(ids, dtype=torch.long)
        host[1, :n] = torch.tensor(pos, dtype=torch.long)
        self.io[:, :b].copy_(host, non_blocking=True)
        if self._replaying:
            graph = self._graphs.get((b, length)) or self._capture(b, length)
            if graph is not None:
                graph[0].replay()
                return graph[1][:n]
        return self._decode_body(b, length)[:n]

    def _capture(self, b: int, length: int, fused: bool = False) -> tuple[Any, torch.Tensor] | None:
        """Capture the decode step (``fused``: the fused step) of shape ``(b, length)``; None if it failed."""
        t0 = time.perf_counter()
        body = self._step_body if fused else self._decode_body
        try:
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                # warm-up (idempotent: the same rows write the same keys at the same places; a fused step's
                # feedback is overwritten by the replay, which reads every row's input from the host)
                for _ in range(2):
                    body(b, length)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = body(b, length)
            self._pool = graph.pool()
        except Exception as exc:  # noqa: BLE001 - eager decoding still works
            why = f"{type(exc).__name__}: {exc}"
            if fused:  # this step runs eagerly, later ones the serial way (decode graphs, then the sampler)
                self.fused_failed = why
                log.warning("hf backend: CUDA graph capture of the fused step failed, decoding one step at a "
                            "time: %s", why)
            else:
                self.graph_failed = why
                log.warning("hf backend: CUDA graph capture failed, decoding eagerly: %s", why)
            torch.cuda.synchronize(self.device)
            return None
        store = self._fused if fused else self._graphs
        store[(b, length)] = (graph, out)
        self.capture_s += time.perf_counter() - t0
        log.debug("hf backend: captured %s graph B=%d L=%d in %.2fs", "fused step" if fused else "decode", b,
                  length, time.perf_counter() - t0)
        return store[(b, length)]

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
