"""The blocking client: :class:`SwarmClient` and its :class:`Episode` (``httpx.Client``).

The async twin is :mod:`swarmkit.client.aio`; both build their requests,
retry and parse answers with :mod:`swarmkit.client._common`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from swarmkit.client._common import (
    CLIENT_HEADER,
    HEARTBEAT_S,
    LIFECYCLE_TIMEOUT_S,
    TRANSIENT_ERRORS,
    EpisodeInfo,
    HoldsClientId,
    Retry,
    RetryCallback,
    ServerUnavailable,
    StateWait,
    SwarmAPIError,
    SwarmError,
    TurnRewards,
    abort_reason,
    adapter_body,
    already_reported,
    auth_headers,
    beat_body,
    checked,
    configure_body,
    demonstration_body,
    is_lost_report_ack,
    json_object,
    prepare_body,
    register_body,
    report_body,
    timelines_of,
    transport_error,
)

__all__ = ["Episode", "SwarmClient"]


class Episode(EpisodeInfo):
    """A registered episode: where to send the agent, and how to end it.

    ``base_url`` / ``api_key`` go to any OpenAI-compatible agent. With roles,
    ``keys[role]`` is the key of each role (``key_for(role)``); ``api_key`` is
    the first role's.
    """

    def __init__(self, client: SwarmClient, info: dict[str, Any]):
        super().__init__(info)
        self._client = client

    def report(self, reward: float | Mapping[str, float], meta: Mapping[str, Any] | None = None, *,
               turn_rewards: TurnRewards | None = None,
               call_rewards: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """End the episode with a reward (a number, or role → number).

        ``turn_rewards``: each call's own reward, in call order (a list; role → list with roles;
        None skips a turn); ``call_rewards``: items naming calls by index, with a ``reward`` or
        the call's per-token ``advantages`` (the expert option). Both need an algorithm with
        per-turn credit on a training server (``algo=turn_grpo``); see docs/client.md.
        """
        self.result = self._client._end(self, "/report", report_body(reward, meta, turn_rewards, call_rewards))
        return self.result

    def prepare(self, reward: float | Mapping[str, float], meta: Mapping[str, Any] | None = None, *,
                primary: EpisodeInfo | None = None, turn_rewards: TurnRewards | None = None,
                call_rewards: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """First phase of a multi-server end: the server keeps the reward until :meth:`commit`.

        ``primary``: the episode whose commit decides this one (None for the primary
        itself); see :func:`swarmkit.client.swarm_episode`, which makes these calls.
        """
        self.prepared = self._client._call("POST", self._path("/prepare"),
                                              json_body=prepare_body(reward, meta, primary, turn_rewards, call_rewards), key=self.api_key)
        return self.prepared

    def commit(self) -> dict[str, Any]:
        """Second phase: the prepared episode goes to the pool (safe to repeat)."""
        self.result = self._client._call("POST", self._path("/commit"), key=self.api_key)
        return self.result

    def abort(self, reason: str = "aborted by the client") -> dict[str, Any]:
        """End the episode without a sample (e.g. the environment failed)."""
        self.result = self._client._end(self, "/abort", {"reason": str(reason)})
        return self.result

    def demonstrate(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, *, role: str | None = None
                    ) -> dict[str, Any]:
        """Record a demonstrated conversation: its assistant turns train with a supervised
        (NLL) loss, the warm start of an agent that cannot play yet. ``role``: whose turns they
        are in an episode with roles (default: the first role's). Report the episode afterwards
        as usual (the reward is not used for demonstrated turns)."""
        key = self.api_key if role is None else self.key_for(role)
        return self._client._call("POST", self._path("/demonstration"),
                                     json_body=demonstration_body(messages, tools), key=key)

    def timelines(self, as_objects: bool = False) -> list[Any]:
        """The recorded timelines as JSON dicts (``swarmkit.timelines.Timeline`` with ``as_objects``)."""
        return timelines_of(self._client._call("GET", self._path("/timelines"), key=self.api_key),
                            as_objects)

    def status(self) -> dict[str, Any]:
        """The server's summary of this episode."""
        return self._client._call("GET", self._path(), key=self.api_key)


class SwarmClient(HoldsClientId):
    """Talks to one swarm server.

    :param url: the server's address, e.g. ``http://127.0.0.1:8000``.
    :param token: the admin token (needed for controller calls: configure,
        start, stop, status...); default ``$SWARMKIT_ADMIN_TOKEN``.
    :param client_token: the server's client token, when it requires one to register episodes
        and vote (``server.client_token``); default ``$SWARMKIT_CLIENT_TOKEN`` (the admin
        token is accepted in its place).
    :param client_id: stable id sent with every request so the server can
        count this client as active (batching C4/C5); default: random.
    :param timeout: seconds per HTTP request (stop, restart and checkpoint wait at least
        ``LIFECYCLE_TIMEOUT_S``).
    :param retry_for: seconds to keep retrying connection errors and 503s.
    :param on_retry: called with a :class:`~swarmkit.client.RetryEvent` before
        each retry's sleep (every retry is also logged on the ``swarmkit.client``
        logger: DEBUG, and INFO the first of its kind, then one a minute); an exception it raises ends the retries.
    :param heartbeat_s: while this client has an episode open, a background thread tells the
        server every ``heartbeat_s`` seconds that it is alive; a client that misses three (its
        process died) does not hold the next training step. None: no heartbeat.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        client_id: str | None = None,
        client_token: str | None = None,
        timeout: float = 60.0,
        retry_for: float = 120.0,
        on_retry: RetryCallback | None = None,
        transport: httpx.BaseTransport | None = None,
        heartbeat_s: float | None = HEARTBEAT_S,
    ):
        self._settings(url, token, client_id, client_token, timeout, retry_for, on_retry, heartbeat_s)
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                  headers={CLIENT_HEADER: self.client_id})
        #: episodes registered here, until they end or are dropped (the heartbeat runs while one is open)
        self._open: weakref.WeakSet[Episode] = weakref.WeakSet()
        self._beat_stop = threading.Event()
        #: set by :meth:`close`: a retry sleeping in another thread wakes and gives up (Ctrl-C, a shutdown)
        self._closed = threading.Event()
        self._beat_thread: threading.Thread | None = None
        self._beat_lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        """Close the connections; retries in progress in other threads end at once with :class:`SwarmError`."""
        self._closed.set()
        self._beat_stop.set()
        self._http.close()

    def _pause(self, seconds: float, method: str, path: str) -> None:
        """Sleep before a retry, unless the client is closed meanwhile: then the request gives up (a client
        closed on Ctrl-C must not sit out its retry budget, up to ``retry_for`` seconds per thread)."""
        if self._closed.wait(seconds):
            raise SwarmError(f"{method} {self.url}{path}: the client was closed while retrying")

    def _pulse(self) -> None:
        """The heartbeat thread: beats while an episode is open, ends when none is (or on close)."""
        assert self.heartbeat_s is not None
        while not self._beat_stop.wait(self.heartbeat_s):
            with self._beat_lock:
                if not any(not ep.ended for ep in list(self._open)):
                    self._beat_thread = None
                    return
            try:
                self._kept_key(self._call("POST", "/api/v1/clients/heartbeat", json_body=beat_body(self.heartbeat_s),
                                          key=self._sampling_key(), extra_headers=self._key_header(), retry_for=0))
            except Exception:  # noqa: BLE001 - a missed beat only makes the server wait as it did without one
                pass

    def _opened(self, ep: Episode) -> Episode:
        if self.heartbeat_s is not None:
            with self._beat_lock:
                self._open.add(ep)
                if self._beat_thread is None and not self._beat_stop.is_set():
                    self._beat_thread = threading.Thread(target=self._pulse, name="swarmkit-heartbeat", daemon=True)
                    self._beat_thread.start()
        return ep

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, *, json_body: Any = None, key: str | None = None,
                 admin: bool = False, retry_for: float | None = None,
                 timeout: float | None = None, extra_headers: Mapping[str, str] | None = None) -> httpx.Response:
        headers = {**auth_headers(self.token if admin else key), **(extra_headers or {})}
        retry = Retry(self.url, method, path, self.retry_for if retry_for is None else retry_for, self.on_retry,
                      notes=self._retry_notes)
        while True:
            try:
                resp = self._http.request(method, path, json=json_body, headers=headers,
                                         timeout=self._timeout if timeout is None else max(timeout, self._timeout))
            except TRANSIENT_ERRORS as exc:
                self._pause(retry.after_error(exc), method, path)
                continue
            except httpx.TransportError as exc:  # mid-request: a GET is safe to repeat, a change is not
                if method != "GET":
                    raise transport_error(method, self.url, path, exc) from exc
                self._pause(retry.after_error(exc), method, path)
                continue
            if resp.status_code != 503:
                return checked(resp)
            self._pause(retry.after_busy(resp), method, path)

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return json_object(self._request(method, path, **kwargs))

    def _sampling_key(self) -> str | None:
        """The bearer token of a sampling call (register, vote, heartbeat): the client token, else the admin's."""
        return self.client_token or self.token

    # ------------------------------------------------------------------ controller
    def configure(self, config: Mapping[str, Any] | str | os.PathLike[str] | Sequence[str]) -> dict[str, Any]:
        """Send a training config: a dict, a YAML file path, or Hydra overrides (a list of strings)."""
        return self._call("POST", "/api/v1/admin/configure", json_body=configure_body(config), admin=True)

    def start(self) -> dict[str, Any]:
        """Load the configured model: the server goes BOOTING, then ROLLING."""
        return self._call("POST", "/api/v1/admin/start", admin=True)

    def stop(self) -> dict[str, Any]:
        """Abort running episodes and unload the model (OFFLINE)."""
        return self._call("POST", "/api/v1/admin/stop", admin=True, timeout=LIFECYCLE_TIMEOUT_S)

    def restart(self) -> dict[str, Any]:
        """Stop, then start with the latest configuration."""
        return self._call("POST", "/api/v1/admin/restart", admin=True, timeout=LIFECYCLE_TIMEOUT_S)

    def add_adapter(self, name: str, *, lr: float | str | None = None,
                    batching: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Add LoRA adapter ``name`` to a server started with ``model.adapters``: trained and served from now
        on, without a restart (``lr``: a number or "auto", default ``optim.lr``; ``batching``: keys for its
        batches alone). Returns ``{"adapter", "adapters", "global_step", "note"}``."""
        return self._call("POST", "/api/v1/admin/adapters", json_body=adapter_body(name, lr, batching), admin=True,
                          timeout=LIFECYCLE_TIMEOUT_S)

    def checkpoint(self) -> dict[str, Any]:
        return self._call("POST", "/api/v1/admin/checkpoint", admin=True, timeout=LIFECYCLE_TIMEOUT_S)

    def status(self) -> dict[str, Any]:
        """``state``, ``global_step``, ``episodes``, ``pool``, ``clients``... (admin token needed)."""
        return self._call("GET", "/api/v1/status", admin=True)

    def health(self) -> dict[str, Any]:
        """``state`` and ``global_step``; needs no token."""
        return self._call("GET", "/api/v1/health")

    def wait_for_state(self, state: str | Iterable[str], timeout: float = 300.0, poll: float = 0.2) -> dict[str, Any]:
        """Poll until the server is in ``state`` (or one of several); returns the last answer.

        Each state seen on the way is logged once (INFO, ``swarmkit.client``).

        :raises SwarmError: the boot failed (the server fell back to OFFLINE with an error).
        :raises TimeoutError: still not there after ``timeout`` seconds.
        """
        wait = StateWait(state, timeout)
        while True:
            remaining = wait.remaining()
            try:
                last = self.status() if self.token else self.health()
            except ServerUnavailable:
                if remaining <= 0:
                    raise
                last = {"state": "UNREACHABLE"}
            if wait.done(last, remaining):
                return last
            self._pause(min(poll, max(0.0, remaining)), "GET", "/api/v1/status")

    def ready(self, flag: bool = True) -> dict[str, Any]:
        """Vote for (or against) training now (batching policies C4/C5), as this client's id."""
        return self._kept_key(self._call("POST", "/api/v1/clients/ready", json_body={"ready": bool(flag)},
                                              key=self._sampling_key(), extra_headers=self._key_header()))

    def heartbeat(self) -> dict[str, Any]:
        """Tell the server this client is alive (any request does too)."""
        return self._kept_key(self._call("POST", "/api/v1/clients/heartbeat", key=self._sampling_key(),
                                              extra_headers=self._key_header()))

    # ------------------------------------------------------------------ episodes
    def register(self, task_id: str, eval: bool = False, *, timeout_s: float | None = None,
                 roles: Sequence[str] | None = None, meta: Mapping[str, Any] | None = None,
                 adapter: str | None = None, retry_for: float | None = None) -> Episode:
        """Register an episode (retries while the server is busy); prefer :meth:`episode`. ``adapter``: the
        LoRA adapter it samples with and trains, on a server with ``model.adapters``. ``retry_for``: how
        long to retry while the server is busy or unreachable (default the client's ``retry_for``; 0: raise
        :class:`ServerUnavailable` at once)."""
        body = register_body(task_id, eval, timeout_s, roles, meta, adapter)
        return self._opened(Episode(self, self._call("POST", "/api/v1/episodes", json_body=body,
                                                     key=self._sampling_key(), retry_for=retry_for,
                                                     extra_headers=self._key_header(create=True))))

    @contextmanager
    def episode(self, task_id: str, eval: bool = False, *, timeout_s: float | None = None,
                roles: Sequence[str] | None = None, meta: Mapping[str, Any] | None = None,
                adapter: str | None = None) -> Iterator[Episode]:
        """Register an episode for the ``with`` block.

        An exception inside the block aborts the episode (and propagates); a
        block that ends without ``report``/``abort`` aborts it too.
        """
        ep = self.register(task_id, eval, timeout_s=timeout_s, roles=roles, meta=meta, adapter=adapter)
        try:
            yield ep
        except BaseException as exc:
            if not ep.ended:
                self._abort_quietly(ep, abort_reason(exc))
            raise
        if not ep.ended:
            self._abort_quietly(ep, abort_reason(None))

    def _abort_quietly(self, ep: Episode, reason: str) -> None:
        try:
            ep.abort(reason)
        except SwarmError:
            pass

    def _end(self, ep: Episode, tail: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._call("POST", ep._path(tail), json_body=body, key=ep.api_key)
        except SwarmAPIError as exc:
            if is_lost_report_ack(exc, tail, ep):
                result = already_reported(ep, ep.status())
                if result is not None:
                    return result
            raise
