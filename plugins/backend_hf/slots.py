"""A static, slot-based KV cache for the ``hf`` engine, and the attention that reads it.

Every running sequence owns one *slot* of a preallocated cache (per layer, keys and
values of shape ``[slots, kv_heads, capacity + 1, head_dim]``). A decode step writes
each row's new key/value at its own position in place and attends over the first
``L`` positions of the first ``B`` slots, a view: no concatenation, no compaction
copy, and the tensors never move, so a CUDA graph captured over them stays valid.
Column ``capacity`` is a trash column: the keys of left-padding columns of a
prefill are written there and never read.

The model is the unmodified ``transformers`` model (the trainer's implementation);
two hooks make it use the slots:

- :class:`SlotCache` is passed as ``past_key_values``; its ``update`` writes where
  :meth:`SlotCache.plan` said and returns the window to attend over;
- :func:`slot_attention` is registered as a transformers attention function
  (``attn_implementation="swarmkit_slots"``): SDPA with the additive mask the engine
  builds, grouped-query heads folded into the query length instead of repeating the
  cached keys (``repeat_kv`` would copy the whole window every layer).

Shapes: ``B`` rows, ``T`` query positions, ``L`` attended positions, ``H`` query heads,
``Hkv`` key/value heads, ``D`` head dim, ``G = H / Hkv``.
"""

from __future__ import annotations

from typing import Any

import torch

ATTN_NAME = "swarmkit_slots"
_registered = False


def register_attention() -> str:
    """Register :func:`slot_attention` with transformers (once); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_NAME, slot_attention)
        _registered = True
    return ATTN_NAME


def slot_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the slot window. ``query [B, H, T, D]``, ``key``/``value [B, Hkv, L, D]``,
    ``attention_mask [B, 1, T, L]`` additive (0 or -inf); returns ``[B, T, H, D]``."""
    for name in ("sinks", "s_aux", "softcap"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the hf engine's slot attention does not support '{name}'")
    b, h, t, d = query.shape
    hkv, length = key.shape[1], key.shape[2]
    g = h // hkv
    mask = attention_mask
    if mask is not None and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if t == 1 or (g == 1 and mask is not None):
        # decode: the G query heads of a key/value head become G query positions (head h = kv_head * G + g,
        # as transformers' repeat_kv orders them), so the cached window is read once, never repeated
        q = query.reshape(b, hkv, g * t, d)
        if mask is not None and g > 1:
            mask = mask.expand(b, 1, g * t, length) if t == 1 else mask
        out = sdpa(q, key, value, attn_mask=mask, scale=scaling)
        return out.reshape(b, h, t, d).transpose(1, 2).contiguous(), None
    # prefill: repeat the keys/values over the query heads (the mask would otherwise be copied G times);
    # no mask: a plain forward of the whole sequence (no slot cache), causal
    key = key[:, :, None].expand(b, hkv, g, length, d).reshape(b, h, length, d)
    value = value[:, :, None].expand(b, hkv, g, length, d).reshape(b, h, length, d)
    out = sdpa(query, key, value, attn_mask=mask, scale=scaling, is_causal=mask is None and t == length)
    return out.transpose(1, 2).contiguous(), None


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (bool) as an additive mask of ``dtype``: 0 where allowed, -inf elsewhere."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype, device=allowed.device))


def _cache_base() -> type:
    from transformers import Cache

    return Cache


class SlotCache(_cache_base()):  # type: ignore[misc]
    """Per-layer key/value slots; :meth:`plan` says where the next forward writes and reads.

    :param layers: decoder layers; ``kv_heads``/``head_dim`` their key/value shape.
    :param slots: sequences held at once; ``capacity`` positions each.
    """

    is_compileable = False

    def __init__(self, *, layers: int, slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__(layers=[])
        self.n_layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.slots = self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._write: tuple[torch.Tensor, torch.Tensor] | None = None
        self._read: tuple[torch.Tensor | None, int] = (None, 0)
        self.reshape(slots, capacity)

    # ------------------------------------------------------------------ storage
    def bytes_per_token(self) -> int:
        """Bytes one position of one slot takes over all layers (keys and values)."""
        return 2 * self.n_layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def nbytes(self) -> int:
        """Bytes the storage takes now (every slot, every position, the trash column included)."""
        return self.slots * (self.capacity + 1) * self.bytes_per_token()

    def reshape(self, slots: int, capacity: int, moves: dict[int, int] | None = None, length: int = 0) -> None:
        """New storage of ``slots`` x ``capacity`` positions; the first ``length`` positions of slot ``old`` go to
        slot ``new`` for each ``old: new`` of ``moves`` (the sequences that keep running). One layer at a time,
        the old one freed before the next is built: the peak is the larger shape plus one layer, not both."""
        moves = moves or {}
        length = min(int(length), self.capacity, capacity)
        src = torch.tensor(list(moves), dtype=torch.long, device=self.device)
        dst = torch.tensor(list(moves.values()), dtype=torch.long, device=self.device)
        shape = (slots, self.kv_heads, capacity + 1, self.head_dim)
        for store in (self.keys, self.values):
            for i in range(self.n_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    if moves and length:
                        new[dst, :, :length] = store[i][src, :, :length]
                    store[i] = new
                else:
                    store.append(new)
        self.slots, self.capacity = int(slots), int(capacity)

    def copy_slot(self, src: int, dsts: list[int], length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slots ``dsts`` (``n > 1`` continuations)."""
        idx = torch.tensor(dsts, device=self.device)
        for t in (*self.keys, *self.values):
            t[idx, :, :length] = t[src, :, :length].unsqueeze(0)

    # ------------------------------------------------------------------ the next forward
    def plan(self, write_slots: torch.Tensor, write_pos: torch.Tensor, read_slots: torch.Tensor | None,
             read_len: int) -> None:
        """The next forward writes input column ``c`` of row ``r`` at ``(write_slots[r, c], write_pos[r, c])``
        (``[B, T]`` each; the trash column ``capacity`` for padding) and attends over the first ``read_len``
        positions of ``read_slots`` (``[B]``; None: slots ``0..B-1``, a view)."""
        self._write = (write_slots, write_pos)
        self._read = (read_slots, int(read_len))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``key/value_states [B, Hkv, T, D]`` where planned; return the window ``[B, Hkv, L, D]``."""
        if self._write is None:
            raise RuntimeError("SlotCache.update before plan()")
        rows, pos = self._write
        k, v = self.keys[layer_idx], self.values[layer_idx]
        k[rows, :, pos] = key_states.transpose(1, 2).to(k.dtype)
        v[rows, :, pos] = value_states.transpose(1, 2).to(v.dtype)
        read, length = self._read
        if read is None:
            b = key_states.shape[0]
            return k[:b, :, :length], v[:b, :, :length]
        return k[read, :, :length], v[read, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.capacity

    def __len__(self) -> int:
        return self.n_layers
