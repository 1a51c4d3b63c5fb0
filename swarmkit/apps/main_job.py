"""The main job, written once; ``mode=local`` and ``launcher=ray`` differ only in their driver.

:func:`run_main_job` runs the job on the servers a :class:`Driver` starts (one
locally, ``ray.servers`` under Ray), each server through the same steps:

1. **boot**: configure it through the controller API with its config, start it,
   wait for ROLLING;
2. **evaluate before**: greedy eval episodes (never trained on) over the
   ``task.eval_size`` held-out tasks;
3. **warm start**: ``task.demonstrations`` > 0 sends that many demonstration
   episodes (the supervised warm start); the first
   :func:`warm_steps` steps train on them alone;
4. **train**: once the warm start's steps are trained (after an evaluation of
   the warm start alone, when there was one) the server's clients start
   sampling; every ``trainer.eval_every`` steps they stop, the server is
   evaluated and they start again, seeded anew (``seed`` + the step); one line
   per training step (``[server k] ...`` when there are several servers); until
   every server has done ``trainer.total_steps`` steps (0: until Ctrl-C, which
   stops everything without the rest);
5. stop the clients, **checkpoint**, **evaluate after**;
6. write ``summary.json`` and print the summary table.

A driver knows only how to start and stop servers and clients, and how to
call boot / warm_start / evaluate / status / metrics / checkpoint on a server:
:class:`~swarmkit.apps.local.LocalDriver` (a server thread and client threads in
this process) and :class:`~swarmkit.apps.ray_launcher.RayDriver` (server and
client actors on a Ray cluster). The flow, the warm-start rule, the eval
schedule and the summary are here. :class:`ServerSession` (a server in a thread
and the controller calls made on it) and :class:`Sampler` (the task client's
training episodes, restartable) are what both drivers run, in this process or
inside an actor.

``summary.json`` in the run folder has the same keys under every driver: the
record of the first server (the only one unless ``ray.servers`` > 1), plus

- ``launcher``: ``"local"`` or ``"ray"``; ``namespace``: the Ray namespace (null locally);
- ``servers``: every server's record, by index.

A server's record (also its own ``summary.json`` where a server has a run
folder of its own: ``server_<k>/`` under Ray):

- ``server``: its index; ``url``: the URL its clients used; ``node_id``: its Ray
  node (null locally); ``run_dir``: its run folder;
- ``eval_before``, ``eval_after``: ``{mean, ci95, n, failures, full_credit, outcomes, groups}`` of the held-out
  reward (``full_credit``: the share of episodes with a fully right answer, where the task has a
  reward scale; null otherwise; ``outcomes``: how many episodes ended which way, where the task
  names it with ``outcome/<kind>`` metrics, e.g. ``multi_calc``'s ``{"overshoot": 9, "right": 5}``;
  empty otherwise; ``groups``: ``{group: {mean, ci95, n}}`` where the task groups its items, e.g.
  ``multi_calc``'s ``"2 steps"`` and ``"3 steps"``; empty otherwise); ``reward_scale``: ``{task, legend, full}``, what the task's reward
  means (:mod:`swarmkit.tasks.rewards`; null for a task without one); ``eval_metrics_before``, ``eval_metrics_after``: ``{metric: {mean, ci95}}``
  (``correct``, ``valid_tool_call``, ``formatted``, ``turns_passed``: ``task_client.EVAL_METRICS``, where the task reports them);
  ``improvement``: after − before;
- ``eval_midway``: ``{step: {mean, ci95, n, failures, full_credit, outcomes, groups, <metric>: {mean, ci95}}}``,
  the evaluations after a warm start and every ``trainer.eval_every`` steps;
- ``eval_falls``: ``[{at, mean, ci95, from, from_mean, from_ci95}]``, each evaluation (midway or after
  training) whose reward fell below the best earlier one (``from``) beyond the 95% interval of the
  difference; the console says so in red when it happens;
- ``demonstrations``: demonstration episodes accepted (the warm start);
- ``global_step``: optimizer steps done; ``replicas``: the server's inference
  replicas (``status.replicas``); ``checkpoint``: the final checkpoint's path;
- ``train_episodes``: training episodes its clients finished; ``clients``:
  ``[{slot, name, replacements, finished, nodes}]``; ``client_replacements``:
  dead client actors replaced (always 0 locally);
- ``collapse_alarm``: ``{fired, rollbacks, paused, entropy_floor, warm_entropy}`` of the server's collapse
  alarm (docs/training.md; ``paused``: why training paused, which ends the run there; ``entropy_floor``: the
  entropy it fired below at the end, lowered after a warm start that ended at ``warm_entropy``);
- ``wall_time_s``: the whole run's wall time.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swarmkit.apps.serve import start_server_thread
from swarmkit.apps.task_client import (
    EpisodeResult,
    EvalResult,
    TrainingClient,
    evaluate,
    send_demonstrations,
)
from swarmkit.client import SwarmClient
from swarmkit.config.validate import to_dict
from swarmkit.procs import port_free
from swarmkit.swarm.collapse import held_out_fall
from swarmkit.swarm.metrics import read_metrics, step_line
from swarmkit.tasks import make_tasks
from swarmkit.tasks.rewards import full_credit, reward_scale

#: the job's console (soft wrap: a line piped to a file is never cut at 80 columns); drivers print through it
console = Console(soft_wrap=True)

#: seconds between two polls of the servers' state while training; between two checks of the clients
POLL_S, CHECK_CLIENTS_S = 0.5, 2.0
#: training steps failing in a row (the server retries each with a growing back-off) that end the run: a
#: persistent failure (out of memory, a broken plugin) would otherwise keep the job waiting forever
MAX_FAILED_STEPS_IN_ROW = 3

T = TypeVar("T")
log = logging.getLogger(__name__)


class JobError(RuntimeError):
    """The job cannot go on (a server went OFFLINE, a driver lost a server: the message says why)."""


def say(text: str) -> None:
    """One plain line on the job's console (no markup: ``[server 0]`` is text), above a progress bar."""
    console.print(text, markup=False, highlight=False)


