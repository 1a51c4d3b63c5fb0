"""The asyncio client: :class:`AsyncSwarmClient` and its :class:`AsyncEpisode` (``httpx.AsyncClient``).

The same API as :class:`swarmkit.client.SwarmClient`, awaited::

    async with AsyncSwarmClient("http://127.0.0.1:8000") as client:
        async with client.episode(task_id="t1") as ep:
            llm = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key)
            ...
            await ep.report(1.0)

Requests, retries (same schedule, same log lines, same ``on_retry`` events)
and errors come from :mod:`swarmkit.client._common`.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
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

__all__ = ["AsyncEpisode", "AsyncSwarmClient"]


class AsyncEpisode(EpisodeInfo):
    """A registered episode of an :class:`AsyncSwarmClient` (``await ep.report(...)``)."""

    def __init__(self, client: AsyncSwarmClient, info: dict[str, Any]):
        super().__init__(info)
        self._client = client

    async def report(self, reward: float | Mapping[str, float],
                     meta: Mapping[str, Any] | None = None, *, turn_rewards: TurnRewards | None = None,
                     call_rewards: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """End the episode with a reward (a number, or role → number).

        ``turn_rewards``: each call's own reward, in call order (a list; role → list with roles;
        None skips a turn); ``call_rewards``: items naming calls by index, with a ``reward`` or
        the call's per-token ``advantages`` (the expert option). Both need an algorithm with
        per-turn credit on a training server (``algo=turn_grpo``); see docs/client.md.
        """
        self.result = await self._client._end(self, "/report", report_body(reward, meta, turn_rewards, call_rewards))
        return self.result

    async def prepare(self, reward: float | Mapping[str, float], meta: Mapping[str, Any] | None = None, *,
                      primary: EpisodeInfo | None = None, turn_rewards: TurnRewards | None = None,
                      call_rewards: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """First phase of a multi-server end: the server keeps the reward until :meth:`commit`.

        ``primary``: the episode whose commit decides this one (None for the primary
        itself); see :func:`swarmkit.client.swarm_episode`, which makes these calls.
        """
        self.prepared = await self._client._call("POST", self._path("/prepare"),
                                              json_body=prepare_body(reward, meta, primary, turn_rewards, call_rewards), key=self.api_key)
        return self.prepared

    async def commit(self) -> dict[str, Any]:
        """Second phase: the prepared episode goes to the pool (safe to repeat)."""
        self.result = await self._client._call("POST", self._path("/commit"), key=self.api_key)
        return self.result

    async def abort(self, reason: str = "aborted by the client") -> dict[str, Any]:
        """End the episode without a sample (e.g. the environment failed)."""
        self.result = await self._client._end(self, "/abort", {"reason": str(reason)})
        return self.result

    async def demonstrate(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, *, role: str | None = None
                    ) -> dict[str, Any]:
        """Record a demonstrated conversation: its assistant turns train with a supervised
        (NLL) loss, the warm start of an agent that cannot play yet. ``role``: whose turns they
        are in an episode with roles (default: the first role's). Report the episode afterwards
        as usual (the reward is not used for demonstrated turns)."""
        key = self.api_key if role is None else self.key_for(role)
        return await self._client._call("POST", self._path("/demonstration"),
                                     json_body=demonstration_body(messages, tools), key=key)

    async def timelines(self, as_objects: bool = False) -> list[Any]:
        """The recorded timelines as JSON dicts (``swarmkit.timelines.Timeline`` with ``as_objects``)."""
        return timelines_of(await self._client._call("GET", self._path("/timelines"), key=self.api_key), as_objects)

    async def status(self) -> dict[str, Any]:
        """The server's summary of this episode."""
        return await self._client._call("GET", self._path(), key=self.api_key)


class AsyncSwarmClient(HoldsClientId):
    """Talks to one swarm server from asyncio code; the parameters of :class:`~swarmkit.client.SwarmClient`.

    ``async with AsyncSwarmClient(url) as client`` (or ``await client.close()``).
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
        transport: httpx.AsyncBaseTransport | None = None,
        heartbeat_s: float | None = HEARTBEAT_S,
    ):
        self._settings(url, token, client_id, client_token, timeout, retry_for, on_retry, heartbeat_s)
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout, transport=transport,
                                       headers={CLIENT_HEADER: self.client_id})
        #: episodes registered here, until they end or are dropped (the heartbeat runs while one is open)
        self._open: weakref.WeakSet[AsyncEpisode] = weakref.WeakSet()
        self._beat_task: asyncio.Task[None] | None = None
        self._closed = False

    async def _pulse(self) -> None:
        """The heartbeat task: beats while an episode is open, ends when none is (or on close)."""
        assert self.heartbeat_s is not None
        while not self._closed:
            await asyncio.sleep(self.heartbeat_s)
            if self._closed or not any(not ep.ended for ep in list(self._open)):
                break
            try:
                self._kept_key(await self._call("POST", "/api/v1/clients/heartbeat",
                                                json_body=beat_body(self.heartbeat_s), key=self._sampling_key(),
                                                extra_headers=self._key_header(), retry_for=0))
            except Exception:  # noqa: BLE001 - a missed beat only makes the server wait as it did without one
                pass
        self._beat_task = None

    def _opened(self, ep: AsyncEpisode) -> AsyncEpisode:
        if self.heartbeat_s is not None:
            self._open.add(ep)
            if self._beat_task is None and not self._closed:
                self._beat_task = asyncio.get_running_loop().create_task(self._pulse())
        return ep

    # ------------------------------------------------------------------ plumbing
    async def close(self) -> None:
        self._closed = True
        task, self._beat_task = self._beat_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        await self._http.aclose()

    aclose = close

    async def __aenter__(self) -> AsyncSwarmClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(self, method: str, path: str, *, json_body: Any = None, key: str | None = None,
                       admin: bool = False, retry_for: float | None = None,
                       timeout: float | None = None, extra_headers: Mapping[str, str] | None = None
                       ) -> httpx.Response:
        headers = {**auth_headers(self.token if admin else key), **(extra_headers or {})}
        retry = Retry(self.url, method, path, self.retry_for if retry_for is None else retry_for, self.on_retry,
                      notes=self._retry_notes)
        while True:
            try:
                resp = await self._http.request(method, path, json=json_body, headers=headers,
                                         timeout=self._timeout if timeout is None else max(timeout, self._timeout))
            except TRANSIENT_ERRORS as exc:
                await asyncio.sleep(retry.after_error(exc))
                continue
            except httpx.TransportError as exc:  # mid-request: a GET is safe to repeat, a change is not
                if method != "GET":
                    raise transport_error(method, self.url, path, exc) from exc
                await asyncio.sleep(retry.after_error(exc))
                continue
            if resp.status_code != 503:
                return checked(resp)
            await asyncio.sleep(retry.after_busy(resp))

    async def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return json_object(await self._request(method, path, **kwargs))

    def _sampling_key(self) -> str | None:
        """The bearer token of a sampling call (register, vote, heartbeat): the client token, else the admin's."""
        return self.client_token or self.token

    # ------------------------------------------------------------------ controller
    async def configure(self, config: Mapping[str, Any] | str | os.PathLike[str] | Sequence[str]) -> dict[str, Any]:
        """Send a training config: a dict, a YAML file path, or Hydra overrides (a list of strings)."""
        body = configure_body(config)
        return await self._call("POST", "/api/v1/admin/configure", json_body=body, admin=True)

    async def start(self) -> dict[str, Any]:
        """Load the configured model: the server goes BOOTING, then ROLLING."""
        return await self._call("POST", "/api/v1/admin/start", admin=True)

    async def stop(self) -> dict[str, Any]:
        """Abort running episodes and unload the model (OFFLINE)."""
        return await self._call("POST", "/api/v1/admin/stop", admin=True, timeout=LIFECYCLE_TIMEOUT_S)

    async def restart(self) -> dict[str, Any]:
        """Stop, then start with the latest configuration."""
        return await self._call("POST", "/api/v1/admin/restart", admin=True, timeout=LIFECYCLE_TIMEOUT_S)

    async def add_adapter(self, name: str, *, lr: float | str | None = None,
                          batching: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Add LoRA adapter ``name`` to a server started with ``model.adapters``: trained and served from now
        on, without a restart (``lr``: a number or "auto", default ``optim.lr``; ``batching``: keys for its
        batches alone). Returns ``{"adapter", "adapters", "global_step", "note"}``."""
        return await self._call("POST", "/api/v1/admin/adapters", json_body=adapter_body(name, lr, batching), admin=True,
                                timeout=LIFECYCLE_TIMEOUT_S)

    async def checkpoint(self) -> dict[str, Any]:
        return await self._call("POST", "/api/v1/admin/checkpoint", admin=True, timeout=LIFECYCLE_TIMEOUT_S)

    async def status(self) -> dict[str, Any]:
        """``state``, ``global_step``, ``episodes``, ``pool``, ``clients``... (admin token needed)."""
        return await self._call("GET", "/api/v1/status", admin=True)

    async def health(self) -> dict[str, Any]:
        """``state`` and ``global_step``; needs no token."""
        return await self._call("GET", "/api/v1/health")

    async def wait_for_state(self, state: str | Iterable[str], timeout: float = 300.0,
                             poll: float = 0.2) -> dict[str, Any]:
        """Poll until the server is in ``state`` (or one of several); returns the last answer.

        :raises SwarmError: the boot failed (the server fell back to OFFLINE with an error).
        :raises TimeoutError: still not there after ``timeout`` seconds.
        """
        wait = StateWait(state, timeout)
        while True:
            remaining = wait.remaining()
            try:
                last = await (self.status() if self.token else self.health())
            except ServerUnavailable:
                if remaining <= 0:
                    raise
                last = {"state": "UNREACHABLE"}
            if wait.done(last, remaining):
                return last
            await asyncio.sleep(min(poll, max(0.0, remaining)))

    async def ready(self, flag: bool = True) -> dict[str, Any]:
        """Vote for (or against) training now (batching policies C4/C5), as this client's id."""
        return self._kept_key(await self._call("POST", "/api/v1/clients/ready", json_body={"ready": bool(flag)},
                                               key=self._sampling_key(), extra_headers=self._key_header()))

    async def heartbeat(self) -> dict[str, Any]:
        """Tell the server this client is alive (any request does too)."""
        return self._kept_key(await self._call("POST", "/api/v1/clients/heartbeat", key=self._sampling_key(),
                                               extra_headers=self._key_header()))

    # ------------------------------------------------------------------ episodes
    async def register(self, task_id: str, eval: bool = False, *, timeout_s: float | None = None,
                       roles: Sequence[str] | None = None, meta: Mapping[str, Any] | None = None,
                       adapter: str | None = None, retry_for: float | None = None) -> AsyncEpisode:
        """Register an episode (retries while the server is busy); prefer :meth:`episode`. ``adapter``: the
        LoRA adapter it samples with and trains, on a server with ``model.adapters``. ``retry_for``: how
        long to retry while the server is busy or unreachable (default the client's ``retry_for``; 0: raise
        :class:`ServerUnavailable` at once)."""
        body = register_body(task_id, eval, timeout_s, roles, meta, adapter)
        return self._opened(AsyncEpisode(self, await self._call("POST", "/api/v1/episodes", json_body=body,
                                                                key=self._sampling_key(), retry_for=retry_for,
                                                                extra_headers=self._key_header(create=True))))

    @asynccontextmanager
    async def episode(self, task_id: str, eval: bool = False, *, timeout_s: float | None = None,
                      roles: Sequence[str] | None = None, meta: Mapping[str, Any] | None = None,
                      adapter: str | None = None) -> AsyncIterator[AsyncEpisode]:
        """Register an episode for the ``async with`` block.

        An exception inside the block (a cancellation too) aborts the episode
        and propagates; a block that ends without ``report``/``abort`` aborts it too.
        """
        ep = await self.register(task_id, eval, timeout_s=timeout_s, roles=roles, meta=meta, adapter=adapter)
        try:
            yield ep
        except BaseException as exc:
            if not ep.ended:
                await self._abort_quietly(ep, abort_reason(exc))
            raise
        if not ep.ended:
            await self._abort_quietly(ep, abort_reason(None))

    async def _abort_quietly(self, ep: AsyncEpisode, reason: str) -> None:
        try:
            await ep.abort(reason)
        except SwarmError:
            pass

    async def _end(self, ep: AsyncEpisode, tail: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self._call("POST", ep._path(tail), json_body=body, key=ep.api_key)
        except SwarmAPIError as exc:
            if is_lost_report_ack(exc, tail, ep):
                result = already_reported(ep, await ep.status())
                if result is not None:
                    return result
            raise
