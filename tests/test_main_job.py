"""The main job's flow (``swarmkit.apps.main_job``), written once for ``mode=local`` and ``launcher=ray``.

The flow runs here against servers simulated in this process (:class:`FakeServer`: a step per poll
while its clients sample, an evaluation that says at which step it ran), under both real drivers:
``LocalDriver`` with its server session and sampler replaced by the simulation, and ``RayDriver`` with
Ray replaced by a stand-in whose actors are the simulation's objects. What a driver does for real
(a server thread, Ray actors) is covered end to end by ``test_learning`` and ``test_ray_launcher``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from swarmkit.apps import local, main_job, ray_launcher
from swarmkit.apps.main_job import warm_steps
from swarmkit.apps.task_client import EvalResult
from swarmkit.config.compose import compose_checked


@pytest.fixture(autouse=True)
def _fast_polls(monkeypatch):
    monkeypatch.setattr(main_job, "POLL_S", 0.01)
    monkeypatch.setattr(main_job, "CHECK_CLIENTS_S", 0.05)


class FakeServer:
    """A swarm server without a model: one optimizer step per status poll while its clients sample or its
    warm start's steps are left; its held-out reward is the step / 100."""

    def __init__(self, cfg: Any, index: int = 0):
        self.cfg, self.index = cfg, index
        self.total = int(cfg.trainer.total_steps)
        self.step = 0
        self.demo_steps = 0
        self.sampling = False
        self.events: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    # the calls a driver makes on a server (ServerSession's)
    def boot(self, timeout: float = 0.0) -> dict[str, Any]:
        self.events.append(("boot",))
        return {"state": "ROLLING"}

    def warm_start(self) -> int:
        n = int(self.cfg.task.demonstrations)
        self.demo_steps = warm_steps(self.cfg, n)
        self.events.append(("warm_start", n))
        return n

    def evaluate(self) -> EvalResult:
        with self.lock:
            self.events.append(("evaluate", self.step, self.sampling))
            return EvalResult(self.step / 100, 0.01, 4, metrics={"correct": (self.step / 100, 0.02)})

    def status(self) -> dict[str, Any]:
        with self.lock:
            if (self.sampling or self.step < self.demo_steps) and self.step < self.total:
                self.step += 1
            last = {"step": self.step} if self.step else None
            return {"global_step": self.step, "state": "ROLLING", "replicas": [{"alive": True}],
                    "pool": {"last_step": last, "fill": {"current": 1, "target": 4, "unit": "groups"}}}

    def metrics(self, after_step: int) -> list[dict[str, Any]]:
        return [{"kind": "train", "step": s, "reward_mean": 0.5, "loss": 0.1} for s in range(after_step + 1, self.step + 1)]

    def checkpoint(self) -> dict[str, Any]:
        self.events.append(("checkpoint", self.step))
        return {"trainer": {"path": f"checkpoints/step_{self.step}"}}

    def shutdown(self) -> None:
        self.events.append(("shutdown",))

    # the clients
    def sample(self, on: bool, seed: int | None = None) -> None:
        with self.lock:
            self.sampling = on
            self.events.append(("clients", on, seed, self.step))


def _cfg(tmp_path: Path, *overrides: str) -> Any:
    return compose_checked(["model=tiny", "task=token_rule", f"server.run_dir={tmp_path}", "trainer.total_steps=7",
                            "trainer.eval_every=3", "batching.batch_size=2", "batching.rollouts_per_task=2",
                            *overrides])


# --------------------------------------------------------------------------- the local driver on the simulation
class FakeSession(FakeServer):
    """``LocalDriver``'s ``ServerSession``: the simulation, with the handle the driver prints."""

    def __init__(self, cfg: Any, index: int = 0, **_: Any):
        super().__init__(cfg, index)
        self.handle = SimpleNamespace(url="http://127.0.0.1:1", swarm=SimpleNamespace(admin_token_source="env"))
        self.ctl = self