def warm_steps(cfg: Any, demonstrations: int) -> int:
    """The warm-start rule: the first steps train on the ``demonstrations`` alone (a batch is
    ``batch_size`` groups of ``rollouts_per_task``); sampling starts once they are done, as earlier
    episodes would come from the untrained policy."""
    batching = cfg.batching
    return demonstrations // max(1, int(batching.batch_size) * int(batching.rollouts_per_task))


# --------------------------------------------------------------------------- what the drivers run
class ServerSession:
    """A swarm server in a thread of this process (OFFLINE until :meth:`boot`) and the controller
    calls the main job makes on it (over loopback HTTP). Locally the driver holds one; under Ray it
    is the server actor."""

    def __init__(self, cfg: DictConfig, index: int = 0, *, client_id: str | None = None):
        self.index = index
        self.cfg = cfg
        host, port = str(cfg.server.host), int(cfg.server.port)
        if port and not port_free(host, port):
            say(f"port {port} is taken: using a free port")
            cfg.server.port = 0
        self.handle = start_server_thread(cfg)
        self.ctl = SwarmClient(self.handle.url, token=self.handle.admin_token, retry_for=3600, client_id=client_id)
        task = cfg.task
        self.eval_tasks = make_tasks(task.name, task.eval_size, seed=task.seed, split="eval",
                                     options=dict(task.options))

    def boot(self, timeout: float = 3600.0) -> dict[str, Any]:
        """Configure (the config this session was built with) and start; returns once ROLLING."""
        self.ctl.configure(to_dict(self.cfg))
        self.ctl.start()
        return self.ctl.wait_for_state("ROLLING", timeout=timeout)

    def warm_start(self) -> int:
        """Send ``task.demonstrations`` demonstration episodes (the supervised warm start); how many
        were accepted."""
        task = self.cfg.task
        if int(task.demonstrations) <= 0:
            return 0
        demos = make_tasks(task.name, int(task.demonstrations), seed=task.seed + 1, split="demo",
                           options=dict(task.options))
        # one after another, in order: the same supervised batches every run (send_demonstrations)
        return send_demonstrations(self.ctl, demos, group_size=int(self.cfg.batching.rollouts_per_task))

    def evaluate(self) -> EvalResult:
        """Greedy reward on the held-out tasks (eval episodes: never trained on)."""
        task = self.cfg.task
        result = evaluate(self.ctl, self.eval_tasks, max_tokens=int(task.max_tokens),
                          concurrency=int(task.concurrency))
        self.handle.swarm.record_eval()  # the round's rewards go to metrics.jsonl at the step they were taken
        return result

    def status(self) -> dict[str, Any]:
        return self.ctl.status()

    def metrics(self, after_step: int) -> list[dict[str, Any]]:
        """The training steps' metrics rows after ``after_step`` (from the server's ``metrics.jsonl``)."""
        return [r for r in read_metrics(self.cfg.server.run_dir)
                if r.get("kind", "train") == "train" and int(r.get("step") or 0) > after_step]

    def checkpoint(self) -> dict[str, Any]:
        return self.ctl.checkpoint()

    def shutdown(self) -> None:
        """Stop the server (it frees its engine and trainer) and its HTTP thread."""
        try:
            self.ctl.stop()
        except Exception as exc:  # noqa: BLE001 - shutting down whatever state it is in
            log.warning("server %d: stop failed: %s", self.index, exc)
        self.handle.stop()


