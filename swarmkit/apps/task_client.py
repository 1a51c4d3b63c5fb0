"""The built-in example swarm client: runs a task's episodes and reports rewards.

Plain HTTP to the episode's OpenAI-compatible ``base_url`` (httpx only, no
torch), so it runs on any laptop: ``python -m swarmkit.apps.task_client --url
http://127.0.0.1:8000 --token ...``. The main job (``python -m swarmkit``)
runs it in threads next to a local server.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import httpx

from swarmkit.client.sdk import SwarmAPIError, SwarmClient, SwarmError
from swarmkit.tasks import Task, cycle, demonstration, make_tasks, run_task

log = logging.getLogger(__name__)

#: a failed episode is logged at WARNING the first time, then at most once per this many seconds (with how
#: many failed meanwhile, each at DEBUG): a server that stays busy does not print a line per episode
FAILURE_NOTE_S = 60.0
#: the per-episode task metrics an evaluation averages (with intervals), when the task reports them
EVAL_METRICS = ("correct", "valid_tool_call", "formatted", "turns_passed")
#: the metric prefix a task names how an episode ended with (``outcome/<kind>`` = 1.0, e.g. multi_calc's)
OUTCOME_PREFIX = "outcome/"


@dataclass
class EpisodeResult:
    task_id: str
    reward: float
    completion: str
    eval: bool
    metrics: dict[str, float] = field(default_factory=dict)
    episode_id: str = ""
    #: the server acknowledged the episode as accepted into its sample pool
    accepted: bool = False


def run_episode(
    client: SwarmClient,
    task: Task,
    *,
    max_tokens: int,
    temperature: float,
    eval: bool = False,
    http: httpx.Client | None = None,
    adapter: str | None = None,
) -> EpisodeResult:
    """One episode of ``task`` through the swarm endpoint (one call, or an agent loop), graded and reported;
    ``adapter``: the LoRA adapter it samples with and trains (a server with ``model.adapters``)."""
    own = http is None
    http = http or httpx.Client(timeout=600.0)
    try:
        with client.episode(task_id=task.task_id, eval=eval, meta={"task_family": task.family},
                            adapter=adapter) as ep:
            outcome = run_task(http, ep.base_url, ep.api_key, task, max_tokens=max_tokens, temperature=temperature)
            # the task's own numbers (valid_tool_call, correct, ...) reach the server's per-step task/<name>
            # signals, which the collapse alarm's validity_metric reads
            answer = ep.report(outcome.reward, meta={"metrics": dict(outcome.metrics)} if outcome.metrics else None)
        return EpisodeResult(task.task_id, outcome.reward, outcome.completion, eval, outcome.metrics,
                             ep.episode_id, bool(answer.get("accepted")))
    finally:
        if own:
            http.close()


def send_demonstrations(client: SwarmClient, tasks: list[Task], *, group_size: int,
                        concurrency: int = 1, adapter: str | None = None) -> int:
    """The supervised warm start: one demonstration episode per task (families that have them).

    Episodes are grouped ``group_size`` to a task id (``demo-<k>``), so a batching policy that
    waits for N episodes per task (C2/C3) releases B groups of N different demonstrations.
    With ``concurrency`` 1 (the default) they are sent one after another, in order: the pool
    receives them in the same order every run, so the batching policy (oldest complete groups
    first) makes the same supervised batches, in the same row order, and the warm start of a
    seed is the same run after run. More at once is faster, but which demonstrations share a
    step then depends on which requests finish first.
    ``adapter``: the LoRA adapter they train (a server with ``model.adapters``).
    Returns how many were accepted.
    """
    demos = [(t, d) for t in tasks if (d := demonstration(t)) is not None]

    def send(k: int) -> bool:
        task, demo = demos[k]
        with client.episode(task_id=f"demo-{k // max(1, group_size)}",
                            meta={"task_family": task.family, "demo_of": task.task_id}, adapter=adapter) as ep:
            ep.demonstrate(demo["messages"], tools=demo.get("tools"))
            return bool(ep.report(1.0).get("accepted"))

    if concurrency <= 1:
        return sum(send(k) for k in range(len(demos)))
    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(send, range(len(demos))))


@dataclass
class EvalResult:
    mean: float
    ci95: float
    n: int
    rewards: list[float] = field(default_factory=list)
    #: per-episode metric means (e.g. ``correct``, ``valid_tool_call``) with 95% intervals
    metrics: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: episodes that raised (scored 0)
    failures: int = 0
    #: how many episodes ended which way, where the task says (``outcome/<kind>`` metrics), commonest first
    outcomes: dict[str, int] = field(default_factory=dict)
    #: the mean reward, its 95% half-interval and n per group of held-out items, where the task groups them
    #: (``Task.meta["group"]``, e.g. multi_calc's ``"2 steps"``): a mean over an uneven mix hides a weak group
    groups: dict[str, tuple[float, float, int]] = field(default_factory=dict)

    def __str__(self) -> str:
        extra = "".join(f", {k} {m:.3f} ± {c:.3f}" for k, (m, c) in self.metrics.items())
        failed = f", {self.failures} failed" if self.failures else ""
        ended = f"; ended: {', '.join(f'{k} {n}' for k, n in self.outcomes.items())}" if self.outcomes else ""
        by = "".join(f"; {g}: {m:.3f} ± {c:.3f} (n={n})" for g, (m, c, n) in self.groups.items())
        return f"{self.mean:.3f} ± {self.ci95:.3f} (n={self.n}{extra}{failed}){by}{ended}"


def group_means(groups: list[str | None], rewards: list[float]) -> dict[str, tuple[float, float, int]]:
    """Mean reward, 95% half-interval and count per group name (items without a group left out), by name."""
    per: dict[str, list[float]] = {}
    for g, r in zip(groups, rewards, strict=True):
        if g is not None:
            per.setdefault(g, []).append(r)
    return {g: (*mean_ci(v), len(v)) for g, v in sorted(per.items())}


def episode_outcome(metrics: Mapping[str, Any]) -> str | None:
    """How one episode ended: the ``<kind>`` of its ``outcome/<kind>`` metric of 1.0 (None: the task names none)."""
    return next((k[len(OUTCOME_PREFIX):] for k, v in metrics.items() if k.startswith(OUTCOME_PREFIX) and v == 1.0),
                None)


def count_outcomes(metrics: list[dict[str, float]]) -> dict[str, int]:
    """Episodes per ``outcome/<kind>`` (a metric of 1.0 names how one ended), commonest first, ties by name."""
    counts: dict[str, int] = {}
    for m in metrics:
        if (kind := episode_outcome(m)) is not None:
            counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and normal-approximation 95% half-interval."""
    mean = statistics.fmean(values) if values else math.nan
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, 1.96 * sd / math.sqrt(max(1, len(values)))


