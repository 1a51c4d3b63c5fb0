"""The swarm client SDK: controller calls and the episode context manager.

Needs only ``httpx`` and the standard library (it never imports torch,
transformers or the server side of swarmkit), so it runs on any CPU box::

    from swarmkit.client import SwarmClient

    client = SwarmClient("http://127.0.0.1:8000", token=ADMIN_TOKEN)
    client.configure(["model.path=builtin:tiny", "backend=hf"])
    client.start()
    client.wait_for_state("ROLLING", timeout=120)

    with client.episode(task_id="t1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key)
        ...  # run any agent
        ep.report(1.0)

Requests are retried with exponential backoff on connection errors and on
"server busy" answers (503 with ``Retry-After``, e.g. while the server trains
in ``ROLLING_POST`` / ``WEIGHT_SYNCING``); after ``retry_for`` seconds a
:class:`ServerUnavailable` says what the server last answered.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

__all__ = ["Episode", "ServerUnavailable", "SwarmAPIError", "SwarmClient", "SwarmError"]

CLIENT_HEADER = "X-Swarm-Client"


class SwarmError(Exception):
    """Base class of the client's errors."""


class SwarmAPIError(SwarmError):
    """The server answered with an error (4xx/5xx other than a retried 503).

    :ivar status: HTTP status. :ivar code: the server's error code
    (``episode_already_ended``, ``invalid_reward``...). :ivar body: the JSON body.
    """

    def __init__(self, status: int, message: str, code: str | None = None, body: Any = None):
        super().__init__(f"HTTP {status} ({code}): {message}" if code else f"HTTP {status}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.body = body


class ServerUnavailable(SwarmError):
    """The server stayed unreachable or busy for longer than the retry budget."""


def _error_of(resp: httpx.Response) -> SwarmAPIError:
    try:
        body = resp.json()
        err = body.get("error", {}) if isinstance(body, dict) else {}
        message = err.get("message") or resp.text
        code = err.get("code")
    except ValueError:
        body, message, code = resp.text, resp.text or resp.reason_phrase, None
    return SwarmAPIError(resp.status_code, message, code, body)


def _retry_after(resp: httpx.Response, default: float) -> float:
    value = resp.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.05, float(value))
    except ValueError:
        return default


