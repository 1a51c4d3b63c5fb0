"""Several inference engines behind one server (``backend.replicas=N``).

:class:`ReplicaSet` is an :class:`~swarmkit.contract.InferenceBackend` made of
``N`` backends of the same kind, each on its own device (``backend.replica_devices``)
or sharing one. The rest of the server sees one backend.

- **Episode affinity**: the server marks every inference call with its episode id
  (:data:`~swarmkit.contract.backend.ROUTING_KEY`); the :class:`Balancer` sends all
  calls of an episode to the replica that served its first call, so that replica's
  prefix/KV cache is reused turn after turn. A new episode goes to the live replica
  with the fewest calls in flight (then the fewest live episodes).
- **Weight sync** updates every live replica at once; a replica that fails or does
  not confirm within ``backend.replica_sync_timeout_s`` while others took the new
  weights is taken out of rotation, and the sync raises :class:`ReplicaError` naming
  it (the cycle retries the sync, which then updates the replicas left). When every
  replica fails, the fault is the update's: all stay in rotation on their weights
  and the sync fails as it would with one engine. No replica serves a stale policy
  silently.
- **A dead replica** (a call failed with an engine error, not a request error) is
  taken out of rotation with its error in :meth:`ReplicaSet.replica_status`; the call
  is retried once on another replica when nothing of it had reached the client yet.
  The server fails only when no replica is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from swarmkit.contract import (
    GenerationOutput,
    InferenceBackend,
    PromptScores,
    SamplingParams,
    StreamChunk,
)
from swarmkit.contract.backend import ROUTING_KEY
from swarmkit.errors import ApiError

_T = TypeVar("_T")

log = logging.getLogger("swarmkit.replicas")

#: episodes whose replica the balancer remembers (oldest forgotten first); far above any running count
AFFINITY_CAPACITY = 65_536


class ReplicaError(RuntimeError):
    """Replicas failed a weight sync, or none is left to serve."""


@dataclass
class Replica:
    """One engine of the set and what the balancer knows of it."""

    index: int
    backend: InferenceBackend
    device: str | None = None
    alive: bool = True
    error: str | None = None
    died_at: float | None = None
    #: calls being served now; calls served in all
    in_flight: int = 0
    calls: int = 0
    #: episodes routed here and not yet ended
    episodes: set[str] = field(default_factory=set)

    def status(self) -> dict[str, Any]:
        stats: dict[str, float] = {}
        if self.alive:
            try:
                stats = {k: float(v) for k, v in self.backend.engine_stats().items()}
            except Exception:  # noqa: BLE001 - the status must always answer
                stats = {}
        return {"index": self.index, "device": self.device, "alive": self.alive, "error": self.error,
                "died_at": self.died_at, "in_flight": self.in_flight, "calls": self.calls,
                "episodes": len(self.episodes), "policy_version": int(self.backend.policy_version), **stats}


class Balancer:
    """Episode-affine, least-loaded choice of a replica (pure bookkeeping, no I/O).

    ``pick(key)`` returns the replica an episode is bound to while it is alive; an
    unbound key (or one whose replica died) is bound to the live replica with the
    fewest calls in flight, then the fewest episodes, then the lowest index.
    """

    def __init__(self, replicas: Sequence[Replica], capacity: int = AFFINITY_CAPACITY):
        self.replicas = list(replicas)
        self.capacity = capacity
        self._bound: OrderedDict[str, int] = OrderedDict()

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    def pick(self, key: str | None) -> Replica:
        """The replica for a call of episode ``key`` (None: a call of no episode, e.g. a probe)."""
        if key is not None:
            idx = self._bound.get(key)
            if idx is not None:
                rep = self.replicas[idx]
                if rep.alive:
                    self._bound.move_to_end(key)
                    return rep
                rep.episodes.discard(key)
        live = self.live()
        if not live:
            raise ReplicaError("no inference replica is alive: " + "; ".join(
                f"replica {r.index}: {r.error}" for r in self.replicas))
        best = min(live, key=lambda r: (r.in_flight, len(r.episodes), r.index))
        if key is not None:
            self._bound[key] = best.index
            best.episodes.add(key)
            while len(self._bound) > self.capacity:
                old, idx = self._bound.popitem(last=False)
                self.replicas[idx].episodes.discard(old)
        return best

    def bound(self, key: str) -> int | None:
        """The replica index episode ``key`` is bound to (None: not bound)."""
        return self._bound.get(key)

    def forget(self, key: str) -> None:
        """Episode ``key`` ended: its replica no longer counts it."""
        idx = self._bound.pop(key, None)
        if idx is not None:
            self.replicas[idx].episodes.discard(key)


def is_request_error(exc: BaseException) -> bool:
    """Errors that belong to the request (the client's to fix), not to the engine."""
    return isinstance(exc, ValueError | ApiError | asyncio.CancelledError)


class ReplicaSet(InferenceBackend):
    """``N`` backends serving one model as one (see the module docstring).

    :param backends: the replicas, built but not started (same model, same kind).
    :param devices: the device each replica was placed on (for the status; None: the backend's own).
    :param sync_timeout_s: seconds a replica has to confirm a weight update.
    """

    def __init__(self, backends: Sequence[InferenceBackend], devices: Sequence[str | None] | None = None,
                 sync_timeout_s: float = 600.0):
        if not backends:
            raise ValueError("a replica set needs at least one backend")
        devs = list(devices) if devices else [None] * len(backends)
        self.replicas = [Replica(i, b, devs[i] if i < len(devs) else None) for i, b in enumerate(backends)]
        self.balancer = Balancer(self.replicas)
        self.sync_timeout_s = float(sync_timeout_s)
        first = backends[0]
        self.policy_version = int(first.policy_version)
        self.sampling_fields = frozenset.intersection(*(frozenset(b.sampling_fields) for b in backends))
        self.reports_token_versions = all(b.reports_token_versions for b in backends)
        self.trainable = all(b.trainable for b in backends)
        self.scores_prompts = all(b.scores_prompts for b in backends)

    # ------------------------------------------------------------------ engine interface
    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].backend.tokenizer

    @property
    def max_context(self) -> int | None:  # type: ignore[override]
        limits = [r.backend.max_context for r in self.replicas if r.backend.max_context]
        return min(limits) if limits else None

    async def start(self) -> None:
        """Start the replicas one after another (loading two models at once races in lazy imports and
        doubles the peak memory); one that fails to start fails the boot (nothing is served yet)."""
        for rep in self.replicas:
            try:
                await rep.backend.start()
            except Exception as exc:
                await self.close()
                raise ReplicaError(f"replica {rep.index} ({rep.device or 'default device'}) did not start: "
                                   f"{type(exc).__name__}: {exc}") from exc
        log.info("%d inference replicas up (%s)", len(self.replicas),
                 ", ".join(r.device or "default device" for r in self.replicas))

    async def _with_failover(self, call: Callable[[InferenceBackend], Awaitable[_T]]) -> _T:
        """``call`` on the replica the balancer picks; an engine failure (not a request error) retires
        that replica and the call goes once to another live one."""
        key = ROUTING_KEY.get()
        for attempt in (0, 1):
            rep = self.balancer.pick(key)
            rep.in_flight += 1
            rep.calls += 1
            try:
                return await call(rep.backend)
            except BaseException as exc:
                if is_request_error(exc) or not isinstance(exc, Exception):
                    raise
                self._retire(rep, f"{type(exc).__name__}: {exc}")
                if attempt == 1 or not self.balancer.live():
                    raise
            finally:
                rep.in_flight -= 1
        raise AssertionError("unreachable")  # pragma: no cover

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[GenerationOutput]:
        return await self._with_failover(lambda b: b.generate(prompt_ids, params))

    async def score_prompt(self, prompt_ids: Sequence[int], top_logprobs: int = 0) -> PromptScores:
        return await self._with_failover(lambda b: b.score_prompt(prompt_ids, top_logprobs))

    async def stream(self, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[StreamChunk]:
        key = ROUTING_KEY.get()
        for attempt in (0, 1):
            rep = self.balancer.pick(key)
            rep.in_flight += 1
            rep.calls += 1
            sent = False
            agen = rep.backend.stream(prompt_ids, params)
            try:
                async for chunk in agen:
                    sent = True
                    yield chunk
                return
            except BaseException as exc:
                if is_request_error(exc) or not isinstance(exc, Exception):
                    raise
                self._retire(rep, f"{type(exc).__name__}: {exc}")
                if sent or attempt == 1 or not self.balancer.live():
                    raise
            finally:
                rep.in_flight -= 1
                aclose = getattr(agen, "aclose", None)
                if aclose is not None:
                    await aclose()

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | None = None, *,
                             path: str | None = None, version: int) -> None:
        """Update every live replica concurrently; retire and name those that fail or time out."""
        tensors = list(named_tensors) if named_tensors is not None else None
        live = self.balancer.live()
        if not live:
            raise ReplicaError("no inference replica is alive to take the new weights")

        async def one(rep: Replica) -> None:
            async with asyncio.timeout(self.sync_timeout_s):
                await rep.backend.update_weights(tensors, path=path, version=version)

        results = await asyncio.gather(*(one(r) for r in live), return_exceptions=True)
        failed: list[tuple[Replica, str]] = []
        for rep, res in zip(live, results, strict=True):
            if isinstance(res, BaseException):
                failed.append((rep, f"did not confirm weights v{version} within {self.sync_timeout_s:g} s "
                                    "(backend.replica_sync_timeout_s)" if isinstance(res, TimeoutError)
                              else f"weight sync to v{version} failed: {type(res).__name__}: {res}"))
        if not failed:
            self.policy_version = int(version)
            return
        if len(failed) == len(live):
            # the same failure everywhere is the update's fault, not a replica's: keep them all serving the
            # weights they have (as one engine would) and let the cycle retry the sync
            raise ReplicaError(f"weight sync to v{version} failed on every replica (all kept in rotation): "
                               + "; ".join(f"replica {r.index}: {why}" for r, why in failed))
        for rep, why in failed:  # the others took the new weights: these would serve an old policy
            self._retire(rep, why)
        self.policy_version = int(version)
        raise ReplicaError("; ".join(f"replica {r.index}: {why}" for r, why in failed)
                           + f" ({len(self.balancer.live())} of {len(self.replicas)} replicas left in rotation)")

    async def close(self) -> None:
        for rep in self.replicas:
            try:
                await rep.backend.close()
            except Exception:  # noqa: BLE001 - close the others
                log.exception("closing replica %d failed", rep.index)

    def failure(self) -> str | None:
        """None while a replica serves: one whose engine died is taken out of rotation here (the others go on);
        when none is left, why each one failed."""
        for rep in self.balancer.live():
            try:
                why = rep.backend.failure()
            except Exception as exc:  # noqa: BLE001 - an engine that cannot even say is not serving
                why = f"failure() raised {type(exc).__name__}: {exc}"
            if why is not None:
                self._retire(rep, why)
        if self.balancer.live():
            return None
        return "every inference replica failed: " + "; ".join(f"replica {r.index}: {r.error}" for r in self.replicas)

    def engine_stats(self) -> dict[str, float]:
        """The replicas' counters summed, plus ``replicas`` and ``replicas_alive``."""
        total: dict[str, float] = {}
        for rep in self.replicas:
            try:
                stats = rep.backend.engine_stats()
            except Exception:  # noqa: BLE001
                continue
            for k, v in stats.items():
                total[k] = total.get(k, 0.0) + float(v)
        total["replicas"] = float(len(self.replicas))
        total["replicas_alive"] = float(len(self.balancer.live()))
        return total

    # ------------------------------------------------------------------ the set
    def forget(self, key: str) -> None:
        """Episode ``key`` ended (its replica no longer counts it)."""
        self.balancer.forget(key)

    def replica_status(self) -> list[dict[str, Any]]:
        """Per replica: device, alive, error, calls in flight, episodes, policy version, engine counters."""
        return [r.status() for r in self.replicas]

    def _retire(self, rep: Replica, why: str) -> None:
        if not rep.alive:
            return
        rep.alive, rep.error, rep.died_at = False, why, time.time()
        log.error("inference replica %d (%s) taken out of rotation: %s; %d of %d left", rep.index,
                  rep.device or "default device", why, len(self.balancer.live()), len(self.replicas))


