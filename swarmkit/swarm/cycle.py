"""The roll/train cycle: sample pool + batching policy + trainer, wired into a server.

``ROLLING`` → (policy fires) → ``ROLLING_POST`` (new episodes get 503 +
Retry-After; running ones may finish until ``server.drain_timeout_s``, then
are aborted) → ``WEIGHT_SYNCING`` (timelines merged, one optimizer step, new
weights pushed into the inference engine) → ``ROLLING`` with the policy
version incremented.

Every accepted episode is written to the SQLite journal
(``<run_dir>/journal.sqlite``) before its reporter gets the success answer;
the pool is rebuilt from the journal when a server starts on the same
``run_dir``. Episodes a step trained on are marked with that step.

The step itself is pluggable: ``TrainingCycle(run_dir, step_fn=...)`` with
``step_fn(records, step) -> metrics`` replaces the trainer (tests, custom
trainers); otherwise ``trainer_factory(config)`` builds the trainer at boot
(the composition root, :mod:`swarmkit.apps.wiring`, passes
:class:`swarmkit.training.Trainer`) and its weights are synced after each step.
The cycle is handed to the server in its constructor
(``SwarmServer(..., cycle=TrainingCycle(...))``), which attaches itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from swarmkit.config.plain import as_dict
from swarmkit.config.schema import AdapterSpec, CollapseConfig, ModelConfig, TrainerConfig
from swarmkit.contract import InferenceBackend, PoolEpisode
from swarmkit.plugins import get_hooks, load_component
from swarmkit.pool import EpisodeRecord, SamplePool
from swarmkit.swarm.collapse import ENTROPY, Alarm, CollapseAlarm, collapse_signals
from swarmkit.swarm.episodes import Episode
from swarmkit.swarm.families import step_family_metrics
from swarmkit.swarm.metrics import MetricsWriter, finite_or_none, step_line
from swarmkit.swarm.staleness import admission_capacity, admits, holds_step
from swarmkit.swarm.state import ServerState

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.contract import InferenceBackend
    from swarmkit.swarm.episodes import EpisodeRegistry
    from swarmkit.swarm.families import EvalTally
    from swarmkit.swarm.presence import ClientTracker
    from swarmkit.swarm.state import StateMachine

log = logging.getLogger("swarmkit.cycle")

class CycleHost(Protocol):
    """All a training cycle uses of its server (:class:`~swarmkit.swarm.server.SwarmServer`): the one
    seam between them. The server's limits, clients, episodes and state machine are read; the cycle
    moves the state machine only through the four step methods. Training progress (``global_step``,
    ``training_finished``) is the cycle's own; the server reads it."""

    run_dir: Path | None
    config: Any
    drain_timeout_s: float
    drain_idle_s: float
    max_journal_bytes: int
    min_free_disk_bytes: int
    clients: ClientTracker
    episodes: EpisodeRegistry
    eval_tally: EvalTally
    state: StateMachine

    @property
    def backend(self) -> InferenceBackend | None: ...

    @property
    def policy_version(self) -> int: ...

    def enter_rolling_post(self) -> None: ...

    async def drain(self, timeout_s: float | None = None, *, include_eval: bool = True) -> int: ...

    def enter_weight_syncing(self) -> None: ...

    def resume_rolling(self) -> None: ...

    def abandoned(self, ep: Episode, now: float) -> bool: ...


StepFn = Callable[[Sequence[EpisodeRecord], int], dict[str, float]]
TrainerFactory = Callable[[dict[str, Any], Path], Any]
JOURNAL_FILE = "journal.sqlite"
#: how ``last_error`` starts while the journal refuses finished episodes (cleared by the next one it takes)
JOURNAL_STORE_ERROR = "the journal could not store episode"


def pool_record(ep: Episode) -> EpisodeRecord:
    """The journal record of a finished training episode.

    The reward is the role → reward dict for episodes with roles, else the float;
    ``task_family`` comes from the episode's ``meta["task_family"]``.
    """
    return EpisodeRecord(
        episode_id=ep.id,
        task_id=ep.task_id,
        client_id=ep.client_id,
        reward=dict(ep.rewards) if ep.roles else float(ep.reward if ep.reward is not None else 0.0),
        timelines=[tl.to_dict() for tl in ep.timelines],
        policy_version=ep.policy_version,
        task_family=str(ep.meta.get("task_family", "")),
        meta={"roles": ep.roles, "n_calls": ep.n_calls, **{k: v for k, v in ep.meta.items() if k != "task_family"}},
        adapter=ep.adapter or "",
    )




