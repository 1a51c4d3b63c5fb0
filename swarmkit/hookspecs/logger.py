"""Loggers: plugins that receive every run's metrics through the lifecycle hooks.

A logger plugin names itself with :func:`register_loggers` and implements the
lifecycle hooks (:mod:`swarmkit.hookspecs.lifecycle`); it acts only for runs whose
config lists its name in ``logger`` (``logger=[tensorboard,wandb]``), keyed by the
``run_dir`` every hook receives. The built-in ones are ``tensorboard``,
``wandb`` and ``mlflow``.
"""

from __future__ import annotations

from collections.abc import Callable

from swarmkit.hookspecs import hookspec


@hookspec
def register_loggers(register: Callable[..., None]) -> None:
    """Declare the loggers this plugin provides.

    Called when a config's ``logger`` list is validated and by ``python -m swarmkit.plugins``.

    :param register: call ``register(name, description, requires=None, extra=None)`` once per
        logger: ``requires`` is the module the logger imports (checked when a config selects it),
        ``extra`` the pip extra that installs it (named in the error).
    :returns: nothing.
    """
