"""Dashboard login sessions: a random cookie per login, kept in memory.

A browser logs in once with the admin token (a form POST); the server answers
with a session cookie that is ``HttpOnly`` (no script reads it) and
``SameSite=Strict`` (no other site's page sends it). The token is never put in
a URL, so it never lands in a log or the browser history. Sessions live in the
server process: a restart logs everyone out.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

#: the cookie's name
COOKIE = "swarmkit_session"
#: how long a login lasts (seconds)
SESSION_TTL_S = 12 * 3600.0
#: at most this many live sessions (the oldest is dropped beyond)
MAX_SESSIONS = 256
#: failed logins allowed per client address, and from all addresses together, per window (then 429)
LOGIN_FAILURES_PER_ADDRESS = 10
LOGIN_FAILURES_IN_ALL = 100
LOGIN_WINDOW_S = 60.0


class LoginThrottle:
    """Failed dashboard logins per client address in a sliding window (1,155 guesses/s went through
    before): past the limit, the login answers 429 until the oldest failure leaves the window."""

    def __init__(self, per_address: int = LOGIN_FAILURES_PER_ADDRESS, in_all: int = LOGIN_FAILURES_IN_ALL,
                 window_s: float = LOGIN_WINDOW_S):
        self.per_address, self.in_all, self.window_s = int(per_address), int(in_all), float(window_s)
        self._lock = threading.Lock()
        self._failures: dict[str, list[float]] = {}
        self._all: list[float] = []

    def retry_after(self, address: str, now: float | None = None) -> float:
        """Seconds until ``address`` may try again (0: it may now)."""
        now = time.time() if now is None else now
        with self._lock:
            self._prune(now)
            mine = self._failures.get(address, [])
            waits = [0.0]
            if len(mine) >= self.per_address:
                waits.append(mine[0] + self.window_s - now)
            if len(self._all) >= self.in_all:
                waits.append(self._all[0] + self.window_s - now)
            return max(waits)

    def failed(self, address: str, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            self._failures.setdefault(address, []).append(now)
            self._all.append(now)

    def _prune(self, now: float) -> None:
        cut = now - self.window_s
        self._all = [t for t in self._all if t > cut]
        for addr in list(self._failures):
            kept = [t for t in self._failures[addr] if t > cut]
            if kept:
                self._failures[addr] = kept
            else:
                del self._failures[addr]


class Sessions:
    """Issued session ids (kept as SHA-256 digests) and their expiry."""

    def __init__(self, ttl_s: float = SESSION_TTL_S, max_sessions: int = MAX_SESSIONS):
        self.ttl_s = float(ttl_s)
        self.max_sessions = int(max_sessions)
        self._lock = threading.Lock()
        self._expiry: dict[bytes, float] = {}

    def issue(self, now: float | None = None) -> str:
        """A new session id (256 random bits), valid for ``ttl_s``."""
        now = time.time() if now is None else now
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._drop_expired(now)
            while len(self._expiry) >= self.max_sessions:
                self._expiry.pop(min(self._expiry, key=self._expiry.__getitem__))
            self._expiry[_digest(sid)] = now + self.ttl_s
        return sid

    def valid(self, sid: str | None, now: float | None = None) -> bool:
        """Whether ``sid`` is a live session."""
        if not sid or len(sid) > 128:
            return False
        now = time.time() if now is None else now
        with self._lock:
            expiry = self._expiry.get(_digest(sid))
            return expiry is not None and expiry > now

    def revoke(self, sid: str | None) -> None:
        """End a session (logout); unknown ids are ignored."""
        if sid:
            with self._lock:
                self._expiry.pop(_digest(sid), None)

    def _drop_expired(self, now: float) -> None:
        for key in [k for k, t in self._expiry.items() if t <= now]:
            del self._expiry[key]


def _digest(sid: str) -> bytes:
    return hashlib.sha256(sid.encode("utf-8", "surrogatepass")).digest()
