"""Prometheus exposition of one swarm server (``GET /metrics``, the ``prometheus-client`` library).

Three sources, one per-app registry (never the process-global one: a process may
run several servers):

- the server's state, read when scraped: state, policy version, global step,
  pool fill and contents, episodes by outcome, clients, tokens generated and
  trained; with ``model.adapters`` each adapter's steps, served version, waiting
  and running episodes and last reward (label ``adapter``);
- request latencies per route, observed as requests end (:class:`RequestTimer`);
- step durations per phase (drain, merge, train, weight sync, whole step),
  observed from ``metrics.jsonl`` rows not seen before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkit.server.dashboard.data import MetricsTail
from swarmkit.swarm.server import SwarmServer
from swarmkit.swarm.state import ServerState

#: request durations (seconds): sub-millisecond proxy answers up to long generations
REQUEST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 300.0)
#: step phase durations (seconds)
STEP_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
#: metrics.jsonl key -> phase label
STEP_PHASES = {"drain_s": "drain", "build_time_s": "merge", "train_time_s": "train", "weight_sync_s": "weight_sync",
               "cycle_time_s": "step"}


class ServerMetrics:
    """The registry behind ``/metrics`` for one server."""

    def __init__(self, srv: SwarmServer, tail: MetricsTail):
        self.srv = srv
        self.tail = tail
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Histogram("swarmkit_http_request_duration_seconds",
                                  "HTTP request duration until the last byte, by route template",
                                  ["method", "route", "status"], buckets=REQUEST_BUCKETS, registry=self.registry)
        self.steps = Histogram("swarmkit_step_phase_duration_seconds", "Training step duration by phase",
                               ["phase"], buckets=STEP_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(self))
        self._seen_rows = 0
        self._lock = threading.Lock()
        self.trained_tokens = 0.0

    def observe_request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, f"{status // 100}xx").observe(seconds)

    def exposition(self) -> bytes:
        """The text format of every metric now."""
        with self._lock:
            rows = self.tail.rows(self.srv.run_dir)
            if len(rows) < self._seen_rows:  # another run dir's file: count it from its start
                self._seen_rows, self.trained_tokens = 0, 0.0
            for row in rows[self._seen_rows:]:
                if row.get("kind", "train") != "train":
                    continue
                for key, phase in STEP_PHASES.items():
                    value = row.get(key)
                    if isinstance(value, int | float):
                        self.steps.labels(phase).observe(float(value))
                self.trained_tokens += float(row.get("trained_tokens") or 0.0)
            self._seen_rows = len(rows)
            return generate_latest(self.registry)


class _StateCollector:
    """Reads the server's status at scrape time."""

    def __init__(self, owner: ServerMetrics):
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        srv = self.owner.srv
        st = srv.status()
        state = GaugeMetricFamily("swarmkit_state", "1 for the server's current state", labels=["state"])
        for s in ServerState:
            state.add_metric([s.value], 1.0 if st["state"] == s.value else 0.0)
        yield state
        yield GaugeMetricFamily("swarmkit_state_seconds", "Seconds in the current state",
                                value=max(0.0, time.time() - srv.state.since))
        yield GaugeMetricFamily("swarmkit_policy_version", "Version of the weights being served",
                                value=float(st["policy_version"]))
        yield GaugeMetricFamily("swarmkit_global_step", "Training steps applied", value=float(st["global_step"]))
        yield GaugeMetricFamily("swarmkit_training_finished", "1 when the step limit was reached",
                                value=1.0 if st.get("training_finished") else 0.0)
        pool: dict[str, Any] = st.get("pool") or {}
        fill = pool.get("fill")
        if isinstance(fill, dict):
            unit = [str(fill.get("unit", ""))]
            current = GaugeMetricFamily("swarmkit_pool_fill", "Progress towards the batching trigger", labels=["unit"])
            current.add_metric(unit, float(fill.get("current", 0)))
            target = GaugeMetricFamily("swarmkit_pool_fill_target", "What the batching trigger needs",
                                       labels=["unit"])
            target.add_metric(unit, float(fill.get("target", 0)))
            yield current
            yield target
        contents = GaugeMetricFamily("swarmkit_pool", "Episodes and tasks in the pool", labels=["what"])
        for what in ("episodes", "tasks", "reserved"):
            if isinstance(pool.get(what), int | float):
                contents.add_metric([what], float(pool[what]))
        yield contents
        spent = CounterMetricFamily("swarmkit_pool_episodes_retired", "Pool episodes trained or filtered out",
                                    labels=["how"])
        for how in ("trained", "filtered"):
            if isinstance(pool.get(how), int | float):
                spent.add_metric([how], float(pool[how]))
        yield spent
        engine = st.get("engine") or {}
        if isinstance(engine.get("busy_s"), int | float):
            yield CounterMetricFamily("swarmkit_engine_busy_seconds", "Seconds the inference engine spent "
                                      "computing (idle share = 1 - rate of this)", value=float(engine["busy_s"]))
        replicas = st.get("replicas") or []
        if replicas:
            up = GaugeMetricFamily("swarmkit_replica_up", "1 while an inference replica is in rotation",
                                   labels=["replica"])
            load = GaugeMetricFamily("swarmkit_replica_in_flight", "Calls an inference replica serves now",
                                     labels=["replica"])
            for rep in replicas:
                up.add_metric([str(rep.get("index"))], 1.0 if rep.get("alive") else 0.0)
                load.add_metric([str(rep.get("index"))], float(rep.get("in_flight") or 0))
            yield up
            yield load
        yield from _adapter_families(pool.get("adapters") or {})
        trainer = pool.get("trainer") or {}
        if trainer.get("mode") == "async":
            yield GaugeMetricFamily("swarmkit_training_in_progress", "1 while a step trains in the background",
                                    value=1.0 if trainer.get("training") else 0.0)
            yield GaugeMetricFamily("swarmkit_ready_batches", "Batches the batching policy could release now",
                                    value=float(trainer.get("ready_batches") or 0))
        alarm = pool.get("alarm")
        if isinstance(alarm, dict):
            yield GaugeMetricFamily("swarmkit_collapse_alarm", "1 while the collapse alarm is raised (signals past "
                                    "their thresholds, or training paused by it)", value=1.0 if alarm.get("active") else 0.0)
            yield GaugeMetricFamily("swarmkit_training_paused", "1 while the collapse alarm holds training paused",
                                    value=1.0 if alarm.get("paused") else 0.0)
            yield CounterMetricFamily("swarmkit_collapse_alarms", "Collapse alarms fired",
                                      value=float(alarm.get("fired") or 0))
            yield CounterMetricFamily("swarmkit_collapse_rollbacks", "Rollbacks the collapse alarm made",
                                      value=float(alarm.get("rollbacks") or 0))
        last = pool.get("last_step") or {}
        signals = GaugeMetricFamily("swarmkit_collapse_signal", "The last step's collapse signals (identical_groups, "
                                    "flat_groups, entropy, sampled_nll, task/<name>)", labels=["signal"])
        for key, value in last.items():
            if isinstance(value, int | float) and (key.startswith(("collapse/", "task/"))) and key != "collapse/alarm":
                signals.add_metric([key.removeprefix("collapse/")], float(value))
        yield signals
        eps = st.get("episodes") or {}
        outcomes = CounterMetricFamily("swarmkit_episodes", "Episodes by outcome", labels=["outcome"])
        for outcome in ("registered", "finished", "eval_finished", "aborted", "reaped"):
            outcomes.add_metric([outcome], float(eps.get(outcome, 0)))
        yield outcomes
        running = GaugeMetricFamily("swarmkit_episodes_running", "Running episodes", labels=["kind"])
        running.add_metric(["train"], float(eps.get("running_train", 0)))
        running.add_metric(["eval"], float(eps.get("running_eval", 0)))
        yield running
        clients = GaugeMetricFamily("swarmkit_clients", "Clients seen within the activity window", labels=["what"])
        for what in ("active", "ready"):
            clients.add_metric([what], float((st.get("clients") or {}).get(what, 0)))
        yield clients
        yield CounterMetricFamily("swarmkit_calls", "Model calls served", value=float(st.get("calls", 0)))
        yield CounterMetricFamily("swarmkit_tokens_generated", "Tokens the engine generated",
                                  value=float(st.get("tokens_generated", 0)))
        yield CounterMetricFamily("swarmkit_tokens_trained", "Tokens with loss mask 1 in applied steps",
                                  value=self.owner.trained_tokens)


