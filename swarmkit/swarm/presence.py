"""Which clients are alive and which have signalled "ready" (for C4/C5)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time

from swarmkit.contract import ClientState

#: heartbeats a client may miss before it counts as gone
SILENT_BEATS = 3
#: the shortest silence that counts as gone, whatever interval was declared (seconds)
MIN_SILENCE_S = 2.0
#: the heartbeat intervals a client may declare (seconds)
BEAT_RANGE_S = (0.5, 60.0)


class ClientTracker:
    """Thread-safe registry of clients, their last contact and ready flag.

    A client is *active* while it has sent anything within ``active_window_s``
    seconds. Times are ``time.time()`` seconds unless given explicitly; use the
    same clock for ``touch`` and ``active``.
    """

    def __init__(self, active_window_s: float = 60.0):
        if active_window_s <= 0:
            raise ValueError(f"active_window_s must be > 0, got {active_window_s}")
        self.active_window_s = float(active_window_s)
        self._lock = threading.Lock()
        self._clients: dict[str, ClientState] = {}
        #: client id -> sha256 of the key that holds it (votes and heartbeats must show the key)
        self._keys: dict[str, bytes] = {}
        #: client id -> the heartbeat interval it declared (seconds): silent for SILENT_BEATS of them, it is gone
        self._beats: dict[str, float] = {}

    def touch(self, client_id: str, now: float | None = None) -> None:
        """Record that ``client_id`` sent something at ``now``."""
        now = time.time() if now is None else float(now)
        with self._lock:
            state = self._clients.get(client_id)
            if state is None:
                self._clients[client_id] = ClientState(client_id, now, False)
            else:
                state.last_seen = max(state.last_seen, now)

    def set_ready(self, client_id: str, ready: bool, now: float | None = None) -> None:
        """Set the client's ready flag (this also counts as contact)."""
        self.touch(client_id, now)
        with self._lock:
            self._clients[client_id].ready = bool(ready)

    def bind(self, client_id: str, key: str | None) -> str | None:
        """Check that ``key`` holds ``client_id``, binding the id on first use.

        An id nobody holds is bound to ``key`` (a client that kept its key across a server
        restart) or, without one, to a fresh key, which is returned: the caller hands it to the
        client. Returns None when ``key`` matches the id's key.

        :raises PermissionError: the id is held by another key.
        """
        with self._lock:
            held = self._keys.get(client_id)
            if held is None:
                issued = key or secrets.token_urlsafe(24)
                self._keys[client_id] = _digest(issued)
                return issued
            if not key or not hmac.compare_digest(held, _digest(key)):
                raise PermissionError(client_id)
            return None

    def claim(self, client_id: str, key: str) -> bool:
        """Bind an id nobody holds to ``key`` (a registration that shows one claims its id before any vote
        can); True when ``key`` holds the id afterwards. A held id is left as it is."""
        with self._lock:
            held = self._keys.get(client_id)
            if held is None:
                self._keys[client_id] = _digest(key)
                return True
            return hmac.compare_digest(held, _digest(key))

    def declare_beat(self, client_id: str, interval_s: float) -> None:
        """``client_id`` sends a heartbeat every ``interval_s`` while it has episodes open."""
        with self._lock:
            self._beats[client_id] = float(interval_s)

    def gone(self, client_id: str, now: float | None = None) -> bool:
        """Whether a client that declared a heartbeat has missed :data:`SILENT_BEATS` of them (its process
        died); False for a client that never declared one (nothing tells its silence from a long tool call)."""
        now = time.time() if now is None else float(now)
        with self._lock:
            interval = self._beats.get(client_id)
            state = self._clients.get(client_id)
            if interval is None or state is None:
                return False
            return now - state.last_seen > max(SILENT_BEATS * interval, MIN_SILENCE_S)

    def reset_ready(self) -> None:
        """Clear every ready flag (the server calls this when a batch fires)."""
        with self._lock:
            for state in self._clients.values():
                state.ready = False

    def prune(self, now: float | None = None, *, idle_windows: float = 10.0) -> int:
        """Forget clients silent for ``idle_windows`` activity windows (at least 10 minutes):
        client ids never pile up. Returns how many were dropped."""
        now = time.time() if now is None else float(now)
        horizon = max(idle_windows * self.active_window_s, 600.0)
        with self._lock:
            gone = [cid for cid, s in self._clients.items() if now - s.last_seen > horizon]
            for cid in gone:
                del self._clients[cid]
            for cid in [c for c in self._keys if c not in self._clients]:
                del self._keys[cid]  # a forgotten id is free again
            for cid in [c for c in self._beats if c not in self._clients]:
                del self._beats[cid]
        return len(gone)

    def forget(self, client_id: str) -> None:
        """Drop a client (e.g. it said goodbye); unknown ids are ignored."""
        with self._lock:
            self._clients.pop(client_id, None)
            self._keys.pop(client_id, None)
            self._beats.pop(client_id, None)

    def active(self, now: float | None = None) -> dict[str, ClientState]:
        """Copies of the states of clients seen within the window of ``now``."""
        now = time.time() if now is None else float(now)
        with self._lock:
            return {
                cid: ClientState(s.client_id, s.last_seen, s.ready)
                for cid, s in self._clients.items()
                if now - s.last_seen <= self.active_window_s
            }

    def all(self) -> dict[str, ClientState]:
        """Copies of every known client's state, active or not."""
        with self._lock:
            return {
                cid: ClientState(s.client_id, s.last_seen, s.ready)
                for cid, s in self._clients.items()
            }


def _digest(key: str) -> bytes:
    """What the tracker keeps of a client key (never the key itself)."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
