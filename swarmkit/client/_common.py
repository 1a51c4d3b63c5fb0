"""What the sync and the async client share: errors, request bodies, retries, episode info.

Everything here is pure (no I/O but reading a config file and keeping a client key): the two clients
(:mod:`swarmkit.client.sync`, :mod:`swarmkit.client.aio`) only add the HTTP
call and the sleep, so both retry, log and fail the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from swarmkit.runfiles import write_text

__all__ = ["CLIENT_HEADER", "RetryEvent", "ServerUnavailable", "SwarmAPIError", "SwarmError", "TransportError"]

LIFECYCLE_TIMEOUT_S = 300.0
"""Read timeout of stop, restart and checkpoint (they free or save an engine, which can take
minutes: a training group gets 60 s to exit before it is killed); other calls use the client's."""

CLIENT_HEADER = "X-Swarm-Client"
#: the key that holds a client id on a server (answered to the first vote or heartbeat)
CLIENT_KEY_HEADER = "X-Swarm-Client-Key"
#: seconds between the heartbeats a client sends while it has an episode open (the server counts a client
#: that missed three as gone: its episodes do not hold a training step)
HEARTBEAT_S = 2.0


def beat_body(interval_s: float) -> dict[str, float]:
    """The body of a periodic heartbeat: the interval the server may expect the next one in."""
    return {"interval_s": float(interval_s)}

#: the logger of retries and waits: every retry at DEBUG, and at INFO the first of its kind and then at
#: most one line per ``RETRY_NOTE_S`` (with how many retries it stands for), so
#: ``logging.basicConfig(level=logging.INFO)`` shows what a client waits for without a line per retry
log = logging.getLogger("swarmkit.client")

#: at most one INFO line per this many seconds about retries of one kind (a server state, or unreachable)
RETRY_NOTE_S = 60.0
#: what a client should know about a state it keeps retrying (said with the INFO line)
RETRY_HINTS = {
    "OFFLINE": ("the server is up but has no model: a controller must configure and start it "
                "(SwarmClient(url, token=ADMIN_TOKEN).configure([...overrides]) then .start(); "
                "python -m swarmkit skills show configure-server), or run the main job "
                "(python -m swarmkit), which serves and trains in one process"),
    "BOOTING": "the server is loading its model",
    "ROLLING_POST": "the server is training a step (normal)",
    "WEIGHT_SYNCING": "the server is loading new weights after a step (normal)",
    "unreachable": "is the server running at this URL?",
}

#: connection failures worth retrying (the request never reached a handler)
TRANSIENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError)

#: first backoff step and its cap (seconds); the step doubles after each failed attempt
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 2.0
#: no single sleep is longer than this, whatever ``Retry-After`` says
MAX_SLEEP_S = 10.0

_STATES = ("ROLLING_POST", "WEIGHT_SYNCING", "BOOTING", "OFFLINE", "ROLLING")
_STATE_RE = re.compile(r"\b(" + "|".join(_STATES) + r")\b")
_STATE_OF_CODE = {"server_booting": "BOOTING", "server_offline": "OFFLINE"}


# ---------------------------------------------------------------------- errors
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


class TransportError(SwarmError):
    """The connection failed mid-request (read error, timeout, closed connection) on a call that is
    not retried because it changes state: it may or may not have been done. ``__cause__`` is the
    ``httpx`` error."""


def transport_error(method: str, url: str, path: str, exc: Exception) -> TransportError:
    """The :class:`TransportError` of a non-retried call (GETs are retried instead)."""
    return TransportError(f"{method} {url}{path}: the connection failed mid-request ({type(exc).__name__}: {exc}); "
                          "the server may or may not have done it (check the episode or status before repeating)")


def error_of(resp: httpx.Response) -> SwarmAPIError:
    """The :class:`SwarmAPIError` of an error answer (OpenAI-shaped JSON or plain text)."""
    try:
        body = resp.json()
        err = body.get("error", {}) if isinstance(body, dict) else {}
        message = err.get("message") or resp.text
        code = err.get("code")
    except ValueError:
        body, message, code = resp.text, resp.text or resp.reason_phrase, None
    return SwarmAPIError(resp.status_code, message, code, body)


def checked(resp: httpx.Response) -> httpx.Response:
    """The response itself, or its :class:`SwarmAPIError` raised."""
    if resp.status_code >= 400:
        raise error_of(resp)
    return resp


def json_object(resp: httpx.Response) -> dict[str, Any]:
    """The JSON object of a successful answer."""
    data = resp.json()
    if not isinstance(data, dict):
        raise SwarmAPIError(resp.status_code, f"expected a JSON object, got {type(data).__name__}", None, data)
    return data


