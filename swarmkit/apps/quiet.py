"""The main job's quiet output: which loggers it keeps to warnings, and for how long."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

#: loggers that speak once per request, retry or drain: a line each at INFO would flood a terminal
QUIET_LOGGERS = ("httpx", "httpcore", "swarmkit.client", "swarmkit.cycle")


@contextmanager
def quiet_loggers(names: tuple[str, ...] = QUIET_LOGGERS, level: int = logging.WARNING) -> Iterator[None]:
    """Hold ``names`` at ``level`` for the ``with`` block, then give each its own level back, so a main job
    run inside a larger program (a test, a notebook) leaves that program's logging as it found it."""
    loggers = [logging.getLogger(n) for n in names]
    before = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, before, strict=True):
            lg.setLevel(lvl)
