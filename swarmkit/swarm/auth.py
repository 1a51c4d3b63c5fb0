"""Who may do what: the admin token for controller calls, the client token for sampling clients.

Episode keys are the :class:`~swarmkit.swarm.episodes.EpisodeRegistry`'s; this
module holds the admin token of a server process and its optional client token,
and checks them in constant time.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

from swarmkit.errors import ApiError, ConfigError

ENV_ADMIN_TOKEN = "SWARMKIT_ADMIN_TOKEN"
ENV_CLIENT_TOKEN = "SWARMKIT_CLIENT_TOKEN"
ADMIN_TOKEN_FILE = "admin_token"


def resolve_admin_token(configured: str | None, run_dir: str | os.PathLike | None) -> tuple[str, str]:
    """The admin token and where it came from.

    Order: ``server.admin_token`` → ``$SWARMKIT_ADMIN_TOKEN`` → a new random
    token written to ``<run_dir>/admin_token`` with mode 0600. Returns
    ``(token, source)`` where source is ``"config"``, ``"env"`` or the file path.
    """
    if configured:
        return _long_enough(str(configured), "server.admin_token"), "config"
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env:
        return _long_enough(env, f"${ENV_ADMIN_TOKEN}"), "env"
    token = secrets.token_urlsafe(32)
    if run_dir is None:
        return token, "generated (not written: no run_dir)"
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ADMIN_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    try:
        os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token, str(path)


#: the shortest admin token a server accepts (a one-character token was accepted, and guessed)
MIN_ADMIN_TOKEN = 16


def _long_enough(token: str, where: str) -> str:
    if len(token) < MIN_ADMIN_TOKEN:
        raise ConfigError([f"{where} is {len(token)} characters; an admin token needs at least {MIN_ADMIN_TOKEN} "
                           "(leave it unset and the server generates one into RUN_DIR/admin_token)"])
    return token


class AdminAuth:
    """The server's admin token and where it came from (see :func:`resolve_admin_token`)."""

    def __init__(self, configured: str | None, run_dir: str | os.PathLike | None):
        self.token, self.source = resolve_admin_token(configured, run_dir)

    def is_admin(self, token: str | None) -> bool:
        return bool(token) and secrets.compare_digest(str(token).encode(), self.token.encode())

    def check(self, token: str | None) -> None:
        """401 without a token, 403 with a wrong one."""
        if not token:
            raise ApiError(401, "missing admin token: send 'Authorization: Bearer <admin token>' (see the server's "
                           "start-up message for where the token is)", "missing_admin_token")
        if not self.is_admin(token):
            raise ApiError(403, "wrong admin token", "wrong_admin_token")


def _same(a: str, b: str) -> bool:
    return secrets.compare_digest(a.encode(), b.encode())


class ClientAuth:
    """The optional client token (``server.client_token``, else ``$SWARMKIT_CLIENT_TOKEN``).

    Without one, registering episodes, client votes and heartbeats are open to anyone who reaches
    the port (fine on 127.0.0.1); with one, each needs it or the admin token as the bearer token.
    """

    def __init__(self, configured: str | None):
        self.token: str | None = str(configured) if configured else os.environ.get(ENV_CLIENT_TOKEN) or None

    @property
    def required(self) -> bool:
        return self.token is not None

    def check(self, token: str | None, admin: AdminAuth) -> None:
        """401 without a token, 403 with a wrong one; nothing when no client token is set."""
        if self.token is None:
            return
        if not token:
            raise ApiError(401, "missing client token: this server requires one to register episodes and vote; send "
                           "'Authorization: Bearer <client token>' (SwarmClient(client_token=...) or "
                           f"${ENV_CLIENT_TOKEN})", "missing_client_token")
        if not (_same(str(token), self.token) or admin.is_admin(token)):
            raise ApiError(403, "wrong client token", "wrong_client_token")


#: config keys never echoed, written or handed to a plugin: the tokens that grant access
SECRET_KEYS = ("admin_token", "client_token")


#: keys of other groups that hold credentials (the distillation teacher's API key)
GROUP_SECRET_KEYS = {"algo": ("teacher_api_key",)}


def redacted(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with the server's tokens (and other groups' credentials) replaced by ``"***"`` (for answers,
    files and loggers)."""
    out = cfg
    for group, keys in {"server": SECRET_KEYS, **GROUP_SECRET_KEYS}.items():
        section = out.get(group)
        if isinstance(section, dict) and any(section.get(k) for k in keys):
            out = {**out, group: {k: ("***" if k in keys and v else v) for k, v in section.items()}}
    return out