class FakeSampler:
    """``LocalDriver``'s ``Sampler``: switches the simulation's sampling; two episodes per poll of it."""

    def __init__(self, server: FakeSession, cfg: Any, on_result: Any = None):
        self.server, self.seeds = server, []
        self.finished = 0

    def start(self, seed: int) -> FakeSampler:
        self.seeds.append(seed)
        self.server.sample(True, seed)
        return self

    def stop(self, *, abandon: bool = False) -> None:
        if self.server.sampling:
            self.finished += 8
        self.server.sample(False)
        self.abandoned = abandon


def _run_local(monkeypatch, cfg: Any) -> tuple[dict[str, Any], FakeSession]:
    made: list[FakeSession] = []
    monkeypatch.setattr(local, "ServerSession", lambda c, *a, **k: made.append(FakeSession(c)) or made[-1])
    monkeypatch.setattr(local, "Sampler", FakeSampler)
    assert local.run_local(cfg) == 0
    return json.loads((Path(cfg.server.run_dir) / "summary.json").read_text()), made[0]


# --------------------------------------------------------------------------- the Ray driver on a stand-in for Ray
class _ActorDied(Exception):
    pass


class _Unavailable(_ActorDied):
    pass


class _TaskError(Exception):
    cause: BaseException


FAKE_RAY = SimpleNamespace(exceptions=SimpleNamespace(
    RayActorError=_ActorDied, ActorUnavailableError=_Unavailable, RayTaskError=_TaskError,
    GetTimeoutError=TimeoutError))


class FakeActor:
    """An actor handle: ``actor.method.remote(*args)`` is a reference that ``FAKE_RAY.get`` runs."""

    def __init__(self, obj: Any):
        self.obj, self.dead = obj, False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.obj, name)

        def call(*args: Any) -> Any:
            if self.dead:
                raise _ActorDied(f"{name}: the actor died")
            return method(*args)

        return SimpleNamespace(remote=lambda *args: (lambda: call(*args)))


def _get(ref: Any, timeout: float | None = None) -> Any:
    return [r() for r in ref] if isinstance(ref, list) else ref()


FAKE_RAY.get = _get
FAKE_RAY.kill = lambda actor: setattr(actor, "dead", True)


class FakeClient:
    """``ClientWorker`` on the simulation; ``die_on_pause`` dies while paused (the driver must replace it)."""

    def __init__(self, server: FakeServer, seed: int, die_on_pause: bool = False):
        self.server, self.die_on_pause = server, die_on_pause
        self.finished = 0
        self.actor: FakeActor | None = None
        server.sample(True, seed)

    def stats(self) -> dict[str, Any]:
        return {"finished": self.finished, "node_id": f"node-{self.server.index}"}

    def pause(self) -> dict[str, Any]:
        self.finished += 8
        self.server.sample(False)
        if self.die_on_pause and self.actor is not None:
            self.actor.dead = True
        return self.stats()

    def resume(self, seed: int) -> dict[str, Any]:
        self.server.sample(True, seed)
        return self.stats()


def _run_ray(monkeypatch, cfg: Any, *, die_on_pause: int | None = None,
             rc: int = 0) -> tuple[dict[str, Any], list[FakeServer]]:
    """``run_ray`` with Ray's placement and actors replaced; ``die_on_pause``: that server's first client
    actor dies when first paused; ``rc``: the exit status expected (no summary unless 0)."""
    servers: list[FakeServer] = []
    monkeypatch.setattr(ray_launcher, "import_ray", lambda: FAKE_RAY)

    def connect(self: ray_launcher.RayDriver) -> None:
        self._connected = True

    def place(self: ray_launcher.RayDriver, cfgs: list[Any]) -> None:
        for k, c in enumerate(cfgs):
            servers.append(FakeServer(c, k))
            s = ray_launcher._Server(k, c, pg=None, actor=FakeActor(servers[-1]),
                                     info={"url": f"http://127.0.0.1:{9000 + k}", "node_id": f"node-{k}"})
            s.clients = [ray_launcher._ClientSlot(k, j, 1 + j) for j in range(self.rcfg.clients)]
            self.servers.append(s)

    def start_client(self: ray_launcher.RayDriver, s: Any, slot: Any) -> None:
        slot.name = f"client-{s.index}-{slot.index}" + (f".{slot.generation}" if slot.generation else "")
        worker = FakeClient(servers[s.index], self._seed(s, slot), die_on_pause=die_on_pause == s.index
                            and slot.generation == 0)
        slot.actor = worker.actor = FakeActor(worker)
        slot.last = {}

    def teardown(self: ray_launcher.RayDriver) -> None:
        for s in self.servers:
            s.actor.shutdown.remote()()
        self._connected = False

    for name, fn in (("connect", connect), ("place", place), ("start_client", start_client),
                     ("teardown", teardown)):
        monkeypatch.setattr(ray_launcher.RayDriver, name, fn)
    assert ray_launcher.run_ray(cfg) == rc
    if rc:
        return {}, servers
    return json.loads((Path(cfg.server.run_dir) / "summary.json").read_text()), servers