class Sampler:
    """The built-in task client's training episodes against one server (``task.concurrency`` at a
    time), started with a seed, stopped, started again with another; counts over every start."""

    def __init__(self, client: SwarmClient, cfg: Any,
                 on_result: Callable[[EpisodeResult], None] | None = None):
        task, batching = cfg["task"], cfg["batching"]
        self.client = client
        self.on_result = on_result
        self.tasks = make_tasks(task["name"], int(task["train_size"]), seed=int(task["seed"]), split="train",
                                options=dict(task["options"]))
        self.rollouts_per_task = int(batching["rollouts_per_task"])
        self.max_tokens, self.temperature = int(task["max_tokens"]), float(task["temperature"])
        self.concurrency = int(task["concurrency"])
        self.loop: TrainingClient | None = None
        self._lock = threading.Lock()
        self._finished = self._failures = 0

    def start(self, seed: int) -> Sampler:
        self.stop()
        self.loop = TrainingClient(
            self.client, self.tasks, rollouts_per_task=self.rollouts_per_task, max_tokens=self.max_tokens,
            temperature=self.temperature, concurrency=self.concurrency, seed=seed, on_result=self.on_result,
        )
        self.loop.start()
        return self

    def stop(self, *, abandon: bool = False) -> None:
        """No new episode (a running one finishes or is abandoned when the loop's thread is joined).

        ``abandon``: the job is over (its server may be gone): running episodes give up at once instead of
        retrying for the client's ``retry_for`` (an hour), which would hold the process's exit; the client is
        closed, so the sampler cannot start again."""
        loop = self.loop
        if abandon:
            if loop is not None:
                loop.stop_event.set()
            self.client.close()
        if loop is not None:
            loop.stop()
            with self._lock:
                self._finished += loop.finished
                self._failures += loop.failures
                self.loop = None

    @property
    def sampling(self) -> bool:
        loop = self.loop
        return loop is not None and not loop.stop_event.is_set()

    @property
    def finished(self) -> int:
        with self._lock:
            return self._finished + (self.loop.finished if self.loop else 0)

    @property
    def failures(self) -> int:
        with self._lock:
            return self._failures + (self.loop.failures if self.loop else 0)

    @property
    def last_error(self) -> str:
        loop = self.loop
        return loop.last_error if loop else ""


# --------------------------------------------------------------------------- the driver protocol
@dataclass
class ServerInfo:
    """A server a driver started: its index, its validated config and where its clients reach it."""

    index: int
    cfg: DictConfig
    url: str
    node_id: str | None = None