def check_replicable(cls: type, name: str, replicas: int) -> None:
    """Refuse ``backend.replicas`` > 1 for a backend class that cannot run twice in one process.

    :raises ValueError: naming the backend and what to do instead.
    """
    if replicas > 1 and not getattr(cls, "replicable", True):
        raise ValueError(f"backend '{name}' cannot run several engines in one server process "
                         f"(backend.replicas={replicas}): run one server per engine (docs/multi_model.md, "
                         "launcher=ray ray.servers=N) or the engine's own parallelism (docs/scaling.md)")


def build_replicas(make: Callable[[dict[str, Any]], InferenceBackend], backend_cfg: dict[str, Any],
                   replicas: int, devices: Sequence[str], sync_timeout_s: float) -> ReplicaSet:
    """``replicas`` backends from one ``backend`` group: replica ``i`` gets ``device = devices[i]``
    when devices are given (a backend whose schema has no ``device`` key takes none).

    :raises ValueError: devices given for a backend without a ``device`` key, or fewer devices than replicas.
    """
    if devices and len(devices) < replicas:
        raise ValueError(f"backend.replica_devices lists {len(devices)} device(s) for {replicas} replicas")
    if devices and "device" not in backend_cfg:
        raise ValueError(f"backend '{backend_cfg.get('name')}' has no 'device' option: "
                         "backend.replica_devices cannot place its replicas")
    backends, placed = [], []
    for i in range(replicas):
        cfg = dict(backend_cfg)
        if devices:
            cfg["device"] = devices[i]
        backends.append(make(cfg))
        placed.append(str(cfg["device"]) if "device" in cfg else None)
    return ReplicaSet(backends, placed, sync_timeout_s)
