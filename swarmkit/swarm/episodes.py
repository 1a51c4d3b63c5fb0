"""Registered episodes, their keys and deadlines.

An episode gets one random API key per role (``secrets.token_urlsafe(32)``,
not derived from its id). A key reaches only its own episode: the registry
maps key → (episode, role). Episodes past their deadline are aborted by
:meth:`EpisodeRegistry.reap` (run periodically by the server's reaper task).
Ended episodes are kept for a while (bounded) so that their owner can read
their timelines and a second end gets 409 rather than 404.

An episode that spans several servers ends in two phases (:mod:`swarmkit.swarm.atomic`):
``prepare`` stores the reward (PREPARED: no more calls, not yet in the pool),
``commit`` hands it to the pool (COMMITTING while that is written, then FINISHED).
"""

from __future__ import annotations

import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmkit.errors import ApiError
from swarmkit.timelines.replay import TurnMemory

RUNNING = "running"
#: the reward is given, the episode waits for its commit (a multi-server episode)
PREPARED = "prepared"
#: the commit is being written to the pool
COMMITTING = "committing"
FINISHED = "finished"
ABORTED = "aborted"

#: the role name of an episode registered without roles
DEFAULT_ROLE = None


@dataclass
class Episode:
    """One episode: identity, keys, recorded timelines and outcome."""

    id: str
    task_id: str
    eval: bool
    client_id: str
    created: float
    deadline: float
    keys: dict[str | None, str]
    roles: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    policy_version: int = 0
    status: str = RUNNING
    reward: float | None = None
    rewards: dict[str, float] = field(default_factory=dict)
    abort_reason: str | None = None
    ended: float | None = None
    timelines: list[Any] = field(default_factory=list)
    n_calls: int = 0
    #: the network address the registration came from (the per-address quota counts it)
    address: str = ""
    #: calls now being generated (the reaper waits for none, it aborts anyway)
    in_flight: int = 0
    #: when the client last did something with this episode (registered, a call began or ended)
    last_active: float = 0.0
    accepted: bool = False
    #: the assistant turns generated for this episode, replayed token-exact when sent back
    turns: TurnMemory = field(default_factory=TurnMemory)
    #: Responses API state kept for the episode's life: response id -> (stored conversation, its items);
    #: ``previous_response_id`` and ``item_reference`` read it (bounded: the newest 256 responses)
    responses: dict[str, Any] = field(default_factory=dict)
    #: a prepared episode of a multi-server episode: the primary episode whose commit decides
    #: this one (``url``, ``episode_id``, ``api_key``); None for the primary itself
    primary: dict[str, str] | None = None
    #: the LoRA adapter its calls sample with and its samples train (``model.adapters``); None: the one model
    adapter: str | None = None

    @property
    def running(self) -> bool:
        """Open for model calls (not yet reported, prepared or ended)."""
        return self.status == RUNNING

    def idle_for(self, now: float | None = None) -> float:
        """Seconds since the client last did something with it (0 while a call is in flight)."""
        if self.in_flight:
            return 0.0
        return (now if now is not None else time.time()) - max(self.last_active, self.created)

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) >= self.deadline

    def summary(self) -> dict[str, Any]:
        return {
            "episode_id": self.id,
            "task_id": self.task_id,
            "eval": self.eval,
            "client_id": self.client_id,
            "status": self.status,
            "roles": self.roles,
            "created": self.created,
            "deadline": self.deadline,
            "ended": self.ended,
            "reward": self.reward,
            "rewards": self.rewards or None,
            "abort_reason": self.abort_reason,
            "n_calls": self.n_calls,
            "n_timelines": len(self.timelines),
            "policy_version": self.policy_version,
            "accepted": self.accepted,
            "meta": self.meta,
        }

    def hook_payload(self) -> dict[str, Any]:
        """What ``on_episode_finished`` receives."""
        return {
            "id": self.id,
            "task_id": self.task_id,
            "status": self.status,
            "reward": self.reward,
            "rewards": self.rewards or None,
            "eval": self.eval,
            "client_id": self.client_id,
            "policy_version": self.policy_version,
            "n_calls": self.n_calls,
            "abort_reason": self.abort_reason,
        }


