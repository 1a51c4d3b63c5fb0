"""One episode over several servers, ended atomically: :func:`swarm_episode`.

A multi-agent episode whose roles are trained by different servers (civilians
on server A, spies on server B) is one registered episode per server. Ending it
with one ``report`` per server is not atomic: a client killed between the two
reports leaves A with a sample and B without. :func:`swarm_episode` registers
the parts (in one fixed order, all or nothing: a part whose server is busy
with a training step is not waited for while the others are held, which would
hold their servers' steps) and ends them in two phases, ``prepare`` on every part, then
``commit``, primary first; a server whose client died resolves its part from
the primary's outcome (:mod:`swarmkit.swarm.atomic` says how). So every server
keeps the episode, or none does::

    from swarmkit.client import SwarmClient, swarm_episode

    routes = {"civilian": SwarmClient(URL_A), "spy": SwarmClient(URL_B)}
    with swarm_episode(routes, task_id="pair-3") as ep:
        civ = OpenAI(base_url=ep.base_url("civilian"), api_key=ep.key_for("civilian"))
        spy = OpenAI(base_url=ep.base_url("spy"), api_key=ep.key_for("spy"))
        ...  # play
        ep.report({"civilian": 1.0, "spy": 0.0})

Roles routed to the same server share one episode there (``roles=[...]``).
``frozen`` roles are played but not trained: their server's part is an eval
episode (all roles of a part must agree).

On a server that trains several LoRA adapters over one base
(``model.adapters``), ``adapters`` names each role's adapter; roles of one
server with different adapters are different parts there (an episode trains
one adapter), ended together like parts on different servers::

    c = SwarmClient(URL)  # model.adapters=[civilians,spies]
    with swarm_episode({"civilian": c, "spy": c}, "pair-3",
                       adapters={"civilian": "civilians", "spy": "spies"}) as ep:
        ...
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Collection, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from typing import Any, Generic, Protocol, TypeVar

from swarmkit.client._common import ServerUnavailable, SwarmAPIError, SwarmError, abort_reason
from swarmkit.client.aio import AsyncEpisode, AsyncSwarmClient
from swarmkit.client.sync import Episode, SwarmClient


class _HasUrl(Protocol):
    url: str


C = TypeVar("C", bound=_HasUrl)
E = TypeVar("E", Episode, AsyncEpisode)

log = logging.getLogger("swarmkit.client")

#: the first and the longest pause before the parts are registered again after a later part's server was
#: busy (seconds; the pause doubles, with jitter)
REGISTER_PAUSE_S = (0.25, 4.0)
#: why the earlier parts are dropped when a later part's server is busy
REGISTER_AGAIN = "another part's server was busy: the episode is registered again"

__all__ = ["AsyncSwarmEpisode", "SwarmEpisode", "async_swarm_episode", "plan_parts", "swarm_episode"]


def plan_parts(routes: Mapping[str, C], frozen: Collection[str] = (), adapters: Mapping[str, str] | None = None
               ) -> list[tuple[C, list[str], bool, str | None]]:
    """(server, its roles, eval, adapter) per part, in the fixed order (by server URL, then adapter; the
    first is the primary). A part is the roles of one server that sample with one adapter (``adapters``:
    role → adapter; None or a role left out: the server's one model)."""
    if not routes:
        raise ValueError("swarm_episode needs at least one role -> server route")
    unknown = set(frozen) - set(routes)
    if unknown:
        raise ValueError(f"frozen role(s) {sorted(unknown)} have no route")
    adapters = dict(adapters or {})
    unrouted = set(adapters) - set(routes)
    if unrouted:
        raise ValueError(f"adapters name role(s) {sorted(unrouted)} that have no route")
    by_part: dict[tuple[str, str], tuple[C, list[str]]] = {}
    for role, client in routes.items():
        by_part.setdefault((client.url, adapters.get(role) or ""), (client, []))[1].append(role)
    parts = []
    for url, adapter in sorted(by_part):
        client, roles = by_part[(url, adapter)]
        flags = {r in frozen for r in roles}
        if len(flags) > 1:
            raise ValueError(f"roles {roles} share an episode on {url}: freeze all of them or none "
                             "(one episode there is either trained or not)")
        parts.append((client, roles, flags.pop(), adapter or None))
    return parts


class _Parts(Generic[E]):
    """The parts of one multi-server episode (primary first), by role."""

    def __init__(self, episodes: list[E]):
        self.episodes: list[E] = episodes
        #: the primary committed: the episode is decided (a part whose commit failed follows on its server)
        self.committed = False
        #: the primary's commit got no answer: its outcome is unknown, so the parts are left to their servers
        #: (each resolves its prepared part from the primary at the deadline) instead of being aborted here
        self.in_doubt = False
        self._by_role: dict[str, E] = {role: ep for ep in episodes for role in ep.roles}

    @property
    def roles(self) -> list[str]:
        return list(self._by_role)

    @property
    def primary(self) -> E:
        return self.episodes[0]

    @property
    def ended(self) -> bool:
        return self.committed or self.in_doubt or all(ep.ended for ep in self.episodes)

    def _commit_failed(self, exc: BaseException) -> bool:
        """Whether a failed commit of the primary is definitive (its server answered 4xx: not committed);
        otherwise the outcome is unknown and the episode is marked in doubt."""
        if isinstance(exc, SwarmAPIError) and exc.status < 500:
            return True
        self.in_doubt = True
        log.warning("episode %s: the primary's commit got no answer (%s); every server resolves its part from "
                    "the primary's outcome at the deadline", self.primary.episode_id, exc)
        return False

    def episode(self, role: str) -> E:
        """The registered episode that holds ``role``."""
        try:
            return self._by_role[role]
        except KeyError:
            raise KeyError(f"no role {role!r}; roles: {', '.join(self._by_role)}") from None

    def base_url(self, role: str) -> str:
        return self.episode(role).base_url

    def key_for(self, role: str) -> str:
        return self.episode(role).key_for(role)

    def _split(self, rewards: Mapping[str, float]) -> dict[str, dict[str, float]]:
        """Episode id → its roles' rewards; ValueError unless ``rewards`` names exactly the roles."""
        missing = set(self._by_role) - set(rewards)
        extra = set(rewards) - set(self._by_role)
        if missing or extra:
            raise ValueError(f"rewards must name exactly the roles {sorted(self._by_role)} "
                             f"(missing {sorted(missing)}, unknown {sorted(extra)})")
        return {ep.episode_id: {r: float(rewards[r]) for r in ep.roles} for ep in self.episodes}


class SwarmEpisode(_Parts[Episode]):
    """One multi-server episode of :func:`swarm_episode` and how to end its parts together."""

    def demonstrate(self, role: str, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """Record a demonstrated conversation of ``role`` on the server that trains it
        (see :meth:`Episode.demonstrate`)."""
        return self.episode(role).demonstrate(messages, tools, role=role)

    def report(self, rewards: Mapping[str, float], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """End every part with its roles' rewards: all servers keep the episode, or none does.

        Returns episode id → the server's answer. When a prepare fails, or the primary's
        server refuses its commit, every part is dropped and the error propagates; when the
        primary's commit gets no answer, the episode is in doubt (``in_doubt``): the parts
        are left prepared and every server resolves its own from the primary's outcome.
        """
        share = self._split(rewards)
        primary = self.primary
        if len(self.episodes) == 1:  # one server: its report is already atomic
            return {primary.episode_id: primary.report(share[primary.episode_id], meta)}
        try:
            for ep in self.episodes:
                ep.prepare(share[ep.episode_id], meta, primary=None if ep is primary else primary)
        except BaseException as exc:
            self.abort(abort_reason(exc))
            raise
        try:
            primary.commit()  # the decision
        except BaseException as exc:
            if self._commit_failed(exc):
                self.abort(abort_reason(exc))
            raise
        self.committed = True
        for ep in self.episodes[1:]:  # committed: the rest follow (or their server resolves them from the primary)
            try:
                ep.commit()
            except SwarmError as exc:
                _follow_later(ep, exc)
        return {ep.episode_id: ep.result or ep.prepared for ep in self.episodes}

    def abort(self, reason: str = "aborted by the client") -> None:
        """Drop every part that has not ended (quietly: a server that is gone drops it at the deadline).

        Does nothing once the primary committed (the episode is decided) or while its outcome is
        unknown (the servers resolve their parts from it).
        """
        if self.committed or self.in_doubt:
            return
        for ep in self.episodes:
            if not ep.ended:
                with suppress(SwarmError):
                    ep.abort(reason)


class AsyncSwarmEpisode(_Parts[AsyncEpisode]):
    """:class:`SwarmEpisode` for :class:`AsyncSwarmClient` routes (``await ep.report(...)``)."""

    async def demonstrate(self, role: str, messages: Sequence[Mapping[str, Any]],
                          tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """Record a demonstrated conversation of ``role`` on the server that trains it."""
        return await self.episode(role).demonstrate(messages, tools, role=role)

    async def report(self, rewards: Mapping[str, float], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """End every part with its roles' rewards: all servers keep the episode, or none does."""
        share = self._split(rewards)
        primary = self.primary
        if len(self.episodes) == 1:
            return {primary.episode_id: await primary.report(share[primary.episode_id], meta)}
        try:
            for ep in self.episodes:
                await ep.prepare(share[ep.episode_id], meta, primary=None if ep is primary else primary)
        except BaseException as exc:
            await self.abort(abort_reason(exc))
            raise
        try:
            await primary.commit()
        except BaseException as exc:
            if self._commit_failed(exc):
                await self.abort(abort_reason(exc))
            raise
        self.committed = True
        for ep in self.episodes[1:]:
            try:
                await ep.commit()
            except SwarmError as exc:
                _follow_later(ep, exc)
        return {ep.episode_id: ep.result or ep.prepared for ep in self.episodes}

    async def abort(self, reason: str = "aborted by the client") -> None:
        """Drop every part that has not ended (nothing once the primary committed or while in doubt)."""
        if self.committed or self.in_doubt:
            return
        for ep in self.episodes:
            if not ep.ended:
                with suppress(SwarmError):
                    await ep.abort(reason)


def _follow_later(ep: Episode | AsyncEpisode, exc: SwarmError) -> None:
    log.warning("episode %s: commit failed (%s); its server commits it from the primary's outcome",
                ep.episode_id, exc)


class _RegisterAgain:
    """When a set of parts is registered again: jittered exponential pauses (``REGISTER_PAUSE_S``) within
    ``budget`` seconds (the clients' longest ``retry_for``); shared by the sync and async registrations."""

    def __init__(self, budget: float, task_id: str):
        self.deadline = time.monotonic() + budget
        self.task_id = task_id
        self.next = REGISTER_PAUSE_S[0]

    def pause(self, exc: ServerUnavailable, parts: Sequence[object]) -> float:
        """Seconds to wait before the next try (the parts already dropped); re-raises ``exc`` when the first
        part's own retries gave up (``parts`` empty) or the budget is spent."""
        left = self.deadline - time.monotonic()
        if not parts or left <= 0:
            raise exc
        log.debug("episode of %s: %s (%s)", self.task_id, REGISTER_AGAIN, exc)
        wait = min(self.next * (0.8 + 0.4 * random.random()), left)
        self.next = min(self.next * 2, REGISTER_PAUSE_S[1])
        return wait


def _register_parts(plan: list[tuple[SwarmClient, list[str], bool, str | None]], task_id: str, eval: bool,
                    timeout_s: float | None, meta: Mapping[str, Any] | None) -> list[Episode]:
    """Register every part, all or nothing, never holding a part while waiting for another.

    The first part waits while its server is busy (the client's ``retry_for``). A later part whose server
    is busy (a training step being prepared) does not wait: the parts registered so far are dropped and
    the whole set is registered again after a pause. A held part would hold its server's drain before a
    step, and for good when both parts are on one server (two adapters): the drain waits for the first
    part, the second part's registration waits for the drain.
    """
    again = _RegisterAgain(max(client.retry_for for client, *_ in plan), task_id)
    while True:
        parts: list[Episode] = []
        try:
            for i, (client, roles, is_frozen, adapter) in enumerate(plan):
                parts.append(client.register(task_id, eval or is_frozen, timeout_s=timeout_s, roles=roles, meta=meta,
                                             adapter=adapter, retry_for=None if i == 0 else 0.0))
            return parts
        except ServerUnavailable as exc:
            SwarmEpisode(parts).abort(REGISTER_AGAIN if parts else abort_reason(exc))
            time.sleep(again.pause(exc, parts))
        except BaseException as exc:
            SwarmEpisode(parts).abort(abort_reason(exc))
            raise


async def _aregister_parts(plan: list[tuple[AsyncSwarmClient, list[str], bool, str | None]], task_id: str,
                           eval: bool, timeout_s: float | None, meta: Mapping[str, Any] | None
                           ) -> list[AsyncEpisode]:
    """:func:`_register_parts` for :class:`AsyncSwarmClient` routes."""
    again = _RegisterAgain(max(client.retry_for for client, *_ in plan), task_id)
    while True:
        parts: list[AsyncEpisode] = []
        try:
            for i, (client, roles, is_frozen, adapter) in enumerate(plan):
                parts.append(await client.register(task_id, eval or is_frozen, timeout_s=timeout_s, roles=roles,
                                                   meta=meta, adapter=adapter, retry_for=None if i == 0 else 0.0))
            return parts
        except ServerUnavailable as exc:
            await AsyncSwarmEpisode(parts).abort(REGISTER_AGAIN if parts else abort_reason(exc))
            await asyncio.sleep(again.pause(exc, parts))
        except BaseException as exc:
            await AsyncSwarmEpisode(parts).abort(abort_reason(exc))
            raise


@contextmanager
def swarm_episode(routes: Mapping[str, SwarmClient], task_id: str, *, eval: bool = False,
                  frozen: Collection[str] = (), timeout_s: float | None = None,
                  meta: Mapping[str, Any] | None = None,
                  adapters: Mapping[str, str] | None = None) -> Iterator[SwarmEpisode]:
    """Register one episode per server (and adapter) for the ``with`` block (see the module text).

    :param routes: role → the client of the server that trains that role.
    :param eval: every part is an eval episode (nothing is trained).
    :param frozen: roles that play but are not trained (their part is an eval episode).
    :param adapters: role → the LoRA adapter it samples with and trains, on a server with
        ``model.adapters``; roles of one server with different adapters get an episode each.
    An exception in the block, or a block that ends without :meth:`SwarmEpisode.report`,
    drops every part.
    """
    ep = SwarmEpisode(_register_parts(plan_parts(routes, frozen, adapters), task_id, eval, timeout_s, meta))
    try:
        yield ep
    except BaseException as exc:
        ep.abort(abort_reason(exc))
        raise
    if not ep.ended:
        ep.abort(abort_reason(None))


@asynccontextmanager
async def async_swarm_episode(routes: Mapping[str, AsyncSwarmClient], task_id: str, *, eval: bool = False,
                              frozen: Collection[str] = (), timeout_s: float | None = None,
                              meta: Mapping[str, Any] | None = None,
                              adapters: Mapping[str, str] | None = None) -> AsyncIterator[AsyncSwarmEpisode]:
    """:func:`swarm_episode` for :class:`AsyncSwarmClient` routes (``async with``)."""
    ep = AsyncSwarmEpisode(await _aregister_parts(plan_parts(routes, frozen, adapters), task_id, eval, timeout_s,
                                                  meta))
    try:
        yield ep
    except BaseException as exc:
        await ep.abort(abort_reason(exc))
        raise
    if not ep.ended:
        await ep.abort(abort_reason(None))