class Driver(Protocol):
    """How the main job's servers and clients are started, stopped and called (``k``: a server's index).

    The flow calls one server's methods from one thread at a time, different servers' from
    different threads at once. Errors raise: the flow stops and :meth:`stop` tears down."""

    #: ``summary.json``'s ``launcher``
    launcher: str
    #: ``summary.json``'s ``namespace`` (the Ray namespace; None locally)
    namespace: str | None

    def start(self) -> list[ServerInfo]:
        """Start the servers (OFFLINE, not configured yet)."""
        ...

    def boot(self, k: int) -> None:
        """Configure server ``k`` with its config and start it; return once it is ROLLING."""
        ...

    def warm_start(self, k: int) -> int:
        """Send server ``k`` its demonstrations; how many it accepted."""
        ...

    def evaluate(self, k: int) -> EvalResult:
        ...

    def status(self, k: int) -> dict[str, Any]:
        ...

    def metrics(self, k: int, after_step: int) -> list[dict[str, Any]]:
        """Server ``k``'s training steps' metrics rows after step ``after_step``."""
        ...

    def checkpoint(self, k: int) -> dict[str, Any]:
        ...

    def start_clients(self, k: int, seed: int) -> None:
        """Start (or start again) server ``k``'s clients sampling training episodes, seeded from ``seed``."""
        ...

    def stop_clients(self, k: int) -> None:
        """Stop server ``k``'s clients sampling (they may start again)."""
        ...

    def check_clients(self, k: int) -> None:
        """Called every ``CHECK_CLIENTS_S`` (2 s) while server ``k``'s clients sample: notice (and replace) dead ones."""
        ...

    def clients(self, k: int) -> list[dict[str, Any]]:
        """Server ``k``'s clients as far as known: ``{slot, name, replacements, finished, nodes}`` each."""
        ...

    def stop(self) -> None:
        """Stop every client and server (whatever state they are in) and release what was placed."""
        ...


# --------------------------------------------------------------------------- the flow
class _Call(Generic[T]):
    """``fn()`` in a daemon thread (a Ctrl-C never waits for it); :meth:`get` its result or error."""

    def __init__(self, fn: Callable[[], T]):
        self._result: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to get()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def get(self) -> T:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


def _each(runs: Sequence[_Run], fn: Callable[[int], T]) -> list[T]:
    """``fn(k)`` for every server at once; the results by server (the first error raises)."""
    if len(runs) == 1:
        return [fn(runs[0].index)]
    calls = [_Call(partial(fn, r.index)) for r in runs]
    return [c.get() for c in calls]


@dataclass
class _Midway:
    """An evaluation under way while the server's clients are stopped."""

    call: _Call[EvalResult]
    step: int
    label: str
    #: the clients' seed when they start again
    seed: int


@dataclass
class _Run:
    """The flow's view of one server."""

    info: ServerInfo
    prefix: str = ""
    before: EvalResult | None = None
    after: EvalResult | None = None
    demos: int = 0
    warm_steps: int = 0
    step: int = 0
    seen: int = 0
    state: str = "OFFLINE"
    last_error: str = ""
    #: the collapse alarm paused training (``trainer.collapse.action=pause``, or a rollback that could not
    #: roll back): nobody resumes a main job's server, so its run ends there, evaluated as it is
    paused: str = ""
    started: bool = False
    sampling: bool = False
    next_eval: int = 0
    midway: dict[int, EvalResult] = field(default_factory=dict)
    #: what each midway evaluation was ("after the warm start (step 8)", "at step 12"), by step
    labels: dict[int, str] = field(default_factory=dict)
    #: evaluations whose reward fell below an earlier one beyond both intervals (``eval_falls`` of the summary)
    falls: list[dict[str, Any]] = field(default_factory=list)
    pending: _Midway | None = None

    @property
    def index(self) -> int:
        return self.info.index

    @property
    def cfg(self) -> DictConfig:
        return self.info.cfg


