"""The built-in example swarm client: runs a task's episodes and reports rewards.

Plain HTTP to the episode's OpenAI-compatible ``base_url`` (httpx only, no
torch), so it runs on any laptop: ``python -m swarmkit.apps.task_client --url
http://127.0.0.1:8000 --token ...``. The main job (``python -m swarmkit``)
runs it in threads next to a local server.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import httpx

from swarmkit.apps.tasks import Task, cycle, make_tasks, score
from swarmkit.client.sdk import SwarmClient, SwarmError


@dataclass
class EpisodeResult:
    task_id: str
    reward: float
    completion: str
    eval: bool


def run_episode(
    client: SwarmClient,
    task: Task,
    *,
    max_tokens: int,
    temperature: float,
    eval: bool = False,
    http: httpx.Client | None = None,
) -> EpisodeResult:
    """One episode: a single chat call through the swarm endpoint, scored and reported."""
    own = http is None
    http = http or httpx.Client(timeout=600.0)
    try:
        with client.episode(task_id=task.task_id, eval=eval, meta={"task_family": task.family}) as ep:
            resp = http.post(
                f"{ep.base_url}/chat/completions",
                headers={"Authorization": f"Bearer {ep.api_key}"},
                json={
                    "model": "swarm",
                    "messages": task.messages,
                    "max_tokens": max_tokens,
                    "temperature": temperature,
                },
            )
            resp.raise_for_status()
            text = resp.json()["choices"][0]["message"].get("content") or ""
            reward = score(task, text)
            ep.report(reward)
        return EpisodeResult(task.task_id, reward, text, eval)
    finally:
        if own:
            http.close()


@dataclass
class EvalResult:
    mean: float
    ci95: float
    n: int
    rewards: list[float] = field(default_factory=list)

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.ci95:.3f} (n={self.n})"


def evaluate(
    client: SwarmClient, tasks: list[Task], *, max_tokens: int, concurrency: int = 8, temperature: float = 0.0
) -> EvalResult:
    """Eval episodes (never trained on) over ``tasks``; mean reward with a normal 95% interval."""
    with httpx.Client(timeout=600.0) as http, ThreadPoolExecutor(concurrency) as pool:
        results = list(
            pool.map(
                lambda t: run_episode(client, t, max_tokens=max_tokens, temperature=temperature, eval=True, http=http),
                tasks,
            )
        )
    rewards = [r.reward for r in results]
    mean = statistics.fmean(rewards) if rewards else math.nan
    sd = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    return EvalResult(mean, 1.96 * sd / math.sqrt(max(1, len(rewards))), len(rewards), rewards)


class EpisodeLoop:
    """Keeps ``concurrency`` episodes running, each task ``rollouts_per_task`` times, until stopped.

    Subclasses implement :meth:`run_one` (one episode of one task) and may
    override :meth:`handle` (what to do with its result). Episodes whose server
    call fails are aborted by the SDK and counted in ``failures``; the loop keeps
    going (the server may be busy training). ``max_episodes`` > 0 stops the loop
    after that many finished episodes.
    """

    def __init__(self, tasks: list[Task], *, rollouts_per_task: int, concurrency: int = 8, seed: int = 0,
                 max_episodes: int = 0):
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

    def run_one(self, task: Task, http: httpx.Client) -> Any:
        raise NotImplementedError

    def handle(self, result: Any) -> None:
        """Called in the loop's thread for every finished episode."""

    def _jobs(self):
        for task in cycle(self.tasks, self.seed):
            for _ in range(self.rollouts_per_task):
                yield task

    def run(self) -> None:
        jobs = self._jobs()
        with httpx.Client(timeout=600.0) as http, ThreadPoolExecutor(self.concurrency) as pool:
            running: set[Future] = set()
            while not self.stop_event.is_set():
                if self.max_episodes and self.finished >= self.max_episodes:
                    break
                while len(running) < self.concurrency:
                    running.add(pool.submit(self.run_one, next(jobs), http))
                done, running = wait(running, timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in done:
                    try:
                        result = fut.result()
                    except (SwarmError, httpx.HTTPError) as exc:
                        self.failures += 1
                        self.last_error = f"{type(exc).__name__}: {exc}"
                        continue
                    self.finished += 1
                    self.handle(result)
            for fut in running:
                fut.cancel()

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
    ):
        super().__init__(tasks, rollouts_per_task=rollouts_per_task, concurrency=concurrency, seed=seed)
        self.client = client
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.on_result = on_result
        #: vote "ready" (batching C4/C5) after every this many finished episodes; 0 = never
        self.ready_every = ready_every

    def run_one(self, task: Task, http: httpx.Client) -> EpisodeResult:
        return run_episode(self.client, task, max_tokens=self.max_tokens, temperature=self.temperature, http=http)

    def handle(self, result: EpisodeResult) -> None:
        if self.on_result:
            self.on_result(result)
        if self.ready_every and self.finished % self.ready_every == 0:
            try:
                self.client.ready(True)
            except SwarmError as exc:
                self.last_error = f"ready vote failed: {exc}"


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
    args = p.parse_args(argv)
    client = SwarmClient(args.url, token=args.token, retry_for=900, client_id=args.client_id)
    if args.eval:
        result = evaluate(client, make_tasks(args.task, args.train_size, split="eval"), max_tokens=args.max_tokens)
        print(f"eval reward: {result}")
        return 0
    tc = TrainingClient(client, make_tasks(args.task, args.train_size), rollouts_per_task=args.rollouts_per_task,
                        max_tokens=args.max_tokens, concurrency=args.concurrency, ready_every=args.ready_every,
                        on_result=lambda r: print(f"{r.task_id}: reward {r.reward:.2f}"))
    try:
        tc.run()
    except KeyboardInterrupt:
        tc.stop_event.set()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