def retry_after(resp: httpx.Response, default: float) -> float:
    """Seconds the server asks to wait (``X-Swarm-Retry-After-Ms``, else ``Retry-After``), else ``default``."""
    ms = resp.headers.get("x-swarm-retry-after-ms")
    if ms is not None:
        try:
            return max(0.05, float(ms) / 1000.0)
        except ValueError:
            pass
    value = resp.headers.get("retry-after")
    if value is None:
        return default
    try:
        return max(0.05, float(value))
    except ValueError:
        return default


def state_of(err: SwarmAPIError) -> str | None:
    """The server state a 503 answer names (``ROLLING_POST``, ``BOOTING``...), if any."""
    if err.code in _STATE_OF_CODE:
        return _STATE_OF_CODE[err.code]
    found = _STATE_RE.search(err.message or "")
    return found.group(1) if found else None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


# ---------------------------------------------------------------------- the key that holds a client id
def client_key_file(url: str, client_id: str) -> Path:
    """Where the key holding ``client_id`` on the server at ``url`` is kept, so a restarted client
    votes under its id again: ``$SWARMKIT_CLIENT_KEYS`` (default ``~/.cache/swarmkit/client-keys``),
    one 0600 file per (server, id)."""
    root = os.environ.get("SWARMKIT_CLIENT_KEYS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "swarmkit", "client-keys")
    digest = hashlib.sha256(f"{url.rstrip('/')}\n{client_id}".encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return Path(root) / digest


def load_client_key(url: str, client_id: str) -> str | None:
    try:
        return client_key_file(url, client_id).read_text().strip() or None
    except OSError:
        return None


def save_client_key(url: str, client_id: str, key: str) -> None:
    """Keep the key (best effort: a client that cannot write its cache still votes until it restarts)."""
    path = client_key_file(url, client_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_text(path, key, mode=0o600)
    except OSError as exc:
        log.warning("could not keep the client key in %s (%s); a restarted client cannot vote as %r until "
                    "the server forgets it", path, exc, client_id)


class HoldsClientId:
    """What both clients do to speak for their ``client_id`` in votes and heartbeats: show the key
    that holds the id on the server (the one answered to this client, else one kept on disk by an
    earlier run of the same client), and keep a key the server answers."""

    url: str
    client_id: str
    _client_key: str | None = None
    #: the id was given by the caller (a restarted client comes back under it: its key is kept on disk)
    _named: bool = False

    def _settings(self, url: str, token: str | None, client_id: str | None, client_token: str | None,
                  timeout: float, retry_for: float, on_retry: Any, heartbeat_s: float | None) -> None:
        """What both clients' constructors set (their parameters are documented on
        :class:`~swarmkit.client.SwarmClient`); the environment gives the tokens left out."""
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("SWARMKIT_ADMIN_TOKEN")
        self.client_id = client_id or "client-" + uuid.uuid4().hex[:16]
        self._named = client_id is not None
        self.client_token = client_token if client_token is not None else os.environ.get("SWARMKIT_CLIENT_TOKEN")
        self._client_key = None
        #: one key per client: its threads' first registrations must not each make their own
        self._key_lock = threading.Lock()
        self.retry_for = float(retry_for)
        self.on_retry = on_retry
        self._retry_notes = RetryNotes()
        self._timeout = float(timeout)
        self.heartbeat_s = heartbeat_s

    def _key_header(self, *, create: bool = False) -> dict[str, str]:
        """The key header; with ``create``, a fresh key when this client has none yet (registrations
        show it, so the server binds the id to this client at its first contact). Thread-safe: two
        threads' first registrations show the same key (each making its own, the server bound one and
        the client kept the other, and every vote of the client got 403)."""
        with self._key_lock:
            if self._client_key is None:
                self._client_key = load_client_key(self.url, self.client_id) if self._named else None
            if self._client_key is None and create:
                self._client_key = secrets.token_urlsafe(24)
                if self._named:
                    save_client_key(self.url, self.client_id, self._client_key)
            return {CLIENT_KEY_HEADER: self._client_key} if self._client_key else {}

    def _kept_key(self, answer: dict[str, Any]) -> dict[str, Any]:
        key = answer.get("client_key")
        if isinstance(key, str) and key:
            with self._key_lock:
                if key != self._client_key:
                    self._client_key = key
                    if self._named:
                        save_client_key(self.url, self.client_id, key)
        return answer


# ---------------------------------------------------------------------- retries
@dataclass(frozen=True)
class RetryEvent:
    """One retry, as the ``on_retry`` callback of a client receives it.

    :ivar method: ``GET``/``POST``. :ivar path: e.g. ``/api/v1/episodes``.
    :ivar attempt: the number of the attempt about to be made (2 = the first retry).
    :ivar wait_s: seconds the client sleeps now before the next attempt.
    :ivar waited_s: seconds since the first attempt.
    :ivar reason: what the server answered (``503 server_busy: ...``) or the
        connection error (``ConnectError: ...``).
    :ivar status: the HTTP status (503), or ``None`` for a connection error.
    :ivar state: the server state the answer names (``ROLLING_POST``...), if any.
    """

    method: str
    path: str
    attempt: int
    wait_s: float
    waited_s: float
    reason: str
    status: int | None = None
    state: str | None = None

    def describe(self) -> str:
        """The log line: ``server in ROLLING_POST (503 server_busy), retrying POST ... in 1.0 s (...)``."""
        if self.status is None:
            what = f"server unreachable ({self.reason})"
        else:
            code = self.reason.split(":", 1)[0]
            what = f"server in {self.state} ({code})" if self.state else f"server busy ({code})"
        return (f"{what}, retrying {self.method} {self.path} in {self.wait_s:.1f} s "
                f"(attempt {self.attempt}, {self.waited_s:.1f} s waited)")


RetryCallback = Callable[[RetryEvent], object]


class RetryNotes:
    """Which retries a client logs at INFO: the first of each kind (a server state, or unreachable), then
    one per :data:`RETRY_NOTE_S` saying how many it stands for; one per client, shared by its threads."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, every_s: float | None = None):
        self.clock = clock
        self.every_s = every_s
        self._lock = threading.Lock()
        self._kinds: dict[str, tuple[float, int]] = {}  # kind -> (when its last INFO line was, retries since)

    def log(self, event: RetryEvent) -> None:
        kind = event.state or ("unreachable" if event.status is None else "busy")
        now = self.clock()
        every = RETRY_NOTE_S if self.every_s is None else self.every_s
        with self._lock:
            last, since = self._kinds.get(kind, (-math.inf, 0))
            if now - last < every:
                self._kinds[kind] = (last, since + 1)
                log.debug(event.describe())
                return
            self._kinds[kind] = (now, 0)
        hint = RETRY_HINTS.get(kind)
        more = f"; {since} more such retries in the last {now - last:.0f} s" if since and last > -math.inf else ""
        quiet = f"; retries are logged at DEBUG, this line at most every {every:.0f} s"
        log.info("%s%s%s%s", event.describe(), f" - {hint}" if hint else "", more, quiet)


class Retry:
    """The retry schedule of one request: exponential backoff with jitter, ``Retry-After`` first.

    The client calls :meth:`after_error` or :meth:`after_busy` after a failed
    attempt and sleeps the seconds it returns; past the budget they raise
    :class:`ServerUnavailable` naming the last answer. Each retry is logged
    (``swarmkit.client``: DEBUG, and INFO as ``notes`` allow: :class:`RetryNotes`) and passed to ``on_retry``.
    """

    def __init__(self, url: str, method: str, path: str, budget: float,
                 on_retry: RetryCallback | None = None, *, clock: Callable[[], float] = time.monotonic,
                 jitter: Callable[[], float] = random.random, notes: RetryNotes | None = None):
        self.url, self.method, self.path, self.budget = url, method, path, budget
        self.on_retry = on_retry
        self.notes = notes if notes is not None else RetryNotes(clock=clock)
        self.clock, self.jitter = clock, jitter
        self.start = clock()
        self.delay = FIRST_DELAY_S
        self.attempt = 0  # failed attempts so far

    def after_error(self, exc: Exception) -> float:
        return self._next(exc.__class__.__name__ + f": {exc}", self.delay, None, None)

    def after_busy(self, resp: httpx.Response) -> float:
        err = error_of(resp)
        reason = f"{resp.status_code} {err.code}: {err.message}" if err.code else f"{resp.status_code}: {err.message}"
        return self._next(reason, retry_after(resp, self.delay), resp.status_code, state_of(err))

    def _next(self, reason: str, wait: float, status: int | None, state: str | None) -> float:
        self.attempt += 1
        elapsed = self.clock() - self.start
        if elapsed + min(wait, 0.05) >= self.budget:
            raise ServerUnavailable(
                f"{self.method} {self.url}{self.path}: server unreachable or busy for {elapsed:.1f} s "
                f"({self.attempt} attempts); last: {reason}"
            )
        sleep = min(wait * (0.8 + 0.4 * self.jitter()), max(0.0, self.budget - elapsed), MAX_SLEEP_S)
        self.delay = min(self.delay * 2, MAX_DELAY_S)
        event = RetryEvent(self.method, self.path, self.attempt + 1, sleep, elapsed, reason, status, state)
        self.notes.log(event)
        if self.on_retry is not None:
            self.on_retry(event)
        return sleep


class StateWait:
    """The decisions of ``wait_for_state``: done, failed, timed out, or poll again (logged on change)."""

    def __init__(self, state: str | Iterable[str], timeout: float, *, clock: Callable[[], float] = time.monotonic):
        self.wanted = {state} if isinstance(state, str) else set(state)
        self.timeout = timeout
        self.clock = clock
        self.start = clock()
        self.end = self.start + timeout
        self.seen: str | None = None

    def remaining(self) -> float:
        return self.end - self.clock()

    def done(self, last: Mapping[str, Any], remaining: float) -> bool:
        """Whether ``last`` is a wanted state; raises on a failed boot or past the timeout."""
        state = last.get("state")
        if state in self.wanted:
            return True
        if state == "OFFLINE" and last.get("last_error") and "OFFLINE" not in self.wanted:
            raise SwarmError(f"server fell back to OFFLINE: {last['last_error']}")
        if remaining <= 0:
            raise TimeoutError(f"server still {state} after {self.timeout:g} s (wanted "
                               f"{', '.join(sorted(self.wanted))})")
        if state != self.seen:
            self.seen = state
            log.info("waiting for the server to be %s: it is %s (%.1f s waited)", " or ".join(sorted(self.wanted)),
                     state, self.clock() - self.start)
        return False


# ---------------------------------------------------------------------- request bodies
def configure_body(config: Mapping[str, Any] | str | os.PathLike[str] | Sequence[str]) -> dict[str, Any]:
    """The body of ``configure``: a dict, a YAML file path, or Hydra overrides (a list of strings)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file {path!r} not found (pass a dict, a YAML file path or a list "
                                    "of overrides)")
        with open(path, encoding="utf-8") as f:
            return {"yaml": f.read()}
    if isinstance(config, Mapping):
        if type(config).__name__ == "DictConfig":  # OmegaConf, if the caller has it
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
        return {"config": json.loads(json.dumps(config))}
    if isinstance(config, Sequence) and all(isinstance(o, str) for o in config):
        return {"overrides": list(config)}
    raise TypeError("configure() takes a dict, a YAML file path or a list of override strings")


def register_body(task_id: str, eval: bool, timeout_s: float | None, roles: Sequence[str] | None,
                  meta: Mapping[str, Any] | None, adapter: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"task_id": task_id, "eval": bool(eval)}
    if adapter is not None:
        body["adapter"] = adapter
    if timeout_s is not None:
        body["timeout_s"] = timeout_s
    if roles:
        body["roles"] = list(roles)
    if meta:
        body["meta"] = dict(meta)
    return body


#: per-turn rewards: a list (the turns of an episode without roles) or role -> list; None skips a turn
TurnRewards = Sequence[float | None] | Mapping[str, Sequence[float | None]]


def call_rewards_items(turn_rewards: TurnRewards | None,
                       call_rewards: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """The report's ``call_rewards``: ``turn_rewards`` as ``{"turn": k, "reward": r}`` items
    (``{"role": ..., ...}`` for a role -> list mapping; ``None`` entries skipped), then the
    ``call_rewards`` items as given (``{"call": i, "reward": r}``, ``{"call": i, "advantages": [...]}``)."""
    items: list[dict[str, Any]] = []
    if turn_rewards is not None:
        per_role = turn_rewards.items() if isinstance(turn_rewards, Mapping) else [(None, turn_rewards)]
        for role, rewards in per_role:
            if isinstance(rewards, str | bytes) or not isinstance(rewards, Sequence):
                raise TypeError(f"turn_rewards must be a list of numbers (or role -> list), got {rewards!r}")
            for k, r in enumerate(rewards):
                if r is not None:
                    items.append({"turn": k, "reward": r} if role is None else {"role": role, "turn": k, "reward": r})
    items.extend(dict(item) for item in call_rewards or ())
    return items


def report_body(reward: float | Mapping[str, float], meta: Mapping[str, Any] | None,
                turn_rewards: TurnRewards | None = None,
                call_rewards: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"reward": dict(reward) if isinstance(reward, Mapping) else reward}
    if meta:
        body["meta"] = dict(meta)
    items = call_rewards_items(turn_rewards, call_rewards)
    if items:
        body["call_rewards"] = items
    return body


def prepare_body(reward: float | Mapping[str, float], meta: Mapping[str, Any] | None,
                 primary: EpisodeInfo | None, turn_rewards: TurnRewards | None = None,
                 call_rewards: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The body of ``POST /episodes/{id}/prepare``: the reward, and where the primary episode is."""
    body = report_body(reward, meta, turn_rewards, call_rewards)
    if primary is not None:
        body["primary"] = {"url": primary.server_url, "episode_id": primary.episode_id, "api_key": primary.api_key}
    return body


# ---------------------------------------------------------------------- episodes
class EpisodeInfo:
    """A registered episode's data: where to send the agent (``base_url``, ``api_key``).

    ``base_url`` (ending in ``/v1``) is what the ``openai`` SDK and most frameworks take;
    ``anthropic_base_url`` (the server's root: the SDK adds ``/v1/messages``) is the
    ``anthropic`` SDK's.

    With roles, ``keys[role]`` is the key of each role (``key_for(role)``);
    ``api_key`` is the first role's.
    """

    def __init__(self, info: dict[str, Any]):
        self.info = info
        self.episode_id: str = info["episode_id"]
        self.base_url: str = info["base_url"]
        self.api_key: str = info["api_key"]
        self.keys: dict[str, str] = dict(info.get("keys") or {})
        self.roles: list[str] = list(info.get("roles") or [])
        self.task_id: str = info.get("task_id", "")
        self.eval: bool = bool(info.get("eval", False))
        #: the LoRA adapter it samples with and trains (a server with ``model.adapters``); None: the one model
        self.adapter: str | None = info.get("adapter")
        self.deadline: float = float(info.get("deadline", 0.0))
        self.result: dict[str, Any] | None = None
        #: the answer of ``prepare`` (the first phase of a multi-server end), until the commit
        self.prepared: dict[str, Any] | None = None

    @property
    def server_url(self) -> str:
        """The swarm server's own address (``base_url`` without its ``/v1``)."""
        return self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url

    @property
    def anthropic_base_url(self) -> str:
        """The ``base_url`` of the ``anthropic`` SDK (the server's root; the SDK adds ``/v1/messages``)."""
        return str(self.info.get("anthropic_base_url") or self.server_url)

    def __repr__(self) -> str:
        state = "open" if self.result is None else self.result.get("status")
        return f"{type(self).__name__}({self.episode_id!r}, task_id={self.task_id!r}, {state})"

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


def demonstration_body(messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any]:
    """The body of ``POST /episodes/{id}/demonstration``: a whole conversation ending with the
    assistant turns to learn (OpenAI chat messages, ``tool_calls`` included)."""
    if not messages or messages[-1].get("role") != "assistant":
        raise ValueError("a demonstration is a conversation that ends with an assistant message")
    body: dict[str, Any] = {"messages": [dict(m) for m in messages]}
    if tools:
        body["tools"] = [dict(t) for t in tools]
    return body


def timelines_of(data: Mapping[str, Any], as_objects: bool) -> list[Any]:
    tls = list(data["timelines"])
    if as_objects:
        from swarmkit.timelines import Timeline  # needs the full swarmkit install

        return [Timeline.from_dict(t) for t in tls]
    return tls


def is_lost_report_ack(exc: SwarmAPIError, tail: str, ep: EpisodeInfo) -> bool:
    """A retried report whose first attempt did arrive (the server says it already ended)."""
    return exc.code == "episode_already_ended" and tail == "/report" and ep.result is None


def already_reported(ep: EpisodeInfo, info: Mapping[str, Any]) -> dict[str, Any] | None:
    """The report answer rebuilt from the episode's status, if the server has the reward."""
    if info.get("status") == "finished" and info.get("reward") is not None:
        return {"episode_id": ep.episode_id, "status": "finished", "reward": info["reward"],
                "rewards": info.get("rewards"), "accepted": info.get("accepted"), "note": "already reported"}
    return None


def abort_reason(exc: BaseException | None) -> str:
    """Why the ``episode`` block aborted its episode (at most 1000 characters)."""
    if exc is None:
        return "the episode block ended without a reward"
    return f"exception in the client: {type(exc).__name__}: {exc}"[:1000]


def adapter_body(name: str, lr: float | str | None = None, batching: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The body of ``POST /api/v1/admin/adapters``: ``name``, and ``lr`` / ``batching`` when given."""
    body: dict[str, Any] = {"name": name}
    if lr is not None:
        body["lr"] = lr
    if batching:
        body["batching"] = dict(batching)
    return body