def run_main_job(driver: Driver, cfg: DictConfig) -> int:
    """The main job (see the module docstring) on ``driver``'s servers; the exit status."""
    t0 = time.time()
    run_dir = Path(str(cfg.server.run_dir))
    total, eval_every = int(cfg.trainer.total_steps), int(cfg.trainer.eval_every)
    runs: list[_Run] = []
    try:
        runs = [_Run(info) for info in driver.start()]
        for r in runs:
            r.prefix = f"[server {r.index}] " if len(runs) > 1 else ""
        with console.status(f"BOOTING: loading {cfg.model.name} ({cfg.model.path}) and the trainer..."):
            _each(runs, driver.boot)
        with console.status(f"evaluating on {int(cfg.task.eval_size)} held-out tasks (greedy)..."):
            before = _each(runs, driver.evaluate)
        for r, result in zip(runs, before, strict=True):
            r.before = result
            say(f"{r.prefix}eval reward before training: {result}{_full_credit_text(r.cfg, result)}")
        legend = reward_scale(str(cfg.task.name))
        if legend is not None:
            say(f"reward of {cfg.task.name}: {legend.legend}")
        if any(int(r.cfg.task.demonstrations) > 0 for r in runs):
            with console.status("supervised warm start: sending demonstrations..."):
                demos = _each(runs, driver.warm_start)
            for r, n in zip(runs, demos, strict=True):
                r.demos, r.warm_steps = n, warm_steps(r.cfg, n)
                if n:
                    say(f"{r.prefix}supervised warm start: {n} demonstrations in the pool, "
                        f"{r.warm_steps} steps trained before RL episodes")
                    if total and r.warm_steps >= total:
                        say(f"{r.prefix}warning: {r.warm_steps} warm-start steps >= trainer.total_steps={total} "
                            f"leaves no RL step; raise trainer.total_steps above {r.warm_steps} for RL")
        _train(driver, runs, total, eval_every)
        _each(runs, driver.stop_clients)
        checkpoints = _each(runs, driver.checkpoint)
        with console.status("evaluating after training..."):
            after = _each(runs, driver.evaluate)
        for r, result in zip(runs, after, strict=True):
            r.after = result
            if len(runs) > 1:
                say(f"{r.prefix}eval reward after training: {result}{_full_credit_text(r.cfg, result)}")
            _check_fall(r, "after training", result)
        statuses = _each(runs, driver.status)
        clients = [driver.clients(r.index) for r in runs]
    finally:
        driver.stop()
    wall = time.time() - t0
    records = [server_record(r, st, ck, cl, wall)
               for r, st, ck, cl in zip(runs, statuses, checkpoints, clients, strict=True)]
    write_summary(run_dir, driver, records, [r.info for r in runs])
    console.print(summary_table(records, [r.after for r in runs if r.after], [r.before for r in runs if r.before]))
    return 0


def _train(driver: Driver, runs: list[_Run], total: int, eval_every: int) -> None:
    """Start each server's clients after its warm start, evaluate every ``eval_every`` steps, print every
    step's line; until every server reached ``total`` steps."""
    last_check = time.monotonic()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        bars = [progress.add_task("training steps", total=total or None) for _ in runs]
        while True:
            for r, bar in zip(runs, bars, strict=True):
                _poll(driver, r)
                _schedule(driver, r, total, eval_every)
                episodes = sum(int(c["finished"]) for c in driver.clients(r.index))
                progress.update(bar, completed=r.step,
                                description=f"{escape(r.prefix)}{r.state:<14} episodes {episodes:>5}")
            if time.monotonic() - last_check > CHECK_CLIENTS_S:
                for r in runs:
                    if r.sampling and (not total or r.step < total):
                        driver.check_clients(r.index)
                last_check = time.monotonic()
            if all((r.paused or (total and r.step >= total)) and r.pending is None for r in runs):
                return
            time.sleep(POLL_S)


def _poll(driver: Driver, r: _Run) -> None:
    """The server's state and every new step's line (steps taken between two polls included)."""
    status = driver.status(r.index)
    pool = status.get("pool") or {}
    last = pool.get("last_step")
    rows = driver.metrics(r.index, r.seen) if last and int(last["step"]) > r.seen else []
    fill = pool.get("fill")
    for row in rows:  # the pool's fill is the current one: shown on the newest step's line
        say(r.prefix + step_line(row, pool=f"{fill['current']:g}/{fill['target']:g} {fill['unit']}"
                                 if fill and row is rows[-1] else None))
    r.seen = max([r.seen, *(int(x["step"]) for x in rows)])
    r.step, r.state = int(status["global_step"]), str(status["state"])
    error = str(pool.get("last_error") or "")
    if error and error != r.last_error:
        console.print(f"{escape(r.prefix)}[red]{escape(error)}[/]", highlight=False)
    r.last_error = error
    paused = str((pool.get("alarm") or {}).get("paused") or "")
    if paused and not r.paused:
        console.print(f"{escape(r.prefix)}[red]training paused at step {r.step}: the run ends here and is "
                      "evaluated as it is[/]", highlight=False)
    r.paused = paused
    if r.state == "OFFLINE":
        raise JobError(f"{r.prefix}the server went OFFLINE: {status.get('last_error')}")
    failing = int(pool.get("steps_failed_in_row") or 0)
    if failing >= MAX_FAILED_STEPS_IN_ROW:
        raise JobError(f"{r.prefix}training failed {failing} steps in a row; the run stops: {error or 'see the log'}")