# --------------------------------------------------------------------------- the tests
def _evals(server: FakeServer) -> list[tuple[int, bool]]:
    return [(e[1], e[2]) for e in server.events if e[0] == "evaluate"]


def test_eval_every_pauses_the_clients_and_evaluates_mid_run_under_ray(monkeypatch, tmp_path):
    """The regression: under Ray ``trainer.eval_every`` was ignored (no mid-run evaluation)."""
    cfg = _cfg(tmp_path, "launcher=ray", "ray.servers=2")
    summary, servers = _run_ray(monkeypatch, cfg)
    for k, server in enumerate(servers):
        # before, at steps 3 and 6 (every 3 steps, never at the last), after; never while the clients sample
        assert _evals(server) == [(0, False), (3, False), (6, False), (7, False)], server.events
        record = summary["servers"][k]
        assert list(record["eval_midway"]) == ["3", "6"]
        assert record["eval_midway"]["3"]["mean"] == pytest.approx(0.03)
        assert record["eval_midway"]["3"]["correct"] == {"mean": pytest.approx(0.03), "ci95": 0.02}
        assert record["global_step"] == 7 and record["eval_after"]["mean"] == pytest.approx(0.07)
        assert record["eval_falls"] == []  # rising evaluations: nothing to say
        assert json.loads((tmp_path / f"server_{k}" / "summary.json").read_text()) == record
        # the clients started at step 0, then again after each eval, seeded anew (+ the step; + 1000 per server)
        starts = [(e[2], e[3]) for e in server.events if e[0] == "clients" and e[1]]
        assert starts == [(cfg.seed + 1000 * k, 0), (cfg.seed + 3 + 1000 * k, 3), (cfg.seed + 6 + 1000 * k, 6)]
    assert summary["launcher"] == "ray" and summary["server"] == 0 and summary["eval_midway"] == \
        summary["servers"][0]["eval_midway"]


def test_eval_every_pauses_the_clients_and_evaluates_mid_run_locally(monkeypatch, tmp_path):
    summary, server = _run_local(monkeypatch, _cfg(tmp_path))
    assert _evals(server) == [(0, False), (3, False), (6, False), (7, False)], server.events
    assert list(summary["eval_midway"]) == ["3", "6"]
    assert summary["launcher"] == "local" and summary["servers"] == [
        {k: v for k, v in summary.items() if k not in ("launcher", "namespace", "servers")}]


@pytest.mark.parametrize("launcher", ["local", "ray"])
def test_a_warm_start_is_trained_and_evaluated_before_any_sampled_episode(monkeypatch, tmp_path, launcher):
    # 12 demonstrations, batches of 2 x 2: the first 3 steps train on them alone
    cfg = _cfg(tmp_path, "task.demonstrations=12", "trainer.eval_every=0", f"launcher={launcher}")
    if launcher == "ray":
        summary, (server,) = _run_ray(monkeypatch, cfg)
    else:
        summary, server = _run_local(monkeypatch, cfg)
    assert summary["demonstrations"] == 12
    assert _evals(server) == [(0, False), (3, False), (7, False)]
    first_start = next(e for e in server.events if e[0] == "clients" and e[1])
    assert first_start == ("clients", True, cfg.seed, 3)
    assert list(summary["eval_midway"]) == ["3"]


