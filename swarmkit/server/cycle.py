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

The step itself is pluggable: ``TrainingCycle(server, step_fn=...)`` with
``step_fn(records, step) -> metrics`` replaces the built-in trainer (tests,
custom trainers); by default a :class:`swarmkit.trainer.Trainer` is built
from the config at boot and its weights are synced after each step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmkit.metrics import MetricsWriter
from swarmkit.pool import SamplePool
from swarmkit.server.app import SwarmServer, _plain, pool_record
from swarmkit.server.state import ServerState

log = logging.getLogger("swarmkit.cycle")

StepFn = Callable[[Sequence[Any], int], dict[str, float]]
JOURNAL_FILE = "journal.sqlite"


class TrainingCycle:
    """Owns the pool, the batching policy and the trainer of one :class:`SwarmServer`.

    :param server: the server to drive (its ``run_dir`` holds the journal).
    :param step_fn: optional replacement for the trainer's step (no weight sync then).
    :param poll_s: how often the policy is asked when nothing new arrived
        (C4/C5 depend on time: clients drop out of the active window).
    """

    def __init__(self, server: SwarmServer, *, step_fn: StepFn | None = None, poll_s: float = 0.2):
        if server.run_dir is None:
            raise ValueError("the training cycle needs server.run_dir for its journal")
        self.server = server
        self.run_dir = Path(server.run_dir)
        self.pool = SamplePool(self.run_dir / JOURNAL_FILE)
        self.custom_step = step_fn
        self.poll_s = poll_s
        self.policy: Any = None
        self.policy_name = ""
        self.trainer: Any = None
        self.metrics: MetricsWriter | None = None
        self.last_metrics: dict[str, float] = {}
        self.last_error: str | None = None
        self.steps_failed = 0
        self.total_steps = 0
        self.checkpoint_every = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        server.on_episode_accepted = self._accept
        server.pool_status = self.status
        server.checkpoint_fn = self._checkpoint
        server.after_boot = self._after_boot
        server.before_stop = self._before_stop

    # ------------------------------------------------------------------ server seams
    def _accept(self, ep: Any) -> None:
        """Journal the episode (durable) before its reporter is answered."""
        self.pool.add(pool_record(ep))
        self._wake.set()

    def status(self) -> dict[str, Any]:
        stats = self.pool.stats(self.policy, self.server.clients.active(), time.time()) if self.policy else self.pool.stats()
        stats["policy"] = self.policy_name or None
        if self.last_error:
            stats["last_error"] = self.last_error
        if self.last_metrics:
            stats["last_step"] = self.last_metrics
        return stats

    async def _after_boot(self, server: SwarmServer) -> None:
        from swarmkit.plugins import get_registry

        cfg = _plain(server.config)
        batching = dict(cfg["batching"])
        self.policy_name = str(batching.get("name"))
        cls = get_registry().get("batching", self.policy_name).load()
        self.policy = cls(**batching)
        trainer_cfg = cfg.get("trainer", {})
        self.total_steps = int(trainer_cfg.get("total_steps", 0) or 0)
        self.checkpoint_every = int(trainer_cfg.get("checkpoint_every", 0) or 0)
        if self.metrics is None:
            self.metrics = MetricsWriter(self.run_dir)
        if self.custom_step is None:
            self.trainer = await asyncio.to_thread(self._build_trainer, cfg)
            if trainer_cfg.get("resume") and self.trainer.latest_checkpoint() is not None:
                await asyncio.to_thread(self._resume)
            if self.trainer.global_step > 0:
                await server.backend.update_weights(
                    named_tensors=self.trainer.export_weights(), version=self.trainer.global_step
                )
                server.global_step = self.trainer.global_step
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _build_trainer(self, cfg: dict[str, Any]) -> Any:
        from swarmkit.trainer import Trainer

        return Trainer(cfg["model"], cfg["optim"], cfg["algo"], match=cfg["match"],
                       run_dir=self.run_dir, seed=int(cfg.get("seed", 0)))

    def _resume(self) -> None:
        extra = self.trainer.load_checkpoint()
        step = self.trainer.global_step
        put_back = self.pool.reset_after(step)
        log.info("resumed at step %d (%d episodes consumed after it went back to the pool; %s)",
                 step, put_back, extra)

    async def _before_stop(self, server: SwarmServer) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._task = None
        self.pool.release()
        self._close_trainer()

    def _close_trainer(self) -> None:
        trainer, self.trainer = self.trainer, None
        if trainer is not None:
            try:
                trainer.close()
            except Exception:  # noqa: BLE001 - stopping must always succeed
                log.exception("closing the trainer failed")

    def _checkpoint(self, server: SwarmServer, path: str) -> dict[str, Any]:
        if self.trainer is None:
            return {"note": "no built-in trainer (custom step function): nothing to save"}
        folder = self.trainer.save_checkpoint(extra={"pool": self.pool.stats()})
        return {"path": str(folder), "global_step": self.trainer.global_step}

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_s)
            except TimeoutError:
                pass
            self._wake.clear()
            srv = self.server
            if srv.state.state is not ServerState.ROLLING or self.policy is None:
                continue
            if self.total_steps and srv.global_step >= self.total_steps:
                continue
            decision = self.pool.decide(self.policy, srv.clients.active(), time.time())
            if decision.fire and decision.selected:
                try:
                    await self.train_once(decision)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the server keeps running
                    log.exception("training step failed")
                    # back off so a persistent failure does not spin; samples stay in the pool
                    await asyncio.sleep(min(30.0, 0.5 * 2 ** min(self.steps_failed, 6)))

    async def train_once(self, decision: Any) -> dict[str, float]:
        """One ROLLING → ROLLING_POST → WEIGHT_SYNCING → ROLLING cycle for ``decision``."""
        srv = self.server
        step = srv.global_step + 1
        srv.enter_rolling_post()
        aborted = await srv.drain()
        srv.enter_weight_syncing()
        filtered = list(decision.detail.get("filtered") or [])
        records = self.pool.take(decision.selected)
        ids = [r.episode_id for r in records]
        metrics: dict[str, float] = {}
        ok = False
        try:
            t0 = time.perf_counter()
            if self.custom_step is not None:
                result = self.custom_step(records, step)
                if asyncio.iscoroutine(result):
                    result = await result
                metrics = dict(result or {})
                sync_s = 0.0
            else:
                metrics = await asyncio.to_thread(self.trainer.step, records)
                step = self.trainer.global_step
                t_sync = time.perf_counter()
                weights = await asyncio.to_thread(lambda: list(self.trainer.export_weights()))
                await srv.backend.update_weights(named_tensors=weights, version=step)
                sync_s = time.perf_counter() - t_sync
            self.pool.mark_trained(ids, step)
            if filtered:
                self.pool.mark_filtered(filtered, step)
            ok = True
            metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
            metrics.update(
                weight_sync_s=sync_s,
                cycle_time_s=time.perf_counter() - t0,
                drained_aborted=float(aborted),
                pool_left=float(self.pool.stats()["episodes"]),
            )
            self.last_metrics = {"step": step, **metrics}
            self.last_error = None
            if self.metrics is not None:
                self.metrics.write(step, metrics)
            self._notify(step, metrics, sync_s)
            if self.trainer is not None and self.checkpoint_every and step % self.checkpoint_every == 0:
                await asyncio.to_thread(self.trainer.save_checkpoint, None, {"pool": self.pool.stats()})
            return metrics
        except Exception as exc:
            self.steps_failed += 1
            self.last_error = f"step {step} failed: {type(exc).__name__}: {exc}"
            raise
        finally:
            if not ok:
                self.pool.release(ids)
                step = srv.global_step
            srv.resume_rolling(step)

    def _notify(self, step: int, metrics: dict[str, float], sync_s: float) -> None:
        try:
            from swarmkit.plugins import get_hooks

            hooks = get_hooks()
            hooks.step_end(step=step, metrics=metrics)
            if self.trainer is not None:
                hooks.weights_synced(step=step, seconds=sync_s)
        except Exception:  # noqa: BLE001
            log.exception("lifecycle hooks failed")

    def close(self) -> None:
        self._close_trainer()
        if self.metrics is not None:
            self.metrics.close()
        self.pool.close()