def _schedule(driver: Driver, r: _Run, total: int, eval_every: int) -> None:
    """The eval schedule: clients start once the warm start's steps are trained (after evaluating the
    warm start alone, when there was one); every ``eval_every`` steps they stop for an evaluation."""
    if r.pending is not None:
        if not r.pending.call.done():
            return
        done, r.pending = r.pending, None
        r.midway[done.step] = result = done.call.get()
        r.labels[done.step] = done.label
        say(f"{r.prefix}eval reward {done.label}: {result}")
        _check_fall(r, done.label, result)
        _start_clients(driver, r, done.seed, eval_every)
    elif not r.started and r.step >= r.warm_steps:
        if r.demos:  # the warm start alone, before any sampled episode
            _begin_eval(driver, r, f"after the warm start (step {r.step})", int(r.cfg.seed))
        else:
            _start_clients(driver, r, int(r.cfg.seed), eval_every)
    elif r.sampling and eval_every and r.step >= r.next_eval and (not total or r.step < total):
        driver.stop_clients(r.index)  # no sampling while evaluating (steps already released may still run)
        r.sampling = False
        _begin_eval(driver, r, f"at step {r.step}", int(r.cfg.seed) + r.step)


def _check_fall(r: _Run, label: str, result: EvalResult) -> None:
    """Warn, in red, when ``result`` (the evaluation ``label``) fell below the best earlier evaluation of ``r``
    beyond the interval of the difference (:func:`~swarmkit.swarm.collapse.held_out_fall`): the collapse alarm
    watches each step's rollouts and misses a policy that narrows or dips while its entropy stays up."""
    earlier = [("before training", r.before)] + [(r.labels.get(s, f"at step {s}"), v) for s, v in r.midway.items()
                                                 if v is not result]
    known = [(name, e) for name, e in earlier if e is not None]
    if not known:
        return
    best_label, best = max(known, key=lambda pair: pair[1].mean)
    fall = held_out_fall((best.mean, best.ci95), (result.mean, result.ci95))
    if fall is None:
        return
    r.falls.append({"at": label, "mean": result.mean, "ci95": result.ci95,
                    "from": best_label, "from_mean": best.mean, "from_ci95": best.ci95})
    console.print(f"{escape(r.prefix)}[red]held-out reward {escape(label)}, {result.mean:.3f} ± {result.ci95:.3f}, "
                  f"fell below {escape(best_label)}'s {best.mean:.3f} ± {best.ci95:.3f}, beyond both intervals: "
                  "training is losing what the model could do (docs/agents.md, \"When the held-out reward "
                  "falls\")[/]", highlight=False)


def _begin_eval(driver: Driver, r: _Run, label: str, seed: int) -> None:
    k = r.index
    r.pending = _Midway(_Call(lambda: driver.evaluate(k)), r.step, label, seed)


def _start_clients(driver: Driver, r: _Run, seed: int, eval_every: int) -> None:
    driver.start_clients(r.index, seed)
    r.started = r.sampling = True
    r.next_eval = r.step + eval_every


# --------------------------------------------------------------------------- the summary
def _full_credit(cfg: Any, result: EvalResult) -> tuple[int, int] | None:
    """Episodes of ``result`` with a fully right answer, of how many (None: no scale, or no rewards kept)."""
    scale = reward_scale(str(cfg.task.name))
    return full_credit(result.rewards, scale) if scale is not None and result.rewards else None


def _full_credit_text(cfg: Any, result: EvalResult) -> str:
    fc = _full_credit(cfg, result)
    return "" if fc is None else f"; fully right {fc[0]}/{fc[1]} ({fc[0] / max(1, fc[1]):.0%})"


def _eval(result: EvalResult, cfg: Any) -> dict[str, Any]:
    fc = _full_credit(cfg, result)
    return {"mean": result.mean, "ci95": result.ci95, "n": result.n, "failures": result.failures,
            "full_credit": None if fc is None else fc[0] / max(1, fc[1]), "outcomes": result.outcomes,
            "groups": {g: {"mean": m, "ci95": c, "n": n} for g, (m, c, n) in result.groups.items()}}


def _reward_scale(cfg: Any) -> dict[str, Any] | None:
    scale = reward_scale(str(cfg.task.name))
    return None if scale is None else {"task": str(cfg.task.name), "legend": scale.legend, "full": scale.full}