def check_reward(reward: Any, roles: Sequence[str], max_abs: float = math.inf) -> tuple[float, dict[str, float]]:
    """Validate a reported reward; returns (scalar, per-role) or raises 422.

    A float applies to every role; a mapping must name known roles only (all
    of them) and its scalar is the mean. Every value must be finite and at most
    ``max_abs`` in size (``server.max_abs_reward``: two rewards of 1e308 would
    overflow a group's sum, and NaN advantages would poison the weights).
    """

    def finite(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ApiError(422, f"{where} must be a number, got {type(value).__name__}", "invalid_reward", param="reward")
        try:
            value = float(value)
        except OverflowError:
            raise ApiError(422, f"{where} is too large", "invalid_reward", param="reward") from None
        if not math.isfinite(value):
            raise ApiError(422, f"{where} must be finite, got {value}", "invalid_reward", param="reward")
        if abs(value) > max_abs:
            raise ApiError(422, f"{where} = {value:g} is larger than this server allows (server.max_abs_reward = "
                           f"{max_abs:g})", "invalid_reward", param="reward")
        return value

    if isinstance(reward, Mapping):
        if not roles:
            raise ApiError(
                422,
                "a per-role reward needs an episode registered with roles; send a number instead",
                "invalid_reward",
                param="reward",
            )
        unknown = [r for r in reward if r not in roles]
        if unknown:
            raise ApiError(422, f"unknown role(s) in reward: {', '.join(map(str, unknown))}; roles are {', '.join(roles)}",
                           "invalid_reward", param="reward")
        missing = [r for r in roles if r not in reward]
        if missing:
            raise ApiError(422, f"reward is missing role(s): {', '.join(missing)}", "invalid_reward", param="reward")
        per_role = {r: finite(v, f"reward[{r!r}]") for r, v in reward.items()}
        return sum(per_role.values()) / len(per_role), per_role
    value = finite(reward, "reward")
    return value, {r: value for r in roles}


class EpisodeRegistry:
    """All episodes of one server, by id and by key.

    :param default_timeout_s: deadline of an episode that names none.
    :param max_timeout_s: the longest deadline a client may ask for.
    :param keep_ended: ended episodes kept for timelines / 409 answers.
    :param on_end: called with each episode that ends (finished or aborted).
    """

    def __init__(
        self,
        default_timeout_s: float = 600.0,
        max_timeout_s: float | None = None,
        keep_ended: int = 4096,
        on_end: Callable[[Episode], None] | None = None,
    ):
        self.default_timeout_s = default_timeout_s
        self.max_timeout_s = max_timeout_s or max(default_timeout_s * 10, 3600.0)
        self.keep_ended = keep_ended
        self.on_end = on_end
        self._running: dict[str, Episode] = {}
        self._ended: OrderedDict[str, Episode] = OrderedDict()
        self._by_key: dict[str, tuple[Episode, str | None]] = {}
        self._per_client: dict[str, int] = {}  # running episodes per client id
        self._per_address: dict[str, int] = {}  # running episodes per registering address
        self.counts = {"registered": 0, "finished": 0, "aborted": 0, "reaped": 0, "eval_finished": 0}

    # ------------------------------------------------------------------ register
    def register(
        self,
        task_id: str,
        *,
        eval: bool = False,
        timeout_s: float | None = None,
        roles: Sequence[str] | None = None,
        client_id: str = "",
        meta: dict[str, Any] | None = None,
        policy_version: int = 0,
        now: float | None = None,
        address: str = "",
        adapter: str | None = None,
    ) -> Episode:
        now = time.time() if now is None else now
        timeout = self.default_timeout_s if timeout_s is None else float(timeout_s)
        if not math.isfinite(timeout) or timeout <= 0:
            raise ApiError(422, f"timeout_s must be a positive number of seconds, got {timeout_s}", "invalid_field",
                           param="timeout_s")
        if timeout > self.max_timeout_s:
            raise ApiError(422, f"timeout_s={timeout:g} is longer than this server allows ({self.max_timeout_s:g} s)",
                           "invalid_field", param="timeout_s")
        roles = list(roles or [])
        keys: dict[str | None, str] = {}
        for role in roles or [DEFAULT_ROLE]:
            keys[role] = "sk-swarm-" + secrets.token_urlsafe(32)
        ep = Episode(
            id="ep-" + secrets.token_hex(12),
            task_id=task_id,
            eval=eval,
            client_id=client_id,
            created=now,
            deadline=now + timeout,
            keys=keys,
            roles=roles,
            meta=dict(meta or {}),
            policy_version=policy_version,
            address=address,
            adapter=adapter,
        )
        self._running[ep.id] = ep
        self._per_client[client_id] = self._per_client.get(client_id, 0) + 1
        self._per_address[address] = self._per_address.get(address, 0) + 1
        for role, key in keys.items():
            self._by_key[key] = (ep, role)
        self.counts["registered"] += 1
        return ep

    def running_count(self, client_id: str | None = None, *, address: str | None = None) -> int:
        """Running episodes: all, of one client id, or registered from one address."""
        if address is not None:
            return self._per_address.get(address, 0)
        return len(self._running) if client_id is None else self._per_client.get(client_id, 0)

    # ------------------------------------------------------------------ lookup
    def get(self, episode_id: str) -> Episode:
        ep = self._running.get(episode_id) or self._ended.get(episode_id)
        if ep is None:
            raise ApiError(404, f"unknown episode '{episode_id}' (never registered here, or long ended)",
                           "episode_not_found")
        return ep

    def by_key(self, key: str | None) -> tuple[Episode, str | None]:
        """The episode and role a key belongs to; 401 for a missing or unknown key."""
        if not key:
            raise ApiError(401, "missing API key: send the episode's api_key as 'Authorization: Bearer <key>'",
                           "missing_api_key")
        hit = self._by_key.get(key)
        if hit is None:
            raise ApiError(401, "invalid API key: it names no episode on this server (register one first)",
                           "invalid_api_key")
        return hit

    def owned(self, episode_id: str, key: str | None) -> Episode:
        """The episode ``episode_id`` if ``key`` is one of its keys (401 / 403 / 404 otherwise)."""
        ep = self.get(episode_id)
        if not key:
            raise ApiError(401, "missing API key: send the episode's api_key as 'Authorization: Bearer <key>'",
                           "missing_api_key")
        if not any(secrets.compare_digest(key.encode(), k.encode()) for k in ep.keys.values()):
            raise ApiError(403, f"this key does not belong to episode '{episode_id}'", "wrong_episode_key")
        return ep

    def running(self) -> list[Episode]:
        return list(self._running.values())

    def ended(self) -> list[Episode]:
        return list(self._ended.values())

    def __len__(self) -> int:
        return len(self._running)

    # ------------------------------------------------------------------ ending
    def check_open(self, ep: Episode, now: float | None = None) -> None:
        """Raise 409 if ``ep`` already ended, 410 if it is past its deadline."""
        if ep.status == FINISHED:
            raise ApiError(409, f"episode '{ep.id}' already ended (finished with reward {ep.reward})",
                           "episode_already_ended")
        if ep.status == ABORTED:
            if ep.abort_reason == "deadline":
                raise ApiError(410, f"episode '{ep.id}' passed its deadline and was aborted", "episode_expired")
            raise ApiError(409, f"episode '{ep.id}' already ended (aborted: {ep.abort_reason})",
                           "episode_already_ended")
        if ep.status == PREPARED:
            raise ApiError(409, f"episode '{ep.id}' is prepared (its reward is given): commit or abort it",
                           "episode_prepared")
        if ep.status == COMMITTING:
            raise ApiError(409, f"episode '{ep.id}' is being committed; ask again in a moment", "episode_committing")
        if ep.expired(now):
            self.abort(ep, "deadline", reaped=True)
            raise ApiError(410, f"episode '{ep.id}' passed its deadline and was aborted", "episode_expired")

    def prepare(self, ep: Episode, reward: float, rewards: dict[str, float], primary: dict[str, str] | None) -> None:
        """RUNNING → PREPARED: the reward is kept until :meth:`SwarmServer.commit` or an abort."""
        ep.status = PREPARED
        ep.reward, ep.rewards = reward, rewards
        ep.primary = primary

    def prepared_past_deadline(self, now: float | None = None) -> list[Episode]:
        """Prepared episodes whose deadline passed (their client never committed: resolve them)."""
        now = time.time() if now is None else now
        return [ep for ep in self._running.values() if ep.status == PREPARED and ep.expired(now)]

    def finish(self, ep: Episode, reward: float, rewards: dict[str, float], accepted: bool) -> None:
        ep.status = FINISHED
        ep.reward = reward
        ep.rewards = rewards
        ep.accepted = accepted
        self.counts["eval_finished" if ep.eval else "finished"] += 1
        self._end(ep)

    def abort(self, ep: Episode, reason: str, *, reaped: bool = False) -> None:
        """End a running or prepared episode without a sample (no-op once ended or committing)."""
        if ep.status not in (RUNNING, PREPARED):
            return
        ep.status = ABORTED
        ep.abort_reason = reason
        self.counts["aborted"] += 1
        if reaped:
            self.counts["reaped"] += 1
        self._end(ep)

    def _end(self, ep: Episode) -> None:
        ep.ended = time.time()
        if self._running.pop(ep.id, None) is not None:
            for counts, who in ((self._per_client, ep.client_id), (self._per_address, ep.address)):
                left = counts.get(who, 1) - 1
                if left > 0:
                    counts[who] = left
                else:
                    counts.pop(who, None)
        self._ended[ep.id] = ep
        while len(self._ended) > self.keep_ended:
            _, old = self._ended.popitem(last=False)
            for key in old.keys.values():
                self._by_key.pop(key, None)
        if self.on_end is not None:
            self.on_end(ep)

    def reap(self, now: float | None = None) -> list[Episode]:
        """Abort every running episode past its deadline; returns them (prepared ones are resolved by the
        server, :meth:`prepared_past_deadline`)."""
        now = time.time() if now is None else now
        expired = [ep for ep in self._running.values() if ep.running and ep.expired(now)]
        for ep in expired:
            self.abort(ep, "deadline", reaped=True)
        return expired

    def abort_all(self, reason: str) -> int:
        eps = list(self._running.values())
        for ep in eps:
            self.abort(ep, reason)
        return len(eps)