def evaluate(
    client: SwarmClient, tasks: list[Task], *, max_tokens: int, concurrency: int = 8, temperature: float = 0.0,
    adapter: str | None = None,
) -> EvalResult:
    """Eval episodes (never trained on) over ``tasks``; mean reward (and metrics) with 95% intervals."""
    def one(task: Task, http: httpx.Client) -> EpisodeResult:
        try:
            return run_episode(client, task, max_tokens=max_tokens, temperature=temperature, eval=True, http=http,
                               adapter=adapter)
        except Exception as exc:  # noqa: BLE001 - a failed eval episode scores 0 and is counted, not lost
            log.warning("eval episode %s failed: %s: %s", task.task_id, type(exc).__name__, exc)
            return EpisodeResult(task.task_id, 0.0, "", True, {"failed": 1.0})

    with httpx.Client(timeout=600.0) as http, ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda t: one(t, http), tasks))
    rewards = [r.reward for r in results]
    mean, ci = mean_ci(rewards)
    keys = sorted({k for r in results for k in r.metrics if k in EVAL_METRICS})
    metrics = {k: mean_ci([r.metrics.get(k, 0.0) for r in results]) for k in keys}
    return EvalResult(mean, ci, len(rewards), rewards, metrics,
                      failures=sum(int(r.metrics.get("failed", 0)) for r in results),
                      outcomes=count_outcomes([r.metrics for r in results]),
                      groups=group_means([t.meta.get("group") for t in tasks], rewards))