def _adapter_families(adapters: dict[str, Any]) -> Iterator[Metric]:
    """Per-adapter series of a server with ``model.adapters`` (label ``adapter``); nothing without adapters."""
    if not adapters:
        return
    steps = CounterMetricFamily("swarmkit_adapter_steps", "Optimizer steps applied to each LoRA adapter",
                                labels=["adapter"])
    version = GaugeMetricFamily("swarmkit_adapter_policy_version", "Version of each adapter the engine serves",
                                labels=["adapter"])
    waiting = GaugeMetricFamily("swarmkit_adapter_waiting_episodes", "Each adapter's episodes in the pool",
                                labels=["adapter"])
    running = GaugeMetricFamily("swarmkit_adapter_running_episodes", "Each adapter's training episodes running",
                                labels=["adapter"])
    reward = GaugeMetricFamily("swarmkit_adapter_reward_mean", "Mean reward of each adapter's last step",
                               labels=["adapter"])
    for name, a in adapters.items():
        steps.add_metric([name], float(a.get("step") or 0))
        version.add_metric([name], float(a.get("policy_version") or 0))
        waiting.add_metric([name], float(a.get("waiting") or 0))
        running.add_metric([name], float(a.get("running") or 0))
        if isinstance(a.get("reward_mean"), int | float):
            reward.add_metric([name], float(a["reward_mean"]))
    yield from (steps, version, waiting, running, reward)


class RequestTimer:
    """Pure ASGI middleware: each HTTP request's duration, by the route template it matched."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.observe_request(scope.get("method", "GET"), route, status, time.perf_counter() - t0)