class TrainingCycle:
    """Owns the pool, the batching policy and the trainer of one server (:class:`CycleHost`).

    :param run_dir: the server's run folder (journal, metrics, checkpoints).
    :param trainer_factory: ``(config dict, run_dir) -> trainer`` (``step``,
        ``export_weights``, ``global_step``, checkpoints, ``close``).
    :param step_fn: a replacement for the trainer's step (no trainer, no weight sync then).
    :param poll_s: how often the policy is asked when nothing new arrived
        (C4/C5 depend on time: clients drop out of the active window).
    """

    def __init__(self, run_dir: str | Path, *, trainer_factory: TrainerFactory | None = None,
                 step_fn: StepFn | None = None, poll_s: float = 0.2):
        if trainer_factory is None and step_fn is None:
            raise ValueError("a training cycle needs a trainer_factory or a step_fn")
        self.run_dir = Path(run_dir)
        self.pool = SamplePool(self.run_dir / JOURNAL_FILE)
        self.trainer_factory = trainer_factory
        self.custom_step = step_fn
        self.poll_s = poll_s
        self.policy: Any = None
        self.policy_name = ""
        self.trainer: Any = None
        self.metrics: MetricsWriter | None = None
        self.last_metrics: dict[str, float] = {}
        self.last_error: str | None = None
        #: the training steps applied and served: this cycle is its only writer (the server reads it)
        self.global_step = 0
        #: why no further step trains (``trainer.total_steps`` reached); training episodes are then refused
        self.training_finished: str | None = None
        self.steps_failed = 0
        #: steps failed since the last one that trained (a main job ends after MAX_FAILED_STEPS_IN_ROW)
        self.steps_failed_in_row = 0
        self.total_steps = 0
        self.checkpoint_every = 0
        self.keep_checkpoints = 0
        #: episodes per step handed to the loggers token by token (trainer.log_trajectories)
        self.log_trajectories = 2
        #: attempts of a step's journal write before it is left to :meth:`_catch_up`
        self.journal_attempts = 6
        #: steps applied whose journal write failed: (episode ids, filtered ids, step)
        self._unrecorded: list[tuple[list[str], list[str], int]] = []
        #: a step applied whose weights the engine does not serve yet
        self._unsynced: int | None = None
        self._retry_at = 0.0
        #: "sync" or "async" (trainer.mode) and the async staleness bound (trainer.max_staleness)
        self.mode = "sync"
        self.max_staleness = 0
        #: the step under way in the background (async mode), since when, and how long the last took
        self._training_task: asyncio.Task | None = None
        self._training_since: float | None = None
        self.last_step_s: float | None = None
        #: async: since when the next step waits for a straggler, and how long the last one waited
        self._held_since: float | None = None
        self._held_s = 0.0
        #: the last step the trainer applied (the batch is spent from then on)
        self._applied_step = 0
        #: held while the trainer steps, syncs or saves (a controller's checkpoint waits for it)
        self._trainer_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        #: set by before_stop: the loop ends (a stop never waits on a loop that lost its cancellation)
        self._stopping = False
        self._server: CycleHost | None = None
        #: the collapse alarm (trainer.collapse) and what it did: this cycle is its only writer
        self.collapse = CollapseConfig()
        self.alarm = CollapseAlarm(self.collapse)
        self.last_alarm: Alarm | None = None
        #: why training is paused (the alarm's "pause"); None: it trains. Cleared by resume_training()
        self.paused: str | None = None
        self.rollbacks = 0
        #: steps run without a trainer: the backend serves no trainable model (InferenceBackend.trainable)
        self.noop_steps = False
        #: async rollback: (when, step) — an episode created before it holding tokens of later weights is retired
        self._fence: tuple[float, int] | None = None
        #: the LoRA adapters trained over one base (model.adapters); each step trains one, in turn
        self.adapters: list[str] = []
        self._last_adapter: str | None = None
        self._cocktail_warned: set[str | None] = set()  # adapters (None: the model) told of a cocktail stall
        #: each adapter's last step's mean reward (status)
        self._adapter_reward: dict[str, float] = {}
        #: the batching policy of each adapter with batching keys of its own (the others use ``policy``)
        self.adapter_policies: dict[str, Any] = {}

    # ------------------------------------------------------------------ the server's Cycle
    def attach(self, server: CycleHost) -> None:
        if server.run_dir is None or Path(server.run_dir) != self.run_dir:
            raise ValueError(f"the training cycle's run_dir {self.run_dir} is not the server's ({server.run_dir})")
        self._server = server

    @property
    def server(self) -> CycleHost:
        if self._server is None:
            raise RuntimeError("the training cycle is not attached to a server")
        return self._server

    @property
    def active_window_s(self) -> float | None:
        """The batching policy's active window (the server's client tracker uses it); None before boot."""
        return float(self.policy.active_window_s) if self.policy is not None else None

    def record_eval(self, metrics: dict[str, float]) -> None:
        """An eval round's rewards, as an ``eval`` row of ``metrics.jsonl`` at the current step."""
        if self.metrics is not None:
            self.metrics.write(self.global_step, metrics, kind="eval")

    def waiting(self) -> list[PoolEpisode]:
        """The accepted episodes waiting in the pool for a step."""
        return self.pool.view()

    async def accept(self, ep: Episode) -> None:
        """Journal the episode (durable) before its reporter is answered.

        The write (an SQLite commit with ``synchronous=FULL``: one fsync, milliseconds) runs in a worker
        thread, so the event loop serves other calls meanwhile instead of stalling once per report.
        A journal that refuses it raises (the reporter retries) and ``last_error`` says why until
        the journal takes an episode again.
        """
        try:
            await asyncio.to_thread(self.pool.add, pool_record(ep))
            # back on the loop: a rollback (retire_after, then the fence) is atomic here, so an episode it
            # did not see in the pool is filtered now
            if self._fence is not None and _sampled_after(ep, *self._fence):
                self.pool.mark_filtered([ep.id], self._fence[1])  # its tokens came from weights a rollback undid
        except Exception as exc:
            self.last_error = (f"{JOURNAL_STORE_ERROR} {ep.id}: {type(exc).__name__}: {exc}; "
                               "reports are refused until it can")
            log.error("%s", self.last_error)
            raise
        if self.last_error and self.last_error.startswith(JOURNAL_STORE_ERROR):
            self.last_error = None  # the journal takes episodes again
        self._wake.set()

    def status(self) -> dict[str, Any]:
        stats = self.pool.stats(self.policy, self.server.clients.all(), time.time()) if self.policy else self.pool.stats()
        stats["policy"] = self.policy_name or None
        if self.adapters:
            stats["adapters"] = self.adapter_status()
        if self._server is not None:
            stats["trainer"] = self.trainer_status()
        if self.last_error:
            stats["last_error"] = self.last_error
        if self.steps_failed_in_row:
            stats["steps_failed_in_row"] = self.steps_failed_in_row
        if self.last_metrics:
            stats["last_step"] = self.last_metrics
        stats["alarm"] = self.alarm_status()
        return stats

    def adapter_status(self) -> dict[str, dict[str, Any]]:
        """Each adapter of ``model.adapters``, for ``status()["pool"]["adapters"]``: ``step`` (its optimizer
        steps), ``policy_version`` (the version of it the engine serves), ``waiting`` (its episodes in the
        pool), ``running`` (its training episodes open now), ``reward_mean`` (its last step's mean reward)."""
        view = self.pool.view()
        steps: dict[str, int] = {}
        if self.trainer is not None and hasattr(self.trainer, "adapter_step"):
            steps = {n: self.trainer.adapter_step(n) for n in self.adapters}
        served = getattr(self.server.backend, "adapter_versions", None) if self._server is not None else None
        running = [e for e in self.server.episodes.running() if not e.eval] if self._server is not None else []
        return {n: {"step": steps.get(n), "policy_version": served.get(n) if isinstance(served, dict) else None,
                    "waiting": sum(e.adapter == n for e in view), "running": sum(e.adapter == n for e in running),
                    "reward_mean": self._adapter_reward.get(n), "batching": self._batching_of(n)}
                for n in self.adapters}

    def _batching_of(self, adapter: str) -> dict[str, Any]:
        """The batch an adapter's steps wait for: its policy's name, ``batch_size``, ``rollouts_per_task``."""
        policy = self.adapter_policies.get(adapter, self.policy)
        name = getattr(policy, "name", None) or self.policy_name
        return {"policy": name, "batch_size": getattr(policy, "batch_size", None),
                "rollouts_per_task": getattr(policy, "rollouts_per_task", None)}

    def alarm_status(self) -> dict[str, Any]:
        """The collapse alarm, for ``status()["pool"]["alarm"]``: ``active`` (signals of the last
        alarm are still past their thresholds, or training is paused by it), ``paused`` (why),
        ``message`` and ``last`` (the last alarm: step, window, signals, action ``taken``: ``pending``
        while a rollback is under way), ``fired``,
        ``rollbacks``, ``action`` (trainer.collapse.action), ``entropy_floor`` (the entropy it fires below
        now) and ``warm_entropy`` (what a supervised warm start ended with, which lowers that floor)."""
        last = self.last_alarm
        return {"active": self.alarm.active is not None or self.paused is not None, "paused": self.paused,
                "message": last.message if last is not None else None,
                "last": last.as_dict() if last is not None else None, "fired": self.alarm.fired,
                "rollbacks": self.rollbacks, "action": self.collapse.action, "enabled": self.collapse.enabled,
                "entropy_floor": self.alarm.limits[ENTROPY][0], "warm_entropy": self.alarm.warm_entropy}

    def resume_training(self) -> dict[str, Any]:
        """Training goes on after the alarm paused it (``POST /api/v1/admin/resume_training``); the
        alarm's counts start over, so it fires again only after ``patience`` more steps past a threshold."""
        was = self.paused
        self.paused = None
        if was is not None and self.last_error == was:
            self.last_error = None
        self.alarm.reset()
        self._wake.set()
        if was is not None:
            log.warning("training resumed by the controller at step %d (it was paused: %s)", self.global_step, was)
        return {"resumed": was is not None, "global_step": self.global_step}

    async def after_boot(self) -> None:
        server = self.server
        cfg = as_dict(server.config)
        batching = dict(cfg["batching"])
        self.policy_name = str(batching["name"])
        self.policy = load_component("batching", self.policy_name)(**batching)
        specs = ModelConfig.of(cfg.get("model")).adapter_specs()
        self.adapters = [s.name for s in specs]
        #: adapters with batching keys of their own (model.adapters[i].batching): their policy; the rest share
        self.adapter_policies = {s.name: load_component("batching", str({**batching, **s.batching}["name"]))(
            **{**batching, **s.batching}) for s in specs if s.batching}
        trainer_cfg = TrainerConfig(**as_dict(cfg.get("trainer")))
        self.total_steps = int(trainer_cfg.total_steps)
        self.training_finished = None
        self.checkpoint_every = int(trainer_cfg.checkpoint_every)
        self.keep_checkpoints = int(trainer_cfg.keep_checkpoints)
        self.log_trajectories = max(0, int(trainer_cfg.log_trajectories))
        self.mode = str(trainer_cfg.mode)
        self.max_staleness = int(trainer_cfg.max_staleness)
        self.collapse = trainer_cfg.collapse
        self.alarm = CollapseAlarm(self.collapse)
        self.paused = None
        if self.mode == "async" and not getattr(server.backend, "reports_token_versions", False):
            log.warning("trainer.mode=async with a backend (%s) that does not report per-token policy versions: "
                        "a generation that spans a weight swap is labelled with the version it started with, "
                        "so its staleness is over-stated (tokens may be left out of the loss needlessly)",
                        type(server.backend).__name__)
        # the server's limits (its training config's, applied before this boot step) bound the journal
        self.pool.set_quota(server.max_journal_bytes, server.min_free_disk_bytes)
        if self.metrics is None:
            self.metrics = MetricsWriter(self.run_dir)
        #: a backend with no model (``scripted``): steps run without a trainer and change no weights
        self.noop_steps = self.custom_step is None and not server.backend.trainable
        if self.noop_steps:
            log.warning("backend %s serves no trainable model: training steps are no-ops (the pool, the "
                        "batching policy and the state machine run; no model is loaded, no weights change; "
                        "each step only moves the policy version on)", type(server.backend).__name__)
        elif self.custom_step is None:
            assert self.trainer_factory is not None
            self.trainer = await asyncio.to_thread(self.trainer_factory, cfg, self.run_dir)
            if trainer_cfg.resume and self.trainer.latest_checkpoint() is not None:
                await asyncio.to_thread(self._resume)
            if self.adapters:  # every adapter, also at step 0: the engine serves what the trainer holds
                await self._push_adapters(self.adapters, self.trainer.global_step)
                self.global_step = self.trainer.global_step
            elif self.trainer.global_step > 0:
                await server.backend.update_weights(
                    named_tensors=self.trainer.export_weights(), version=self.trainer.global_step
                )
                self.global_step = self.trainer.global_step
            if (self.collapse.enabled and self.collapse.action == "rollback" and hasattr(self.trainer, "checkpoints")
                    and not self.trainer.checkpoints()):
                # a rollback needs a point to go back to, also before the first periodic checkpoint
                await asyncio.to_thread(self.trainer.save_checkpoint, None, self._checkpoint_extra())
        if self._task is None or self._task.done():
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _resume(self) -> None:
        extra = self.trainer.load_checkpoint()
        if isinstance(extra.get("lr_factor"), int | float) and extra["lr_factor"] != 1 \
                and hasattr(self.trainer, "set_lr_factor"):
            self.trainer.set_lr_factor(float(extra["lr_factor"]))  # lowered by an earlier rollback
        self.rollbacks = int(extra.get("rollbacks") or 0)
        self.alarm.set_warm_entropy(extra.get("warm_entropy"))  # the entropy floor a warm start lowered
        step = self.trainer.global_step
        put_back = self.pool.reset_after(step)
        log.info("resumed at step %d (%d episodes consumed after it went back to the pool; %s)",
                 step, put_back, extra)

    async def before_stop(self) -> None:
        self._stopping = True  # the loop ends at its next turn even if a library lost the cancellation
        for task in (self._training_task, self._task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
        self._training_task = self._task = None
        self.pool.release()
        self._close_trainer()

    def _close_trainer(self) -> None:
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            try:
                trainer.close()
            except Exception:  # noqa: BLE001 - stopping must always succeed
                log.exception("closing the trainer failed")

    async def checkpoint(self, folder_for: Callable[[int], Path]) -> dict[str, Any] | None:
        """Save the trainer into ``folder_for(step)``; None without a trainer.

        Waits for a step under way (and its own checkpoint), then names the folder after the step the
        trainer is at: a checkpoint is never taken of a trainer in the middle of a step, nor named
        after the step before it.
        """
        if self.trainer is None:
            return None
        async with self._trainer_lock:
            step = int(self.trainer.global_step)
            folder = await asyncio.to_thread(self.trainer.save_checkpoint, str(folder_for(step)),
                                             self._checkpoint_extra())
            return {"path": str(folder), "global_step": step}

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while not self._stopping:
            # asyncio.timeout, never asyncio.wait_for: on Python 3.11 wait_for returns normally when the wait it
            # wraps ends in the loop turn its task is cancelled (an episode accepted just before a stop), and this
            # loop ran on with before_stop awaiting it forever (CPython gh-86296, fixed in 3.12)
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            if self._stopping:
                return
            self._wake.clear()
            srv = self.server
            if srv.state.state is not ServerState.ROLLING or self.policy is None:
                continue
            if self.training_in_progress:
                continue  # async: one step at a time; the pool fills meanwhile
            if (self._unrecorded or self._unsynced is not None) and not await self._catch_up():
                continue
            if self._limit_reached() or self.paused is not None:
                continue
            decision = self._decide(srv.clients.all(), time.time())
            if decision.fire and decision.selected and self.mode == "async":
                if self._hold_for_stragglers():
                    continue
                self._start_background_step(decision)
            elif decision.fire and decision.selected:
                try:
                    await self.train_once(decision)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the server keeps running
                    log.exception("training step failed")
                    # back off so a persistent failure does not spin; samples stay in the pool
                    await asyncio.sleep(min(30.0, 0.5 * 2 ** min(self.steps_failed, 6)))

    def _limit_reached(self) -> bool:
        """Whether ``trainer.total_steps`` is reached; the first time, the server says so and refuses
        training episodes from then on."""
        if not (self.total_steps and self.global_step >= self.total_steps):
            return False
        if self.training_finished is None:
            self.training_finished = (f"training finished: trainer.total_steps={self.total_steps} reached; "
                                      "training episodes are refused (eval episodes still run)")
            log.info("%s", self.training_finished)  # the normal end of a run, not a problem
        return True

    async def train_once(self, decision: Any) -> dict[str, float]:
        """One ROLLING → ROLLING_POST → WEIGHT_SYNCING → ROLLING cycle for ``decision`` (sync mode).

        Exactly once: from the moment the trainer has applied the update, the batch is spent. Its
        bookkeeping is written to the journal before the new weights are served (retried; if the
        journal still refuses, the episodes stay out of the pool and the write is retried before
        any further step), and ``global_step`` never goes back.
        """
        srv = self.server
        srv.enter_rolling_post()
        t_drain = time.perf_counter()
        aborted = await srv.drain()
        drain = {"drained_aborted": float(aborted), "drain_s": time.perf_counter() - t_drain}
        srv.enter_weight_syncing()
        try:
            return await self._step(decision, drain)
        finally:
            self.global_step = max(self.global_step, self._applied_step)
            srv.resume_rolling()
            self._limit_reached()

    async def _step(self, decision: Any, extra: dict[str, float]) -> dict[str, float]:
        """Take ``decision``'s batch, train one step on it, journal it, serve the new weights, log it.

        Returns the metrics; ``_applied_step`` is the step the trainer reached (the batch is spent
        from then on, even if something after it fails). Shared by both modes: sync calls it with
        the server drained and calls held (``WEIGHT_SYNCING``), async while the server keeps
        sampling (the engine swaps the weights between two of its steps).
        """
        async with self._trainer_lock:
            return await self._step_locked(decision, extra)

    async def _step_locked(self, decision: Any, extra: dict[str, float]) -> dict[str, float]:
        srv = self.server
        step = self.global_step + 1
        self._applied_step = self.global_step
        filtered = list(decision.detail.get("filtered") or [])
        records = self.pool.take(decision.selected)
        retired = self._records(filtered)  # C3's flat groups: not trained, but part of the collapse signals
        ids = [r.episode_id for r in records]
        metrics: dict[str, float] = {}
        applied = False  # the update is in the trainer: the batch is spent, whatever happens next
        try:
            t0 = time.perf_counter()
            if self.custom_step is not None or self.noop_steps:
                if self.custom_step is not None:
                    result = self.custom_step(records, step)
                    if asyncio.iscoroutine(result):
                        result = await result
                else:
                    result = {"noop_step": 1.0}
                metrics = dict(result or {})
                applied = True
                self._applied_step = step
                await self._journal_step(ids, filtered, step)
                if self.noop_steps:  # no weights: the engine only takes the new version
                    await srv.backend.update_weights(version=step)
                sync_s = 0.0
            else:
                if self.mode == "async":  # tokens staler than the bound are left out of the loss
                    metrics = await asyncio.to_thread(self.trainer.step, records, self.max_staleness)
                else:
                    metrics = await asyncio.to_thread(self.trainer.step, records)
                if self.trainer.global_step == self.global_step and metrics.get("nonfinite_skipped"):
                    # nothing was applied (a non-finite loss or gradient): drop the batch, keep the weights
                    self.pool.mark_filtered(ids, self.global_step)
                    self.last_error = (f"a step on {len(ids)} episodes was skipped: non-finite loss or gradient "
                                       "(the episodes were dropped, the weights are unchanged)")
                    log.warning("%s", self.last_error)
                    applied = True
                    return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
                step = self.trainer.global_step
                applied = True
                self._applied_step = step
                recorded = await self._journal_step(ids, filtered, step)
                t_sync = time.perf_counter()
                await self._sync_weights(step)
                sync_s = time.perf_counter() - t_sync
                if not recorded:
                    metrics["journal_pending"] = 1.0
            metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
            for key, value in metrics.items():  # adapter/<name>/reward_mean: that adapter's last reward
                if key.startswith("adapter/") and key.endswith("/reward_mean"):
                    self._adapter_reward[key[len("adapter/"):-len("/reward_mean")]] = value
            metrics.update(extra)
            metrics.update(
                weight_sync_s=sync_s,
                cycle_time_s=time.perf_counter() - t0,
                pool_left=float(self.pool.stats()["episodes"]),
            )
            metrics.update(step_family_metrics(records))
            metrics.update(srv.eval_tally.take())
            signals = collapse_signals([*records, *retired], metrics)
            metrics.update(signals)
            alarm = self.alarm.observe(step, signals)
            metrics["collapse/alarm"] = 1.0 if alarm is not None or self.alarm.active is not None else 0.0
            self.last_metrics = finite_or_none({"step": step, **metrics})
            self.steps_failed_in_row = 0
            if not self._unrecorded and self._unsynced is None:
                self.last_error = None
            if self.metrics is not None:
                self.metrics.write(step, metrics)
            log.info("%s", step_line(self.last_metrics, trigger=_trigger(self.policy_name, decision)))
            self._notify(step, metrics, sync_s, records[: self.log_trajectories])
            if self.mode == "async":
                # the server never left ROLLING; the step moves on once it is on record
                self.global_step = step
            if alarm is not None and await self._on_alarm(alarm, step):
                return metrics  # rolled back: the step's weights are gone, nothing to checkpoint
            if self.trainer is not None and self.checkpoint_every and step % self.checkpoint_every == 0:
                await asyncio.to_thread(self.trainer.save_checkpoint, None, self._checkpoint_extra())
                await asyncio.to_thread(self.trainer.prune_checkpoints, self._keep())
            return metrics
        except Exception as exc:
            self.steps_failed += 1
            self.steps_failed_in_row += 1
            if self.last_error is None or not applied:
                self.last_error = f"step {step} failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            if not applied:
                self.pool.release(ids)

    # ------------------------------------------------------------------ the collapse alarm
    def _records(self, ids: Sequence[str]) -> list[EpisodeRecord]:
        """The journal records of ``ids`` (those it cannot read are left out)."""
        out = []
        for eid in ids:
            try:
                out.append(self.pool.get(eid))
            except Exception:  # noqa: BLE001 - a signal is never worth a failed step
                continue
        return out

    def _checkpoint_extra(self) -> dict[str, Any]:
        """What a checkpoint keeps of the cycle: the pool position, the learning-rate factor and
        rollbacks so far (a resume keeps the learning rate a rollback lowered), and the entropy the
        warm start ended with (a resume keeps the alarm's lowered floor)."""
        return {"pool": self.pool.stats(), "lr_factor": float(getattr(self.trainer, "lr_factor", 1.0)),
                "rollbacks": self.rollbacks, "warm_entropy": self.alarm.warm_entropy}

    def _keep(self) -> int:
        """Checkpoints to keep: ``trainer.keep_checkpoints``, and with the alarm's rollback at least
        enough to reach back past its window (``patience`` steps) and the weights that sampled it."""
        keep = self.keep_checkpoints
        if keep and self.collapse.enabled and self.collapse.action == "rollback" and self.checkpoint_every:
            reach = int(self.collapse.patience) + 1 + (self.max_staleness if self.mode == "async" else 0)
            keep = max(keep, reach // self.checkpoint_every + 2)
        return keep

    async def _on_alarm(self, alarm: Alarm, step: int) -> bool:
        """Say so, then act (``trainer.collapse.action``); True when the step was rolled back.
        Runs under the trainer lock, right after the step it fired on."""
        action = alarm.action
        why = ""
        if action == "rollback":
            if self.trainer is None or not hasattr(self.trainer, "checkpoints"):
                action, why = "pause", "no trainer that can roll back"
            elif self.rollbacks >= int(self.collapse.max_rollbacks):
                action, why = "pause", f"{self.rollbacks} rollbacks already (trainer.collapse.max_rollbacks)"
            elif self._unrecorded or self._unsynced is not None:
                action, why = "pause", "an earlier step's journal write or weight sync is still pending"
        alarm.extra["taken"] = "pending"  # status shows the alarm at once; the action when it is done
        self.last_alarm = alarm
        log.warning("%s", alarm.message)
        rolled = False
        if action == "rollback":
            rolled, why = await self._rollback(alarm)
            if not rolled:
                action = "pause"
        if action == "pause":
            self.paused = (f"{alarm.message}{'; ' + why if why else ''}: training is paused (episodes are still "
                           "accepted) until POST /api/v1/admin/resume_training")
            log.warning("%s", self.paused)
        alarm.extra["taken"] = action
        if why:
            alarm.extra["note"] = why
        if self.paused:
            self.last_error = self.paused  # training stopped: as loud as a failing journal (cleared on resume)
        if self.metrics is not None:
            self.metrics.write(step, {"alarm": alarm.message, **{f"{k}": v for k, v in alarm.extra.items()
                                                                 if isinstance(v, int | float | str)}}, kind="alarm")
        return rolled

    def _suspect_from(self, window_start: int) -> int:
        """The oldest weights (step) that sampled the episodes of the alarm's window: a step trains on
        episodes the previous step's weights sampled (sync), or weights up to ``max_staleness`` older
        (async). A rollback goes to a checkpoint older than these."""
        return window_start - 1 - (self.max_staleness if self.mode == "async" else 0)

    async def _rollback(self, alarm: Alarm) -> tuple[bool, str]:
        """Load the newest checkpoint taken before the weights that sampled the alarm's window
        (:meth:`_suspect_from`), lower the learning rate by ``lr_factor``, retire what the undone
        weights trained on and sampled, serve the restored weights. (ok, why not)."""
        trainer = self.trainer
        suspect = self._suspect_from(alarm.window_start)
        before = [(s, p) for s, p in await asyncio.to_thread(trainer.checkpoints) if s < suspect]
        if not before:
            return False, (f"no checkpoint before step {suspect} (the weights that sampled step "
                           f"{alarm.window_start}) to roll back to")
        back, folder = before[-1]
        factor = float(getattr(trainer, "lr_factor", 1.0)) * float(self.collapse.lr_factor)
        await asyncio.to_thread(trainer.load_checkpoint, folder)
        set_lr = getattr(trainer, "set_lr_factor", None)
        lowered = bool(await asyncio.to_thread(set_lr, factor)) if set_lr is not None else False
        back = int(trainer.global_step)
        if hasattr(trainer, "discard_checkpoints_after"):
            await asyncio.to_thread(trainer.discard_checkpoints_after, back)
        consumed, waiting = self.pool.retire_after(back)
        self._applied_step = self.global_step = back
        if self.mode == "async":
            self._fence = (time.time(), back)
        await self._sync_weights(back, everything=True)
        self.rollbacks += 1
        self.alarm.reset()
        alarm.extra.update(rolled_back_to=back, lr_factor=factor if lowered else float(getattr(trainer, "lr_factor", 1.0)),
                           retired_episodes=consumed + waiting)
        log.warning("collapse alarm: rolled back to the checkpoint of step %d (%s); learning rate x%g%s; %d episodes "
                    "the undone steps trained on or sampled were retired", back, folder, factor,
                    "" if lowered else " NOT applied (the engine cannot change it at run time)", consumed + waiting)
        return True, "" if lowered else "the engine cannot lower its learning rate at run time"

    # ------------------------------------------------------------------ async mode
    def _start_background_step(self, decision: Any) -> None:
        """Train ``decision``'s batch in the background while the server keeps sampling (async mode)."""
        self._training_since = time.time()
        self._training_task = asyncio.get_running_loop().create_task(self._background_step(decision))

    async def _background_step(self, decision: Any) -> None:
        t0 = time.time()
        try:
            await self._step(decision, {"staleness_bound": float(self.max_staleness), "held_s": self._held_s})
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the server keeps running
            log.exception("training step failed")
            await asyncio.sleep(min(30.0, 0.5 * 2 ** min(self.steps_failed, 6)))
        finally:
            if self._applied_step > self.global_step:  # applied, then failed before serving it
                self.global_step = self._applied_step
            self.last_step_s = time.time() - t0
            self._training_since = None
            self._limit_reached()
            self._wake.set()

    def _hold_for_stragglers(self) -> bool:
        """Async: wait before a step while a running training episode holds tokens the step would
        push past the staleness bound (:func:`~swarmkit.swarm.staleness.holds_step`), for at most
        ``server.drain_timeout_s``; an episode idle for ``server.drain_idle_s`` is not waited for."""
        srv = self.server
        now = time.time()
        oldest: int | None = None
        for ep in srv.episodes.running():
            if ep.eval or srv.abandoned(ep, now):
                continue
            for tl in ep.timelines:
                versions = tl.blocks[-1].versions if tl.blocks else None
                if versions:
                    oldest = min(versions) if oldest is None else min(oldest, min(versions))
        if holds_step(self.global_step, oldest, self.max_staleness):
            if self._held_since is None:
                self._held_since = now
            if now - self._held_since < srv.drain_timeout_s:
                return True
        self._held_s = now - self._held_since if self._held_since is not None else 0.0
        self._held_since = None
        return False

    @property
    def training_in_progress(self) -> bool:
        """A background step is under way (async mode)."""
        return self._training_task is not None and not self._training_task.done()

    def pacing(self, task_id: str | None = None) -> tuple[str, float] | None:
        """Why a new training episode of ``task_id`` must wait, and for about how long (async mode's
        staleness bound); None: admit it. See :func:`swarmkit.swarm.staleness.admission_capacity`.

        An episode that completes a group under way (its task has fewer than
        ``batching.rollouts_per_task`` episodes in flight) is always admitted: holding it back
        would leave its siblings waiting in the pool while other groups train, until their tokens
        are too old.
        """
        if self.mode != "async" or self.policy is None:
            return None
        srv = self.server
        running, waiting = self._flight()
        in_flight = len(running) + len(waiting)
        siblings = 0 if task_id is None else (sum(e.task_id == task_id for e in running)
                                              + sum(e.task_id == task_id for e in waiting))
        if admits(in_flight, self.capacity(), siblings=siblings, group_size=int(self.policy.rollouts_per_task),
                  training=self.training_in_progress, running=len(running)):
            return None
        wait = 1.0
        if self._training_since is not None and self.last_step_s:
            wait = max(0.05, self.last_step_s - (time.time() - self._training_since))
        return (f"staleness bound: {in_flight} training episodes are under way or waiting and the weights "
                f"served (version {srv.policy_version}) may be updated by at most trainer.max_staleness="
                f"{self.max_staleness} more steps before their tokens are too old; retry when the step under "
                "way is done", wait)

    def _flight(self) -> tuple[list[Episode], list[PoolEpisode]]:
        """The training episodes running, and those waiting in the pool (not yet in a step)."""
        return [e for e in self.server.episodes.running() if not e.eval], self.pool.view()

    def in_flight(self) -> int:
        """Training episodes running or waiting in the pool (not yet in a step)."""
        running, waiting = self._flight()
        return len(running) + len(waiting)

    def capacity(self) -> int:
        """How many training episodes may be in flight under the staleness bound."""
        srv = self.server
        per_step = int(self.policy.batch_size) * int(self.policy.rollouts_per_task)
        return admission_capacity(srv.policy_version, self.global_step, self.training_in_progress,
                                  self.max_staleness, per_step)

    def ready_batches(self, limit: int = 8) -> int:
        """Batches the batching policy could release from the pool now (at most ``limit``)."""
        if self.policy is None:
            return 0
        view = self.pool.view()
        clients = self.server.clients.all()
        n = 0
        while n < limit:
            d = self.policy.decide(view, clients, time.time())  # async only: never with model.adapters
            if not (d.fire and d.selected):
                break
            n += 1
            taken = set(d.selected) | set(d.detail.get("filtered") or [])
            view = [e for e in view if e.episode_id not in taken]
        return n

    def trainer_status(self) -> dict[str, Any]:
        """What the trainer is doing, for ``status()["pool"]["trainer"]``."""
        out: dict[str, Any] = {"mode": self.mode, "global_step": self.global_step,
                               "policy_version": self.server.policy_version}
        if self.mode == "async":
            out.update(max_staleness=self.max_staleness, training=self.training_in_progress,
                       training_since=self._training_since, waiting_for_stragglers_since=self._held_since,
                       ready_batches=self.ready_batches(),
                       in_flight=self.in_flight() if self.policy is not None else 0,
                       capacity=self.capacity() if self.policy is not None else 0)
        return out

    async def _journal_step(self, ids: list[str], filtered: list[str], step: int) -> bool:
        """Write that ``step`` trained ``ids`` (and retired ``filtered``), retrying for a few seconds.

        True once it is durable. Otherwise the real error goes to ``last_error``, the episodes
        stay reserved (out of every later batch) and :meth:`_catch_up` retries before the next step.
        """
        delay = 0.05
        for attempt in range(self.journal_attempts):
            try:
                self._record(ids, filtered, step)
                return True
            except Exception as exc:  # noqa: BLE001 - e.g. sqlite3.OperationalError: database or disk is full
                error = exc
                if attempt + 1 < self.journal_attempts:
                    await asyncio.sleep(delay)
                    delay = min(1.0, delay * 2)
        self._unrecorded.append((ids, filtered, step))
        self.last_error = (f"step {step} trained {len(ids)} episodes but the journal could not record it "
                           f"({type(error).__name__}: {error}); they stay out of the pool, no further step "
                           "is trained until the write succeeds (retried)")
        log.error("%s", self.last_error)
        return False

    def _record(self, ids: list[str], filtered: list[str], step: int) -> None:
        """The journal's record of one step: ``ids`` trained, ``filtered`` retired (both repeatable)."""
        self.pool.mark_trained(ids, step)
        if filtered:
            self.pool.mark_filtered(filtered, step)

    async def _sync_weights(self, step: int, everything: bool = False) -> None:
        """Push the trainer's weights into the engine as version ``step`` (retried by :meth:`_catch_up`
        if it fails: the trainer is already at ``step``). With ``model.adapters``: only the adapter the
        step trained (``everything``: all of them, after a rollback)."""
        self._unsynced = step
        if self.adapters:
            last = getattr(self.trainer, "last_adapter", None)
            await self._push_adapters(self.adapters if everything or last is None else [last], step)
        else:
            weights = await asyncio.to_thread(lambda: list(self.trainer.export_weights()))
            await self.server.backend.update_weights(named_tensors=weights, version=step)
        self._unsynced = None

    async def add_adapter(self, spec: AdapterSpec, policy: Any, backend: InferenceBackend) -> None:
        """Train adapter ``spec`` from now on, served by ``backend`` (``policy``: its own batching policy, None =
        the shared one). Under the trainer lock (no step is under way): the trainer adds it (fresh, at step 0),
        the engine serves it and gets its initial LoRA; if serving fails the trainer forgets it again."""
        async with self._trainer_lock:
            if self.trainer is not None:
                await asyncio.to_thread(self.trainer.add_adapter, spec)
            try:
                await backend.add_adapter(spec.name)
                if self.trainer is not None:
                    await self._push_adapters([spec.name], self.global_step)
            except BaseException:
                if self.trainer is not None:
                    await asyncio.to_thread(self.trainer.remove_adapter, spec.name)
                raise
            self.adapters.append(spec.name)
            if policy is not None:
                self.adapter_policies[spec.name] = policy
        log.info("adapter %s added at step %d: it trains from its own batches from now on", spec.name,
                 self.global_step)

    async def _push_adapters(self, names: Sequence[str], step: int) -> None:
        """Serve the trainer's ``names`` adapters, each at its own version; the engine's version is ``step``."""
        backend = self.server.backend
        for name in names:
            lora = await asyncio.to_thread(self.trainer.export_adapter_lora, name)
            await backend.update_adapter(name, lora, version=self.trainer.adapter_step(name), policy_version=step)

    def _decide(self, clients: Any, now: float) -> Any:
        """The batching policy's decision. With ``model.adapters`` it decides over each adapter's episodes
        on their own, the adapter after the last one trained first: a batch never mixes adapters, and an
        adapter whose batch is ready never waits behind another's."""
        if not self.adapters:
            return self._warn_if_held(self.pool.decide(self.policy, clients, now), None)
        view = self.pool.view()
        start = self.adapters.index(self._last_adapter) + 1 if self._last_adapter in self.adapters else 0
        decision = None
        for k in range(len(self.adapters)):
            name = self.adapters[(start + k) % len(self.adapters)]
            mine = [e for e in view if e.adapter == name]
            if not mine:
                continue
            policy = self.adapter_policies.get(name, self.policy)
            decision = self._warn_if_held(policy.decide(mine, dict(clients or {}), now), name)
            if decision.fire and decision.selected:
                decision.detail["adapter"] = name
                self._last_adapter = name
                return decision
        return decision if decision is not None else self.pool.decide(self.policy, clients, now)

    def _warn_if_held(self, decision: Any, adapter: str | None) -> Any:
        """Say (once per stall and adapter) when only ``batching.cocktail`` keeps a batch from
        firing: the pool holds enough, but the shares of the families in it add up to less than one, so
        C1-C3 wait for other families' episodes, maybe forever (one family's client alone, or an adapter
        that only one family trains). Returns ``decision``."""
        if decision.fire:
            self._cocktail_warned.discard(adapter)  # a batch formed: a later stall is told again
        held = decision.detail.get("held_by_cocktail")
        if not held or adapter in self._cocktail_warned:
            return decision
        self._cocktail_warned.add(adapter)
        caps = getattr(self.adapter_policies.get(adapter or "", self.policy), "cocktail", {})
        where = f" (adapter {adapter})" if adapter else ""
        over = sum(held.values())
        log.warning("batching.cocktail holds the batch back%s: %d %s are ready and a batch needs %d, but the caps %s "
                    "let only %d count (%s); it waits for episodes of other families. The shares of the families "
                    "present must add up to at least 1 (docs/batching.md, \"Cocktail limits\")",
                    where, int(decision.current) + over, decision.unit, int(decision.target), caps,
                    int(decision.current), ", ".join(f"{fam!r}: {n} over its cap" for fam, n in sorted(held.items())))
        return decision

    async def _catch_up(self) -> bool:
        """Finish what an earlier step left undone (its journal write, its weight sync); True when
        nothing is left, so the next step may train."""
        if time.monotonic() < self._retry_at:
            return False
        try:
            while self._unrecorded:
                ids, filtered, step = self._unrecorded[0]
                self._record(ids, filtered, step)
                self._unrecorded.pop(0)
                log.info("step %d's %d episodes are now recorded as trained in the journal", step, len(ids))
            if self._unsynced is not None:
                await self._sync_weights(self._unsynced)
        except Exception as exc:  # noqa: BLE001 - keep serving; say why no step trains
            what = "journal write" if self._unrecorded else "weight sync"
            self.last_error = f"the {what} of an earlier step is still failing ({type(exc).__name__}: {exc}); " \
                              "no further step is trained until it succeeds (retried)"
            self._retry_at = time.monotonic() + 2.0
            return False
        return True

    def _notify(self, step: int, metrics: dict[str, float], sync_s: float, records: list[EpisodeRecord]) -> None:
        trajectories = [{"episode_id": r.episode_id, "task_id": r.task_id, "reward": r.reward,
                         "timelines": r.timelines} for r in records]
        try:
            hooks = get_hooks()
            hooks.step_end(step=step, metrics=metrics, run_dir=str(self.run_dir), trajectories=trajectories)
            if self.trainer is not None:
                hooks.weights_synced(step=step, seconds=sync_s)
        except Exception:  # noqa: BLE001
            log.exception("lifecycle hooks failed")

    def close(self) -> None:
        self._close_trainer()
        if self.metrics is not None:
            self.metrics.close()
        self.pool.close()


def _sampled_after(ep: Episode, since: float, step: int) -> bool:
    """Whether ``ep`` was created before ``since`` and holds tokens of weights later than ``step``
    (per-token versions where the engine reports them, else the version it was registered at)."""
    if ep.eval or ep.created >= since:
        return False
    newest = ep.policy_version
    for tl in ep.timelines:
        for b in tl.blocks:
            if b.versions:
                newest = max(newest, max(b.versions))
    return newest > step


def _trigger(policy: str | None, decision: Any) -> str:
    """What fired a step, for its console line: ``c2 2/2 tasks``."""
    current, target, unit = (getattr(decision, k, None) for k in ("current", "target", "unit"))
    fill = f" {current:g}/{target:g} {unit}" if isinstance(current, int | float) and isinstance(target, int | float) else ""
    detail = getattr(decision, "detail", None)
    adapter = f" adapter {detail['adapter']}" if isinstance(detail, dict) and detail.get("adapter") else ""
    return f"{policy or 'policy'}{fill}{adapter}"