def test_local_and_ray_drivers_write_the_same_summary_keys(monkeypatch, tmp_path):
    local_summary, _ = _run_local(monkeypatch, _cfg(tmp_path / "local"))
    ray_summary, _ = _run_ray(monkeypatch, _cfg(tmp_path / "ray", "launcher=ray"))
    assert set(local_summary) == set(ray_summary)
    assert set(local_summary["servers"][0]) == set(ray_summary["servers"][0]) == set(local_summary) - {
        "launcher", "namespace", "servers"}
    assert set(local_summary["clients"][0]) == set(ray_summary["clients"][0]) == {
        "slot", "name", "replacements", "finished", "nodes"}
    for summary in (local_summary, ray_summary):
        assert set(summary["eval_before"]) == set(summary["eval_after"]) == {"mean", "ci95", "n", "failures",
                                                                            "full_credit", "outcomes", "groups"}
        assert summary["train_episodes"] == 3 * 8  # three sampling spans of the one client
    assert (local_summary["node_id"], ray_summary["node_id"]) == (None, "node-0")
    assert (local_summary["namespace"], ray_summary["namespace"]) == (None, "swarmkit-ray")


def test_a_client_actor_that_died_while_paused_is_replaced_when_sampling_resumes(monkeypatch, tmp_path):
    summary, _ = _run_ray(monkeypatch, _cfg(tmp_path, "launcher=ray", "ray.servers=2"), die_on_pause=0)
    zero, one = summary["servers"]
    assert zero["client_replacements"] == 1 and one["client_replacements"] == 0
    assert zero["clients"][0]["name"] == "client-0-0.1"
    assert list(zero["eval_midway"]) == ["3", "6"] and zero["global_step"] == 7


def test_a_server_that_goes_offline_stops_the_job_and_tears_down(monkeypatch, tmp_path, capsys):
    cfg = _cfg(tmp_path, "launcher=ray")
    real_status = FakeServer.status

    def offline_at_2(self: FakeServer) -> dict[str, Any]:
        st = real_status(self)
        return {**st, "state": "OFFLINE", "last_error": "engine lost"} if st["global_step"] >= 2 else st

    monkeypatch.setattr(FakeServer, "status", offline_at_2)
    _, (server,) = _run_ray(monkeypatch, cfg, rc=1)
    assert "error: the server went OFFLINE: engine lost" in capsys.readouterr().err
    assert server.events[-1] == ("shutdown",) and not (tmp_path / "summary.json").exists()


def test_a_server_that_goes_offline_stops_the_local_job_with_1_and_the_cause(monkeypatch, tmp_path, capsys):
    """The local driver too (it raised the error through Hydra before, and its exit then waited for the clients'
    retries): exit status 1, the cause on stderr, the server shut down and the sampler abandoned."""
    cfg = _cfg(tmp_path)
    real_status = FakeServer.status

    def offline_at_2(self: FakeServer) -> dict[str, Any]:
        st = real_status(self)
        return {**st, "state": "OFFLINE", "last_error": "the inference engine failed: boom"} \
            if st["global_step"] >= 2 else st

    monkeypatch.setattr(FakeServer, "status", offline_at_2)
    made: list[FakeSession] = []
    samplers: list[FakeSampler] = []
    monkeypatch.setattr(local, "ServerSession", lambda c, *a, **k: made.append(FakeSession(c)) or made[-1])
    monkeypatch.setattr(local, "Sampler", lambda *a, **k: samplers.append(FakeSampler(*a, **k)) or samplers[-1])
    assert local.run_local(cfg) == 1
    assert "error: the server went OFFLINE: the inference engine failed: boom" in capsys.readouterr().err
    assert ("shutdown",) in made[0].events and samplers[0].abandoned
    assert not (tmp_path / "summary.json").exists()


