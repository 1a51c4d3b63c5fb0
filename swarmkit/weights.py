"""Weight files: named tensors to and from safetensors, for the trainer and the inference plugins.

The training group hands exported weights to the server through a file (or its
bytes), and an inference backend that reloads from disk (vLLM) writes the
pushed tensors to one. Both write with :func:`save_weights`: CPU, contiguous
copies (tied tensors get their own storage, which safetensors requires),
written beside the target and renamed (:mod:`swarmkit.runfiles`), so a reader
never sees half a file. Plugin-facing: a backend imports it without the
training package. torch and safetensors are imported on use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from swarmkit.runfiles import replacing

__all__ = ["load_weights", "save_weights", "weights_from_bytes", "weights_to_bytes"]


def _cpu_tensors(weights: Mapping[str, Any]) -> dict[str, Any]:
    """CPU, contiguous copies; tied tensors get their own storage, which safetensors requires."""
    out, seen = {}, set()
    for k, v in weights.items():
        v = v.detach().to("cpu").contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def save_weights(weights: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write named tensors to the safetensors file ``path``; written beside and renamed, so readers
    never see half."""
    from safetensors.torch import save_file

    tensors = _cpu_tensors(weights)
    with replacing(path) as tmp:
        save_file(tensors, str(tmp))


def weights_to_bytes(weights: Mapping[str, Any]) -> bytes:
    """Named tensors as the bytes of a safetensors file (for a connection instead of a file)."""
    from safetensors.torch import save

    return bytes(save(_cpu_tensors(weights)))


def weights_from_bytes(data: bytes) -> dict[str, Any]:
    """The named tensors of the bytes of a safetensors file (CPU tensors)."""
    from safetensors.torch import load

    return dict(load(data))


def load_weights(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The named tensors (CPU) of a safetensors file, or of every ``*.safetensors`` file of a folder
    (in name order; a later file's tensor wins).

    :raises FileNotFoundError: no such file, or a folder without safetensors files.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if path.is_file():
        return dict(load_file(str(path)))
    state: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if not state:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return state
