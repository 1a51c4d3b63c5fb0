"""Give the heap's freed pages back to the operating system after a CPU training step.

glibc keeps memory freed by a step's activations in its arenas, so without a
trim a CPU process stays at the resident size of its largest step (a calc_agent
run of SmolLM2 grew to 15 GB and was killed by the OOM killer on a 24 GB box).
``malloc_trim(0)`` returns it; elsewhere (macOS, musl) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> bool:
    """Trim the C heap; True if it could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
