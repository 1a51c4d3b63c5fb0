"""Exceptions shared by the core and the plugins.

Every error a user can trigger says what went wrong and what to do instead.
"""

from __future__ import annotations

import sys
from typing import NoReturn


class SwarmkitError(Exception):
    """Base class of swarmkit's own errors."""


class PluginLoadError(SwarmkitError):
    """A plugin (entry point) failed to import or to register its components."""


class DuplicateComponentError(SwarmkitError):
    """Two plugins registered a component of the same kind under the same name."""


class UnknownComponentError(SwarmkitError, KeyError):
    """A component name that no installed plugin registered."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class MissingDependencyError(SwarmkitError, ImportError):
    """A component was selected whose heavy dependency is not installed."""


class ConfigError(SwarmkitError, ValueError):
    """A configuration failed validation; the message lists every problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration ({len(self.problems)} problem(s)):\n{lines}")


class EngineError(SwarmkitError, RuntimeError):
    """The inference engine failed to run a request: its fault, not the request's (the server answers 500).

    :param dead: the engine serves no more requests (its step keeps failing, its worker died): every
        pending and later request fails with this at once, and the server stops (answers 503 meanwhile).
    """

    def __init__(self, message: str, *, dead: bool = False):
        super().__init__(message)
        self.dead = dead


class ApiError(SwarmkitError):
    """An error answer of the server's API: raise it anywhere below an endpoint.

    The HTTP layer (:mod:`swarmkit.server.errors`) turns it into an
    OpenAI-style JSON error with this status.

    :param status: HTTP status code.
    :param message: what went wrong and what to do instead.
    :param code: a stable machine-readable code (``episode_not_found``...).
    :param param: the offending request field, if any.
    :param headers: extra response headers (``Retry-After``).
    """

    def __init__(self, status: int, message: str, code: str, *, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}


RETRY_AFTER_MS_HEADER = "X-Swarm-Retry-After-Ms"


def busy(message: str, retry_after: float = 1.0, code: str = "server_busy") -> ApiError:
    """A 503 "retry later" answer that the client SDK (and the openai SDK) honour.

    ``Retry-After`` holds whole seconds (at least 1, as HTTP has it); ``X-Swarm-Retry-After-Ms``
    the expected wait itself, which swarmkit's client prefers (a training step of 50 ms should
    not cost a client a second).
    """
    return ApiError(503, message, code, headers={"Retry-After": f"{max(1, round(retry_after))}",
                                                 RETRY_AFTER_MS_HEADER: f"{max(1, round(retry_after * 1000))}"})


#: the top-level modules of the ``server`` extra (pyproject.toml) and what they pull in
SERVER_EXTRA_MODULES = frozenset({
    "pluggy", "hydra", "omegaconf", "starlette", "uvicorn", "torch", "transformers", "tokenizers",
    "peft", "safetensors", "rich", "gguf", "numpy",
})
SERVER_EXTRA_INSTALL = "pip install 'swarmkit[server]'"


def missing_server_extra(exc: BaseException, what: str = "this") -> str | None:
    """What to say when ``exc`` is a module of the ``server`` extra not found (a light install); else None.

    The base install (``pip install swarmkit``) is only the client SDK; the
    server, training and the command line need ``swarmkit[server]``.
    """
    if not isinstance(exc, ModuleNotFoundError) or isinstance(exc, MissingDependencyError):
        return None
    name = (exc.name or "").split(".")[0]
    if name not in SERVER_EXTRA_MODULES:
        return None
    return (f"{what} needs the server extra of swarmkit (module {name!r} is not installed; the base install "
            f"is only the client SDK, swarmkit.client): {SERVER_EXTRA_INSTALL}")


def exit_for_missing_server_extra(exc: ModuleNotFoundError, what: str) -> NoReturn:
    """A command line's answer to an ImportError: the install hint and exit 2 for a missing
    ``server`` extra (a light install), else the error itself."""
    message = missing_server_extra(exc, what)
    if message is None:
        raise exc
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)