def test_the_summary_says_what_the_tasks_reward_means(monkeypatch, tmp_path, capsys):
    """Issue 36: arithmetic's partial credit (0.5 for the right number after "=") made a mean of 0.469 read as
    47% right; the console and summary.json now give the task's reward legend and the share fully right."""
    from swarmkit.tasks.rewards import reward_scale

    rewards = [1.0, 0.5, 0.5, 0.0]
    monkeypatch.setattr(FakeServer, "evaluate", lambda self: EvalResult(0.5, 0.4, 4, rewards=list(rewards)))
    cfg = compose_checked(["model=tiny", "task=arithmetic", f"server.run_dir={tmp_path}", "trainer.total_steps=2",
                           "batching.batch_size=2", "batching.rollouts_per_task=2"])
    summary, _ = _run_local(monkeypatch, cfg)
    scale = reward_scale("arithmetic")
    assert scale is not None and "0.5" in scale.legend and "<answer>" in scale.legend
    assert summary["reward_scale"] == {"task": "arithmetic", "legend": scale.legend, "full": 1.0}
    assert summary["eval_before"]["full_credit"] == summary["eval_after"]["full_credit"] == 0.25
    out = capsys.readouterr().out
    assert "fully right 1/4 (25%)" in out and "reward of arithmetic: 1.0 = the right number" in out, out


def test_training_steps_failing_in_a_row_stop_the_local_job_with_1_and_the_cause(monkeypatch, tmp_path, capsys):
    """A trainer step that keeps failing (the server retries it with a back-off and stays up) ends the main job
    at MAX_FAILED_STEPS_IN_ROW failures in a row, with the cause; before, the job waited forever."""
    cfg = _cfg(tmp_path)
    real_status = FakeServer.status

    def failing_from_2(self: FakeServer) -> dict[str, Any]:
        st = real_status(self)
        if st["global_step"] < 2:
            return st
        self.step = 2  # no step trains any more
        failed = min(3, getattr(self, "failed", 0) + 1)
        self.failed = failed
        return {**st, "global_step": 2, "pool": {**st["pool"], "steps_failed_in_row": failed,
                                                 "last_error": "step 3 failed: OutOfMemoryError: CUDA out of memory"}}

    monkeypatch.setattr(FakeServer, "status", failing_from_2)
    made: list[FakeSession] = []
    monkeypatch.setattr(local, "ServerSession", lambda c, *a, **k: made.append(FakeSession(c)) or made[-1])
    monkeypatch.setattr(local, "Sampler", lambda *a, **k: FakeSampler(*a, **k))
    assert local.run_local(cfg) == 1
    err = capsys.readouterr().err
    assert "training failed 3 steps in a row; the run stops: step 3 failed: OutOfMemoryError" in err
    assert ("shutdown",) in made[0].events and not (tmp_path / "summary.json").exists()


def test_a_warm_start_as_long_as_the_run_says_no_rl_step_is_left(monkeypatch, tmp_path, capsys):
    """16 demonstrations in batches of 2 x 2 are 4 warm-start steps: with trainer.total_steps=4 the run would end
    before any sampled episode, so the console says so (a warm start lengthened without the step count)."""
    cfg = _cfg(tmp_path, "task.demonstrations=16", "trainer.total_steps=4", "trainer.eval_every=0")
    summary, server = _run_local(monkeypatch, cfg)
    out = capsys.readouterr().out
    assert "16 demonstrations in the pool, 4 steps trained before RL episodes" in out, out
    assert "warning: 4 warm-start steps >= trainer.total_steps=4 leaves no RL step" in out, out
    assert server.step == summary["global_step"] == 4

    _run_local(monkeypatch, _cfg(tmp_path / "rl", "task.demonstrations=16", "trainer.total_steps=6"))
    out = capsys.readouterr().out
    assert "4 steps trained before RL episodes" in out and "leaves no RL step" not in out, out
