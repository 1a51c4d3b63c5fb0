"""The KV-cache memory budget of the ``hf`` engine: how big the slot cache may get, and its shape.

The slot cache (:mod:`.slots`) is a rectangle per layer: ``slots`` sequences x
``capacity + 1`` positions (the last one a trash column), so it holds
``slots * (capacity + 1)`` *positions*, each ``bytes_per_token`` bytes over all layers.
``backend.kv_cache_memory`` caps that (like vLLM's ``gpu_memory_utilization`` or its CPU
KV-cache space): the cache starts small and is reshaped, in large steps, only when a
sequence that waits cannot be placed in the current shape; when the budget holds no
shape for the sequences running plus the next one waiting, that one waits for a slot.

Everything here is pure (numbers in, numbers out) so the maths is tested on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: the smallest capacity (positions per slot) the cache is built with; capacities grow by powers of two
MIN_CAPACITY = 256
#: ``auto`` on CUDA: this share of the device memory free once the weights are loaded
AUTO_CUDA_SHARE = 0.5
#: ``auto`` on CPU: this share of the available RAM ...
AUTO_CPU_SHARE = 0.25
#: ... but no more than this (bytes): a CPU decodes a few long sequences at a time at best
AUTO_CPU_CAP = 4 * 1024 ** 3

_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kib": 1024, "m": 1024 ** 2, "mib": 1024 ** 2, "g": 1024 ** 3, "gib": 1024 ** 3,
    "t": 1024 ** 4, "tib": 1024 ** 4,
    "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


@dataclass(frozen=True)
class MemorySpec:
    """A parsed ``kv_cache_memory``: ``auto``, a number of bytes, or a share of the free memory."""

    kind: str  # "auto" | "bytes" | "share"
    value: float = 0.0

    def __str__(self) -> str:
        if self.kind == "bytes":
            return human_bytes(int(self.value))
        return "auto" if self.kind == "auto" else f"{self.value:g} of the free memory"


def parse_memory(text: object) -> MemorySpec:
    """``"auto"``; a size (``"4GiB"``, ``"512MB"``, ``"4g"``, ``4294967296``: bytes; ``K/M/G/T`` and ``KiB``...
    are powers of 1024, ``KB``/``MB``... of 1000); or a share of the free memory, a decimal in ``(0, 1]``
    written with a point (``"0.3"``). ValueError for anything else."""
    s = str(text).strip()
    if s.lower() == "auto":
        return MemorySpec("auto")
    m = _SIZE.match(s)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"kv_cache_memory {text!r}: expected 'auto', a size such as '4GiB', '512MB' or a number "
                         "of bytes, or a share of the free memory such as '0.3'")
    number = float(m.group(1))
    if "." in m.group(1) and not unit:
        if not 0 < number <= 1:
            raise ValueError(f"kv_cache_memory {text!r}: a share of the free memory must be in (0, 1]")
        return MemorySpec("share", number)
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"kv_cache_memory {text!r} must be more than 0 bytes")
    return MemorySpec("bytes", size)


def budget_bytes(spec: MemorySpec, *, cuda: bool, free_bytes: int) -> int:
    """The budget in bytes. ``free_bytes``: on CUDA the device memory free with the weights loaded, on a
    CPU the available RAM. ``auto`` is :data:`AUTO_CUDA_SHARE` of it on CUDA (room stays for activations,
    CUDA graphs and a trainer beside the engine) and ``min(AUTO_CPU_SHARE of it, AUTO_CPU_CAP)`` on a CPU."""
    if spec.kind == "bytes":
        return int(spec.value)
    if spec.kind == "share":
        return int(spec.value * free_bytes)
    if cuda:
        return int(AUTO_CUDA_SHARE * free_bytes)
    return int(min(AUTO_CPU_SHARE * free_bytes, AUTO_CPU_CAP))


def kv_bytes_per_token(*, layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes one cached position of one sequence takes over all layers (keys and values)."""
    return 2 * layers * kv_heads * head_dim * element_size


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= ``max(n, floor)``."""
    b = max(int(floor), 1)
    while b < n:
        b *= 2
    return b


def cache_shape(count: int, longest: int, *, positions: int, max_slots: int, limit: int,
                current: tuple[int, int] = (0, 0)) -> tuple[int, int] | None:
    """The ``(slots, capacity)`` of a cache for ``count`` sequences of at most ``longest`` positions each,
    within ``positions`` (the budget in cached positions, a slot taking ``capacity + 1``); None: none fits.

    Large steps, so reshapes (and CUDA graph captures) stay few: slots and capacity are powers of two
    (capacity from :data:`MIN_CAPACITY`, at most ``max(limit, longest)``; slots at most ``max_slots``). The
    ``current`` shape's larger dimension is kept where that costs at most twice the larger of the current
    cache and the power-of-two one (so one long sequence does not take every slot's worth of it); tighter
    shapes only when the budget asks for them: the exact count, then the exact length."""
    if count < 1 or count > max_slots or longest < 1:
        return None
    top = max(int(limit), longest)
    cap = min(pow2_at_least(longest, MIN_CAPACITY), top)
    slots = min(pow2_at_least(count), max_slots)
    cur_slots, cur_cap = min(current[0], max_slots), min(current[1], top)
    sticky = (max(slots, cur_slots), max(cap, cur_cap))
    tries = [(slots, cap), (count, cap), (count, max(longest, min(cap, positions // count - 1)))]
    if _size(sticky) <= 2 * max(_size((cur_slots, cur_cap)), _size((slots, cap))):
        tries.insert(0, sticky)
    for s, c in tries:
        if _size((s, c)) <= positions:
            return s, c
    return None


def _size(shape: tuple[int, int]) -> int:
    """Positions a ``(slots, capacity)`` cache holds (a trash column per slot)."""
    return shape[0] * (shape[1] + 1) if shape[0] else 0


def longest_sequence(positions: int) -> int:
    """The most positions one sequence can have in a budget of ``positions`` (one slot and its trash column)."""
    return max(int(positions) - 1, 0)


def available_ram() -> int:
    """Bytes of RAM this process can still take: ``MemAvailable``, or less under a cgroup (v2 or v1) limit."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if avail is None:
        import os

        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 * 1024 ** 3
    for limit_file, used_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                  ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                   "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit = Path(limit_file).read_text().strip()
            used = int(Path(used_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:
            avail = min(avail, max(int(limit) - used, 0))
        break
    return int(avail)


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units (``"4.0 GiB"``)."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if x < 1024 or unit == "GiB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} GiB"  # pragma: no cover