class EpisodeLoop:
    """Keeps ``concurrency`` episodes running, each task ``rollouts_per_task`` times, until stopped.

    Subclasses implement :meth:`run_one` (one episode of one task) and may
    override :meth:`handle` (what to do with its result). Episodes whose server
    call fails are aborted by the SDK and counted in ``failures``; the loop keeps
    going (the server may be busy training). ``max_episodes`` > 0 stops the loop
    after that many finished episodes. ``eval_every`` > 0 plays one eval episode
    (:meth:`run_eval`, never trained) after every that many finished episodes,
    so the server logs eval rewards per task family while it trains.
    """

    def __init__(self, tasks: list[Task], *, rollouts_per_task: int, concurrency: int = 8, seed: int = 0,
                 max_episodes: int = 0, eval_every: int = 0):
        self.eval_every = eval_every
        self.eval_rewards: list[float] = []
        self.tasks = tasks
        self.rollouts_per_task = rollouts_per_task
        self.concurrency = concurrency
        self.seed = seed
        self.max_episodes = max_episodes
        self.stop_event = threading.Event()
        self.finished = 0
        self.failures = 0
        self.last_error = ""
        self._thread: threading.Thread | None = None
        self._failure_note = (-math.inf, 0)  # when a failure was last logged at WARNING, failures since

    def run_one(self, task: Task, http: httpx.Client) -> Any:
        raise NotImplementedError

    def handle(self, result: Any) -> None:
        """Called in the loop's thread for every finished episode."""

    def run_eval(self, http: httpx.Client) -> float:
        """One eval episode (``eval_every``); returns its reward. Subclasses that evaluate override it."""
        raise NotImplementedError(f"{type(self).__name__} has no eval episode")

    def _eval_once(self, http: httpx.Client) -> None:
        try:
            self.eval_rewards.append(float(self.run_eval(http)))
        except Exception as exc:  # noqa: BLE001 - an eval episode never stops training
            log.warning("eval episode failed: %s: %s", type(exc).__name__, exc)

    def _jobs(self):
        for task in cycle(self.tasks, self.seed):
            for _ in range(self.rollouts_per_task):
                yield task

    def interrupt(self) -> None:
        """Make the running episodes give up now (the loop was interrupted, e.g. by Ctrl-C); subclasses
        close their SDK client, whose retries would otherwise run out their budget first."""

    def run(self) -> None:
        jobs = self._jobs()
        with httpx.Client(timeout=600.0) as http, ThreadPoolExecutor(self.concurrency) as pool:
            running: set[Future] = set()
            try:
                while not self.stop_event.is_set():
                    if self.max_episodes and self.finished >= self.max_episodes:
                        break
                    while len(running) < self.concurrency:
                        running.add(pool.submit(self.run_one, next(jobs), http))
                    done, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                    for fut in done:
                        self._collect(fut, pool, http)
            except BaseException:  # Ctrl-C: the pool's exit would wait for every running episode's retries
                self.stop_event.set()
                self.interrupt()
                http.close()
                raise
            finally:
                for fut in running:
                    fut.cancel()

    def _collect(self, fut: Future, pool: ThreadPoolExecutor, http: httpx.Client) -> None:
        """Count one finished episode (or its failure, or the server's end of training)."""
        try:
            result = fut.result()
        except SwarmAPIError as exc:
            if exc.code == "training_finished":  # the server's step limit: sampling is over
                if not self.stop_event.is_set():  # several running episodes learn it at once: one line
                    log.info("the server finished training; the loop stops sampling")
                self.stop_event.set()
                return
            self._failed(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a failed episode (server busy, an agent's own
            # error...) is aborted by the SDK and counted; the loop keeps sampling
            self._failed(exc)
            return
        self.finished += 1
        self.handle(result)
        if self.eval_every and self.finished % self.eval_every == 0:
            pool.submit(self._eval_once, http)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        last, since = self._failure_note
        now = time.monotonic()
        if now - last < FAILURE_NOTE_S:
            self._failure_note = (last, since + 1)
            log.debug("episode failed: %s", self.last_error)
            return
        self._failure_note = (now, 0)
        more = f" ({since} more failed in the last {now - last:.0f} s)" if since else ""
        log.warning("episode failed: %s%s", self.last_error, more)

    def start(self) -> EpisodeLoop:
        self._thread = threading.Thread(target=self.run, name=type(self).__name__, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.stop_event.set()
        if self._thread:
            self._thread.join(timeout)


class TrainingClient(EpisodeLoop):
    """The task client's training loop: one chat call per episode, scored and reported."""

    def __init__(
        self,
        client: SwarmClient,
        tasks: list[Task],
        *,
        rollouts_per_task: int,
        max_tokens: int,
        temperature: float = 1.0,
        concurrency: int = 8,
        seed: int = 0,
        on_result: Callable[[EpisodeResult], None] | None = None,
        ready_every: int = 0,
        eval_tasks: list[Task] | None = None,
        eval_every: int = 0,
        adapter: str | None = None,
    ):
        self.adapter = adapter
        super().__init__(tasks, rollouts_per_task=rollouts_per_task, concurrency=concurrency, seed=seed,
                         eval_every=eval_every if eval_tasks else 0)
        self._eval_jobs = cycle(list(eval_tasks or []), seed + 1) if eval_tasks else None
        self.client = client
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.on_result = on_result
        #: vote "ready" (batching C4/C5) after every this many finished episodes; 0 = never
        self.ready_every = ready_every

    def interrupt(self) -> None:
        self.client.close()

    def run_one(self, task: Task, http: httpx.Client) -> EpisodeResult:
        return run_episode(self.client, task, max_tokens=self.max_tokens, temperature=self.temperature, http=http,
                           adapter=self.adapter)

    def run_eval(self, http: httpx.Client) -> float:
        assert self._eval_jobs is not None
        return run_episode(self.client, next(self._eval_jobs), max_tokens=self.max_tokens, temperature=0.0,
                           eval=True, http=http, adapter=self.adapter).reward

    def handle(self, result: EpisodeResult) -> None:
        if self.on_result:
            self.on_result(result)
        if self.ready_every and self.finished % self.ready_every == 0:
            try:
                self.client.ready(True)
            except SwarmError as exc:  # said, not raised: the next vote may pass; a C4 server waits for it
                self.last_error = f"ready vote failed: {exc}"
                log.warning("%s", self.last_error)


def _option(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` of ``--task-option`` (the value as JSON when it parses, else the string)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--task-option takes KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


class Summary:
    """The task client's periodic line (unless ``--verbose``): episodes per minute, mean reward and
    failures since the last line, at most one per ``every_s`` and only when something happened."""

    def __init__(self, loop: EpisodeLoop, every_s: float, *, clock: Callable[[], float] = time.monotonic,
                 out: Callable[[str], None] = print):
        self.loop, self.every_s, self.clock, self.out = loop, every_s, clock, out
        self._lock = threading.Lock()
        self._rewards: list[float] = []
        self._since = clock()
        self._failures = 0
        self._stop = threading.Event()

    def add(self, result: EpisodeResult) -> None:
        with self._lock:
            self._rewards.append(result.reward)

    def line(self) -> str | None:
        """The summary of the episodes since the last line (None when none finished or failed)."""
        now = self.clock()
        with self._lock:
            rewards, self._rewards = self._rewards, []
            since, self._since = self._since, now
        failures, self._failures = self.loop.failures - self._failures, self.loop.failures
        if not rewards and not failures:
            return None
        minutes = max(now - since, 1e-9) / 60
        mean = f"mean reward {statistics.fmean(rewards):.3f}" if rewards else "no episode finished"
        failed = f"; {failures} failed (last: {self.loop.last_error})" if failures else ""
        return (f"{len(rewards)} episodes in {now - since:.0f} s ({len(rewards) / minutes:.1f}/min), {mean}"
                f"{failed}; {self.loop.finished} in all")

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.flush()

    def flush(self) -> None:
        text = self.line()
        if text:
            self.out(text)

    def start(self) -> Summary:
        threading.Thread(target=self.run, name="task-client-summary", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.flush()


def quiet_logs(verbose: bool) -> None:
    """The task client's log levels: httpx's line per request only with ``--verbose``; each retry and
    failed episode at DEBUG (the SDK and the loop say the first at INFO/WARNING, then one a minute)."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.INFO if verbose else logging.WARNING)
    for name in ("swarmkit.client", __name__):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.NOTSET)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Run the built-in task client against a swarm server.")
    p.add_argument("--url", required=True)
    p.add_argument("--token", default=os.environ.get("SWARMKIT_ADMIN_TOKEN"))
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--train-size", type=int, default=256)
    p.add_argument("--rollouts-per-task", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--ready-every", type=int, default=0,
                   help="vote ready (batching c4/c5) after every this many episodes")
    p.add_argument("--client-id", default=None)
    p.add_argument("--eval", action="store_true", help="run one eval pass instead of training")
    p.add_argument("--eval-size", type=int, default=48, help="held-out tasks (--eval, --eval-every)")
    p.add_argument("--eval-every", type=int, default=0,
                   help="play one held-out eval episode after every this many training episodes")
    p.add_argument("--demonstrations", type=int, default=0,
                   help="send this many demonstration episodes first (supervised warm start; calc_agent)")
    p.add_argument("--task-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a task option (e.g. token_rule's target=a: the reward); repeat")
    p.add_argument("--episode-log", default=None,
                   help="append one JSON line per finished episode (id, task, reward, accepted)")
    p.add_argument("--summary-every", type=float, default=30.0, metavar="SECONDS",
                   help="print a summary line (episodes/min, mean reward, failures) at most this often")
    p.add_argument("--verbose", action="store_true",
                   help="a line per episode, per HTTP request (httpx) and per retry")
    p.add_argument("--adapter", default=None,
                   help="the LoRA adapter its episodes sample with and train (a server with model.adapters)")
    args = p.parse_args(argv)
    quiet_logs(args.verbose)
    options = dict(_option(o) for o in args.task_option)
    client = SwarmClient(args.url, token=args.token, retry_for=900, client_id=args.client_id)
    eval_tasks = make_tasks(args.task, args.eval_size, split="eval", options=options)
    if args.eval:
        result = evaluate(client, eval_tasks, max_tokens=args.max_tokens, adapter=args.adapter)
        print(f"eval reward: {result}")
        return 0
    if args.demonstrations:
        sent = send_demonstrations(client, make_tasks(args.task, args.demonstrations, seed=1, split="demo",
                                                      options=options), group_size=args.rollouts_per_task,
                                   adapter=args.adapter)
        print(f"{sent} demonstrations accepted")
    log_file = open(args.episode_log, "a", buffering=1) if args.episode_log else None  # noqa: SIM115
    summary: Summary | None = None

    def on_result(r: EpisodeResult) -> None:
        if args.verbose:
            print(f"{r.task_id}: reward {r.reward:.2f}", flush=True)
        elif summary is not None:
            summary.add(r)
        if log_file is not None:  # written only once the server answered the report
            log_file.write(json.dumps({"episode_id": r.episode_id, "task_id": r.task_id, "reward": r.reward,
                                       "accepted": r.accepted}) + "\n")

    tc = TrainingClient(client, make_tasks(args.task, args.train_size, options=options),
                        rollouts_per_task=args.rollouts_per_task, max_tokens=args.max_tokens,
                        concurrency=args.concurrency, ready_every=args.ready_every, on_result=on_result,
                        eval_tasks=eval_tasks, eval_every=args.eval_every, adapter=args.adapter)
    if not args.verbose:
        summary = Summary(tc, args.summary_every, out=lambda text: print(text, flush=True)).start()
    print(f"task client: {args.task} episodes against {args.url}, {args.concurrency} at a time; "
          + ("a line per episode (--verbose)" if args.verbose else
             f"a summary at most every {args.summary_every:g} s (--verbose: a line per episode)"), flush=True)
    try:
        tc.run()
    except KeyboardInterrupt:
        print(f"interrupted: {tc.finished} episodes in all", file=sys.stderr, flush=True)
        return 130
    finally:
        if summary is not None:
            summary.stop()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise SystemExit(main())
