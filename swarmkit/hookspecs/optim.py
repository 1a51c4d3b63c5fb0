"""Optimizer engines: FSDP, DeepSpeed ZeRO, or a third party's."""

from __future__ import annotations

from collections.abc import Callable

from swarmkit.hookspecs import hookspec


@hookspec
def register_optims(register: Callable[..., None]) -> None:
    """Register optimizer engines (kind ``optim``).

    Called once, when the plugin manager first loads plugins.

    :param register: ``register(name, target, schema=None, requires=(), extra=None,
        description="", experimental=False)``; ``target`` names a class implementing
        :class:`swarmkit.contract.OptimEngine` (owns the trainable model,
        its optimizer and the distributed set-up; launched with torchrun or
        deepspeed for more than one process).
    :returns: nothing; every implementation is called.
    """