def _eval_metrics(result: EvalResult) -> dict[str, dict[str, float]]:
    return {k: {"mean": m, "ci95": c} for k, (m, c) in result.metrics.items()}


def server_record(r: _Run, status: dict[str, Any], checkpoint: dict[str, Any], clients: list[dict[str, Any]],
                  wall: float) -> dict[str, Any]:
    """One server's record of ``summary.json`` (its keys: the module docstring)."""
    assert r.before is not None and r.after is not None
    trainer = checkpoint.get("trainer")
    return {
        "server": r.index,
        "url": r.info.url,
        "node_id": r.info.node_id,
        "run_dir": str(r.cfg.server.run_dir),
        "eval_before": _eval(r.before, r.cfg),
        "eval_after": _eval(r.after, r.cfg),
        "reward_scale": _reward_scale(r.cfg),
        "improvement": r.after.mean - r.before.mean,
        "eval_metrics_before": _eval_metrics(r.before),
        "eval_metrics_after": _eval_metrics(r.after),
        "eval_midway": {str(step): {**_eval(v, r.cfg), **_eval_metrics(v)} for step, v in r.midway.items()},
        "eval_falls": r.falls,
        "demonstrations": r.demos,
        "global_step": status["global_step"],
        "replicas": status.get("replicas"),
        "checkpoint": trainer.get("path") if isinstance(trainer, dict) else None,
        "train_episodes": sum(int(c["finished"]) for c in clients),
        "clients": clients,
        "client_replacements": sum(int(c["replacements"]) for c in clients),
        "collapse_alarm": {k: (status.get("pool") or {}).get("alarm", {}).get(k)
                           for k in ("fired", "rollbacks", "paused", "entropy_floor", "warm_entropy")},
        "wall_time_s": wall,
    }


def write_summary(run_dir: Path, driver: Driver, records: list[dict[str, Any]],
                  servers: list[ServerInfo]) -> dict[str, Any]:
    """``run_dir/summary.json`` (and each server's own, where it has a run folder of its own)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for record, info in zip(records, servers, strict=True):
        folder = Path(str(info.cfg.server.run_dir))
        if folder.resolve() != run_dir.resolve():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "summary.json").write_text(json.dumps(record, indent=2))
    summary = {**records[0], "launcher": driver.launcher, "namespace": driver.namespace, "servers": records}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summary_table(records: list[dict[str, Any]], after: list[EvalResult], before: list[EvalResult]) -> Table:
    """The console's summary: a column per server."""
    table = Table(title="swarmkit run summary")
    table.add_column("metric")
    for rec in records:
        table.add_column("value" if len(records) == 1 else f"server {rec['server']}")

    def row(name: str, values: list[str]) -> None:
        table.add_row(name, *values)

    row("eval reward before", [str(b) for b in before])
    row("eval reward after", [str(a) for a in after])
    if any(rec["reward_scale"] for rec in records):
        row("reward scale", [rec["reward_scale"]["legend"] if rec["reward_scale"] else "-" for rec in records])
        row("eval fully right (before -> after)", [
            "-" if rec["eval_before"]["full_credit"] is None or rec["eval_after"]["full_credit"] is None else
            f"{rec['eval_before']['full_credit']:.0%} -> {rec['eval_after']['full_credit']:.0%}" for rec in records])
    for key in dict.fromkeys(k for a in after for k in a.metrics):
        cells = []
        for a, b in zip(after, before, strict=True):
            m, c = a.metrics.get(key, (float("nan"), 0.0))
            b_m, b_c = b.metrics.get(key, (float("nan"), 0.0))
            cells.append(f"{b_m:.3f} ± {b_c:.3f} -> {m:.3f} ± {c:.3f}")
        row(f"eval {key}", cells)
    if any(rec["demonstrations"] for rec in records):
        row("demonstrations (warm start)", [str(rec["demonstrations"]) for rec in records])
    row("optimizer steps", [str(rec["global_step"]) for rec in records])
    row("training episodes", [str(rec["train_episodes"]) for rec in records])
    if any(rec["client_replacements"] for rec in records):
        row("client replacements", [str(rec["client_replacements"]) for rec in records])
    row("wall time", [f"{rec['wall_time_s']:.0f} s" for rec in records])
    row("run folder", [rec["run_dir"] for rec in records])
    return table
