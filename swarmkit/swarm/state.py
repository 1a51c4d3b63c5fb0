"""The server's life-cycle state machine.

``OFFLINE → BOOTING → ROLLING → ROLLING_POST → WEIGHT_SYNCING → ROLLING``;
``stop`` goes to ``OFFLINE`` from any state, and a failed boot falls back to
``OFFLINE`` with ``last_error`` set. Any other move raises
:class:`IllegalTransition`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from enum import StrEnum

from swarmkit.errors import SwarmkitError


class ServerState(StrEnum):
    OFFLINE = "OFFLINE"
    BOOTING = "BOOTING"
    ROLLING = "ROLLING"
    ROLLING_POST = "ROLLING_POST"
    WEIGHT_SYNCING = "WEIGHT_SYNCING"


S = ServerState

#: state -> states it may move to (OFFLINE is reachable from every state: stop)
TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    S.OFFLINE: frozenset({S.BOOTING}),
    S.BOOTING: frozenset({S.ROLLING, S.OFFLINE}),
    S.ROLLING: frozenset({S.ROLLING_POST, S.OFFLINE}),
    S.ROLLING_POST: frozenset({S.WEIGHT_SYNCING, S.OFFLINE}),
    S.WEIGHT_SYNCING: frozenset({S.ROLLING, S.OFFLINE}),
}

#: states in which running episodes may call the model
SERVING_STATES = frozenset({S.ROLLING, S.ROLLING_POST})


class IllegalTransition(SwarmkitError):
    """A state change the life cycle does not allow."""


class StateMachine:
    """Holds the current state, checks every move, and wakes waiters.

    Listeners (``on_change(old, new)``) run synchronously on every move; a
    listener that raises does not block the transition.
    """

    def __init__(self) -> None:
        self._state = S.OFFLINE
        self.since = time.time()
        self.last_error: str | None = None
        self.history: list[tuple[float, ServerState]] = [(self.since, S.OFFLINE)]
        self._listeners: list[Callable[[ServerState, ServerState], None]] = []
        self._changed: asyncio.Event | None = None

    @property
    def state(self) -> ServerState:
        return self._state

    def can(self, new: ServerState | str) -> bool:
        return ServerState(new) in TRANSITIONS[self._state]

    def transition(self, new: ServerState | str, *, error: str | None = None) -> ServerState:
        """Move to ``new``; returns the old state.

        :raises IllegalTransition: the move is not in :data:`TRANSITIONS`.
        """
        new = ServerState(new)
        old = self._state
        if new not in TRANSITIONS[old]:
            allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old]))
            raise IllegalTransition(f"cannot go from {old} to {new}; from {old} the server may go to {allowed}")
        self._state = new
        self.since = time.time()
        if error is not None:
            self.last_error = error
        elif new is S.BOOTING:
            self.last_error = None
        self.history.append((self.since, new))
        del self.history[:-100]
        for listener in list(self._listeners):
            try:
                listener(old, new)
            except Exception:  # noqa: BLE001 - a listener must not break the life cycle
                import logging

                logging.getLogger("swarmkit.server").exception("state listener failed")
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        return old

    def add_listener(self, fn: Callable[[ServerState, ServerState], None]) -> None:
        self._listeners.append(fn)

    async def wait_for(self, states: Iterable[ServerState | str], timeout: float | None = None) -> bool:
        """Wait (in the server's event loop) until the state is one of ``states``."""
        wanted = {ServerState(s) for s in states}
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while self._state not in wanted:
            if self._changed is None:
                self._changed = asyncio.Event()
            event = self._changed
            remaining = None if end is None else end - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            try:
                async with asyncio.timeout(remaining):  # not wait_for: it can lose a cancellation on 3.11
                    await event.wait()
            except TimeoutError:
                return self._state in wanted
        return True
