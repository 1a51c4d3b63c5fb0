"""Run files that a reader, or a resume after a kill, sees whole or not at all.

The one atomic write of the tree: the new content goes to a fresh temporary
file in the target's folder (same file system, so the rename is atomic), is
flushed to disk (``fsync``) and renamed over the target (``os.replace``). A
failure on the way removes the temporary file and leaves the old target as it
was. :func:`replacing` hands out the temporary path to any writer (safetensors,
a tokenizer); :func:`write_bytes`, :func:`write_text` and :func:`write_json`
are the common cases. :func:`staged_dir` does the same for a folder (a model
build, a checkpoint).

Pure standard library: the light client SDK uses it too (``tests/test_layers.py``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["replacing", "staged_dir", "write_bytes", "write_json", "write_text"]

#: the permissions of a new file before the umask (what ``open(path, "w")`` gives)
DEFAULT_MODE = 0o666


@contextmanager
def replacing(path: str | os.PathLike[str], *, mode: int = DEFAULT_MODE) -> Iterator[Path]:
    """A fresh temporary file beside ``path`` (created empty with ``mode`` less the umask, e.g.
    ``0o600`` for a secret, so it is never readable by others); write it, and on a clean exit it is
    synced and renamed over ``path``. On an error it is removed and ``path`` is left as it was. The
    folder is created if missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _create_beside(path, mode)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes, *, mode: int = DEFAULT_MODE) -> None:
    """Replace ``path`` with ``data`` atomically (:func:`replacing`)."""
    with replacing(path, mode=mode) as tmp, open(tmp, "wb") as f:
        f.write(data)


def write_text(path: str | os.PathLike[str], text: str, *, mode: int = DEFAULT_MODE) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically (:func:`replacing`)."""
    write_bytes(path, text.encode("utf-8"), mode=mode)


def write_json(path: str | os.PathLike[str], data: Any, *, indent: int | None = 1,
               default: Callable[[Any], Any] | None = None, allow_nan: bool = True,
               mode: int = DEFAULT_MODE) -> None:
    """Replace ``path`` with ``data`` as JSON atomically (:func:`replacing`); ``indent``,
    ``default`` and ``allow_nan`` as in :func:`json.dumps`."""
    write_text(path, json.dumps(data, indent=indent, default=default, allow_nan=allow_nan), mode=mode)


@contextmanager
def staged_dir(target: str | os.PathLike[str], *, replace: bool = False) -> Iterator[Path]:
    """A folder to build ``target`` in, renamed to ``target`` on a clean exit (removed on an error),
    so nobody sees half of it.

    - ``replace=False`` (builders that may race, e.g. the model cache): a staging folder of its own
      (``<target>.tmpXXXX``); when another builder put ``target`` there first, ours is dropped.
    - ``replace=True`` (one writer, e.g. the trainer's checkpoints): the staging folder is
      ``<target>.tmp`` (a stale one, left by a killed run, is cleared first); an existing ``target``
      is replaced.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if replace:
        tmp = target.with_name(target.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    else:
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        yield tmp
        if replace:
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        else:
            try:
                os.rename(tmp, target)
            except OSError:  # another builder won the race: keep theirs
                pass
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _create_beside(path: Path, mode: int) -> Path:
    """A new empty file ``.<name>.<pid>.<random>.tmp`` in ``path``'s folder, no other process's."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {path}")
