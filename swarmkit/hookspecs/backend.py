"""Inference backends: engines that generate from token ids with logprobs.

A backend class (loaded lazily from its import string) implements
:class:`swarmkit.contract.InferenceBackend`.
"""

from __future__ import annotations

from collections.abc import Callable

from swarmkit.hookspecs import hookspec


@hookspec
def register_backends(register: Callable[..., None]) -> None:
    """Register inference backends (kind ``backend``).

    Called once, when the plugin manager first loads plugins, for every plugin
    that implements it.

    :param register: ``register(name, target, schema=None, requires=(), extra=None,
        description="", experimental=False)``. ``target`` is the import string (``"pkg.mod:Class"``) of a
        class implementing :class:`swarmkit.contract.InferenceBackend`;
        ``schema`` a dataclass for the ``backend`` config group; ``requires`` the
        top-level modules the class needs (never imported while registering);
        ``extra`` the pip extra that installs them.
    :returns: nothing; the return value is ignored. Every implementation is called.
    """