class Episode:
    """A registered episode: where to send the agent, and how to end it.

    ``base_url`` / ``api_key`` go to any OpenAI-compatible agent. With roles,
    ``keys[role]`` is the key of each role (``key_for(role)``); ``api_key`` is
    the first role's.
    """

    def __init__(self, client: SwarmClient, info: dict[str, Any]):
        self._client = client
        self.info = info
        self.episode_id: str = info["episode_id"]
        self.base_url: str = info["base_url"]
        self.api_key: str = info["api_key"]
        self.keys: dict[str, str] = dict(info.get("keys") or {})
        self.roles: list[str] = list(info.get("roles") or [])
        self.task_id: str = info.get("task_id", "")
        self.eval: bool = bool(info.get("eval", False))
        self.deadline: float = float(info.get("deadline", 0.0))
        self.result: dict[str, Any] | None = None

    def __repr__(self) -> str:
        state = "open" if self.result is None else self.result.get("status")
        return f"Episode({self.episode_id!r}, task_id={self.task_id!r}, {state})"

    @property
    def ended(self) -> bool:
        return self.result is not None

    def key_for(self, role: str) -> str:
        """The API key of one role (episodes registered with ``roles``)."""
        try:
            return self.keys[role]
        except KeyError:
            raise KeyError(f"episode has no role {role!r}; roles: {', '.join(self.roles) or '(none)'}") from None

    def _path(self, tail: str = "") -> str:
        return f"/api/v1/episodes/{self.episode_id}{tail}"

    def report(self, reward: float | Mapping[str, float], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """End the episode with a reward (a number, or role → number)."""
        body: dict[str, Any] = {"reward": dict(reward) if isinstance(reward, Mapping) else reward}
        if meta:
            body["meta"] = dict(meta)
        self.result = self._client._end(self, "/report", body)
        return self.result

    def abort(self, reason: str = "aborted by the client") -> dict[str, Any]:
        """End the episode without a sample (e.g. the environment failed)."""
        self.result = self._client._end(self, "/abort", {"reason": str(reason)})
        return self.result

    def timelines(self, as_objects: bool = False) -> list[Any]:
        """The recorded timelines as JSON dicts (``swarmkit.timelines.Timeline`` with ``as_objects``)."""
        data = self._client._request("GET", self._path("/timelines"), key=self.api_key).json()
        tls = data["timelines"]
        if as_objects:
            from swarmkit.timelines import Timeline  # needs the full swarmkit install

            return [Timeline.from_dict(t) for t in tls]
        return tls

    def status(self) -> dict[str, Any]:
        """The server's summary of this episode."""
        return self._client._request("GET", self._path(), key=self.api_key).json()


class SwarmClient:
    """Talks to one swarm server.

    :param url: the server's address, e.g. ``http://127.0.0.1:8000``.
    :param token: the admin token (needed for controller calls: configure,
        start, stop, status...); default ``$SWARMKIT_ADMIN_TOKEN``.
    :param client_id: stable id sent with every request so the server can
        count this client as active (batching C4/C5); default: random.
    :param timeout: seconds per HTTP request.
    :param retry_for: seconds to keep retrying connection errors and 503s.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        client_id: str | None = None,
        timeout: float = 60.0,
        retry_for: float = 120.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("SWARMKIT_ADMIN_TOKEN")
        self.client_id = client_id or "client-" + uuid.uuid4().hex[:16]
        self.retry_for = float(retry_for)
        self._http = httpx.Client(base_url=self.url, timeout=timeout, transport=transport,
                                  headers={CLIENT_HEADER: self.client_id})

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SwarmClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        key: str | None = None,
        admin: bool = False,
        retry_for: float | None = None,
    ) -> httpx.Response:
        headers = {}
        token = self.token if admin else key
        if token:
            headers["Authorization"] = f"Bearer {token}"
        budget = self.retry_for if retry_for is None else retry_for
        start = time.monotonic()
        delay = 0.1
        last = ""
        attempt = 0
        while True:
            attempt += 1
            try:
                resp = self._http.request(method, path, json=json_body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                wait = delay
            else:
                if resp.status_code == 503:
                    err = _error_of(resp)
                    last = f"503 {err.code}: {err.message}"
                    wait = _retry_after(resp, delay)
                elif resp.status_code >= 400:
                    raise _error_of(resp)
                else:
                    return resp
            elapsed = time.monotonic() - start
            if elapsed + min(wait, 0.05) >= budget:
                raise ServerUnavailable(
                    f"{method} {self.url}{path}: server unreachable or busy for {elapsed:.1f} s "
                    f"({attempt} attempts); last: {last}"
                )
            time.sleep(min(wait * (0.8 + 0.4 * random.random()), max(0.0, budget - elapsed), 10.0))
            delay = min(delay * 2, 2.0)

    # ------------------------------------------------------------------ controller
    def configure(self, config: Mapping[str, Any] | str | os.PathLike | Sequence[str]) -> dict[str, Any]:
        """Send a training config: a dict, a YAML file path, or Hydra overrides (a list of strings)."""
        if isinstance(config, (str, os.PathLike)):
            path = os.fspath(config)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"config file {path!r} not found (pass a dict, a YAML file path or a list "
                                        "of overrides)")
            with open(path, encoding="utf-8") as f:
                body: dict[str, Any] = {"yaml": f.read()}
        elif isinstance(config, Mapping):
            if type(config).__name__ == "DictConfig":  # OmegaConf, if the caller has it
                from omegaconf import OmegaConf

                config = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
            body = {"config": json.loads(json.dumps(config))}
        elif isinstance(config, Sequence) and all(isinstance(o, str) for o in config):
            body = {"overrides": list(config)}
        else:
            raise TypeError("configure() takes a dict, a YAML file path or a list of override strings")
        return self._request("POST", "/api/v1/admin/configure", json_body=body, admin=True).json()

    def start(self) -> dict[str, Any]:
        """Load the configured model: the server goes BOOTING, then ROLLING."""
        return self._request("POST", "/api/v1/admin/start", admin=True).json()

    def stop(self) -> dict[str, Any]:
        """Abort running episodes and unload the model (OFFLINE)."""
        return self._request("POST", "/api/v1/admin/stop", admin=True).json()

    def restart(self) -> dict[str, Any]:
        """Stop, then start with the latest configuration."""
        return self._request("POST", "/api/v1/admin/restart", admin=True).json()

    def checkpoint(self) -> dict[str, Any]:
        return self._request("POST", "/api/v1/admin/checkpoint", admin=True).json()

    def status(self) -> dict[str, Any]:
        """``state``, ``global_step``, ``episodes``, ``pool``, ``clients``... (admin token needed)."""
        return self._request("GET", "/api/v1/status", admin=True).json()

    def health(self) -> dict[str, Any]:
        """``state`` and ``global_step``; needs no token."""
        return self._request("GET", "/api/v1/health").json()

    def wait_for_state(self, state: str | Iterable[str], timeout: float = 300.0, poll: float = 0.2) -> dict[str, Any]:
        """Poll until the server is in ``state`` (or one of several); returns the last answer.

        :raises SwarmError: the boot failed (the server fell back to OFFLINE with an error).
        :raises TimeoutError: still not there after ``timeout`` seconds.
        """
        wanted = {state} if isinstance(state, str) else set(state)
        end = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while True:
            remaining = end - time.monotonic()
            try:
                last = self.status() if self.token else self.health()
            except ServerUnavailable:
                if remaining <= 0:
                    raise
                last = {"state": "UNREACHABLE"}
            if last.get("state") in wanted:
                return last
            if last.get("state") == "OFFLINE" and last.get("last_error") and "OFFLINE" not in wanted:
                raise SwarmError(f"server fell back to OFFLINE: {last['last_error']}")
            if remaining <= 0:
                raise TimeoutError(f"server still {last.get('state')} after {timeout:g} s (wanted "
                                   f"{', '.join(sorted(wanted))})")
            time.sleep(min(poll, max(0.0, remaining)))

    def ready(self, flag: bool = True) -> dict[str, Any]:
        """Vote for (or against) training now (batching policies C4/C5)."""
        return self._request("POST", "/api/v1/clients/ready", json_body={"ready": bool(flag)}).json()

    def heartbeat(self) -> dict[str, Any]:
        """Tell the server this client is alive (any request does too)."""
        return self._request("POST", "/api/v1/clients/heartbeat").json()

    # ------------------------------------------------------------------ episodes
    def register(
        self,
        task_id: str,
        eval: bool = False,
        *,
        timeout_s: float | None = None,
        roles: Sequence[str] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Episode:
        """Register an episode (retries while the server is busy); prefer :meth:`episode`."""
        body: dict[str, Any] = {"task_id": task_id, "eval": bool(eval)}
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if roles:
            body["roles"] = list(roles)
        if meta:
            body["meta"] = dict(meta)
        return Episode(self, self._request("POST", "/api/v1/episodes", json_body=body).json())

    @contextmanager
    def episode(
        self,
        task_id: str,
        eval: bool = False,
        *,
        timeout_s: float | None = None,
        roles: Sequence[str] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Iterator[Episode]:
        """Register an episode for the ``with`` block.

        An exception inside the block aborts the episode (and propagates); a
        block that ends without ``report``/``abort`` aborts it too.
        """
        ep = self.register(task_id, eval, timeout_s=timeout_s, roles=roles, meta=meta)
        try:
            yield ep
        except BaseException as exc:
            if not ep.ended:
                self._abort_quietly(ep, f"exception in the client: {type(exc).__name__}: {exc}")
            raise
        if not ep.ended:
            self._abort_quietly(ep, "the episode block ended without a reward")

    def _abort_quietly(self, ep: Episode, reason: str) -> None:
        try:
            ep.abort(reason[:1000])
        except SwarmError:
            pass

    def _end(self, ep: Episode, tail: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self._request("POST", ep._path(tail), json_body=body, key=ep.api_key).json()
        except SwarmAPIError as exc:
            # a retried report whose first attempt did arrive: the server already has it
            if exc.code == "episode_already_ended" and tail == "/report" and ep.result is None:
                info = ep.status()
                if info.get("status") == "finished" and info.get("reward") is not None:
                    return {"episode_id": ep.episode_id, "status": "finished", "reward": info["reward"],
                            "rewards": info.get("rewards"), "accepted": info.get("accepted"),
                            "note": "already reported"}
            raise
