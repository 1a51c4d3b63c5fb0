"""``launcher=ray``: the main job's swarm (servers and task clients) as Ray actors on a Ray cluster.

``python -m swarmkit launcher=ray ...`` (after ``ray start --head``) does what
``mode=local`` does, from the same config, with the pieces placed by Ray:

- **one placement group per server** (``ray.servers`` of them): bundle 0 is
  the server actor (:class:`ServerWorker`: the swarm server of ``mode=server``
  in a thread, configured through the controller API like the main job does;
  its inference engine, pool and HTTP endpoint, and with ``optim.nprocs > 1``
  its torchrun ranks, which stay child processes of the actor and whose
  ``ray.rank_cpus/rank_gpus`` are added to that bundle so they see the actor's
  GPUs); bundles 1..``ray.clients`` are its client actors
  (:class:`ClientWorker`: the built-in task client, a :class:`~swarmkit.apps.main_job.Sampler`).
  While ``server.host`` is a loopback address the group is ``STRICT_PACK``
  (the clients must share the server's node); with ``server.host=0.0.0.0``
  the actor advertises its node's IP and the group may span nodes.
- **the driver** (this process, :class:`RayDriver`) only talks to actors. It
  runs the main job of :mod:`swarmkit.apps.main_job`, the flow ``mode=local``
  runs (boot, evaluate, warm start, train with an evaluation every
  ``trainer.eval_every`` steps, checkpoint, evaluate, ``summary.json``): the
  server actor runs the held-out episodes against itself, the client actors
  pause while their server is evaluated. Besides, it replaces a client actor
  that died (``ray.max_client_restarts``), writes ``server_<k>/summary.json``
  per server next to the run's ``summary.json``, and tears everything down.

Ray is imported lazily: without it the launcher fails with the extra to
install (``swarmkit[ray]``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from swarmkit.apps.main_job import JobError, Sampler, ServerInfo, ServerSession, run_main_job, say
from swarmkit.apps.quiet import QUIET_LOGGERS
from swarmkit.apps.task_client import EpisodeResult, EvalResult
from swarmkit.client import SwarmClient, SwarmError
from swarmkit.config.compose import DEFAULT_CHOICES, validated
from swarmkit.config.schema import RayConfig
from swarmkit.config.validate import to_dict
from swarmkit.errors import ConfigError
from swarmkit.procs import is_loopback
from swarmkit.training.trainer import optim_launch

log = logging.getLogger("swarmkit.ray")

#: the extra that installs Ray
INSTALL_HINT = "pip install 'swarmkit[ray]'"
#: environment variables the driver hands to its actors (Ray workers start from the raylet's environment)
FORWARDED_ENV = ("HF_HUB_OFFLINE", "HF_HOME", "TOKENIZERS_PARALLELISM")
#: loggers whose per-request lines are noise in a Ray worker's log


class RayMissing(RuntimeError):
    """Ray is not installed."""


class LaunchError(JobError):
    """The swarm cannot be placed or run on the cluster (the message says why)."""


def import_ray() -> Any:
    """The ``ray`` module, or :class:`RayMissing` naming the extra."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissing(f"launcher=ray needs ray, which is not installed: {INSTALL_HINT}") from exc
    return ray


def _quiet() -> None:
    """A Ray worker's output goes to the driver's terminal, prefixed: keep it to warnings (for the
    actor's whole life: its process is the worker's own)."""
    for name in (*QUIET_LOGGERS, "swarmkit.apps.task_client"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:  # weight loading / shard writing bars, once per boot and per checkpoint
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    except ImportError:
        pass


# --------------------------------------------------------------------------- actors (the main job's server
# session and sampler; the driver wraps them with ray.remote, so importing this module needs no Ray)
class ServerWorker(ServerSession):
    """A swarm server in a Ray actor: a :class:`~swarmkit.apps.main_job.ServerSession` (built and served in a
    thread of the actor's process, OFFLINE until :meth:`boot`); the driver's only way in (controller calls go
    over loopback HTTP from here)."""

    def __init__(self, cfg: dict[str, Any], index: int):
        _quiet()
        super().__init__(OmegaConf.create(cfg), index, client_id=f"controller-ray-{index}")

    def info(self) -> dict[str, Any]:
        """Where the server runs: the URL clients use (the node's IP when bound to every address)."""
        import ray

        host = str(self.cfg.server.host)
        node_ip = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        advertised = node_ip if host in ("0.0.0.0", "::", "") else host
        if ":" in advertised:
            advertised = f"[{advertised}]"
        return {"url": f"http://{advertised}:{self.handle.swarm.port}", "local_url": self.handle.url,
                "node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip,
                "pid": os.getpid(), "run_dir": str(self.cfg.server.run_dir)}

    def boot(self, timeout: float = 3600.0) -> dict[str, Any]:
        try:
            return super().boot(timeout)
        except SwarmError as exc:  # the SDK's errors do not cross Ray's (de)serialization: their message does
            raise RuntimeError(f"server {self.index} did not boot: {exc}") from None

class ClientWorker:
    """The built-in task client in a Ray actor: a :class:`~swarmkit.apps.main_job.Sampler` against one
    server, sampling from construction, paused and resumed (with a new seed) around the main job's evals.

    Every accepted episode is appended to ``episode_log`` (JSON lines, written only after the server
    acknowledged the report), so what a client was told is in the journal can be checked after a crash.
    """

    def __init__(self, url: str, cfg: dict[str, Any], *, name: str, seed: int, episode_log: str | None,
                 client_token: str | None = None):
        _quiet()
        self.name = name
        self._lock = threading.Lock()
        self._log = None
        if episode_log:
            Path(episode_log).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(episode_log, "a", buffering=1)  # noqa: SIM115 - lives as long as the actor
        client = SwarmClient(url, client_token=client_token, retry_for=3600, client_id=name)
        self.sampler = Sampler(client, cfg, on_result=self._on_result).start(seed)

    def _on_result(self, r: EpisodeResult) -> None:
        with self._lock:
            if self._log is not None and r.accepted:
                self._log.write(json.dumps({"episode_id": r.episode_id, "task_id": r.task_id, "reward": r.reward,
                                            "client": self.name}) + "\n")

    def stats(self) -> dict[str, Any]:
        import ray

        with self._lock:
            return {"name": self.name, "finished": self.sampler.finished, "failures": self.sampler.failures,
                    "last_error": self.sampler.last_error, "sampling": self.sampler.sampling,
                    "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def pause(self) -> dict[str, Any]:
        self.sampler.stop()
        return self.stats()

    def resume(self, seed: int) -> dict[str, Any]:
        self.sampler.start(seed)
        return self.stats()

    def stop(self) -> dict[str, Any]:
        self.sampler.stop()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.stats()


# --------------------------------------------------------------------------- the driver
@dataclass
class _ClientSlot:
    """One client position of a server (its bundle); its actor is replaced when it dies."""

    server: int
    index: int
    bundle: int
    actor: Any = None
    name: str = ""
    generation: int = 0
    #: the seed the main job last started the server's clients with
    seed: int = 0
    #: episodes finished by the slot's earlier (dead) actors, plus the live one's last count
    finished_before: int = 0
    last: dict[str, Any] = field(default_factory=dict)
    nodes: list[str] = field(default_factory=list)

    @property
    def finished(self) -> int:
        return self.finished_before + int(self.last.get("finished", 0))


@dataclass
class _Server:
    index: int
    cfg: DictConfig
    pg: Any
    actor: Any
    info: dict[str, Any] = field(default_factory=dict)
    clients: list[_ClientSlot] = field(default_factory=list)


def server_configs(cfg: DictConfig, run_dir: Path) -> list[DictConfig]:
    """One validated config per server: the job's config, ``ray.server_overrides[k]`` laid over it,
    ``server.run_dir`` = ``<run_dir>/server_<k>``, ``server.port`` = ``server.port + k``.

    :raises ConfigError: a bad override (a group selection, or a key or value the schemas refuse).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    rcfg = RayConfig(**to_dict(cfg.ray))
    out: list[DictConfig] = []
    problems: list[str] = []
    parser = OverridesParser.create()
    for k in range(rcfg.servers):
        node = OmegaConf.create(to_dict(cfg))
        OmegaConf.set_struct(node, False)
        text = rcfg.server_overrides[k] if rcfg.server_overrides else ""
        try:
            overrides = parser.parse_overrides(shlex.split(text))
        except Exception as exc:  # noqa: BLE001 - Hydra's grammar errors
            problems.append(f"ray.server_overrides[{k}]: {text!r} is not a list of key=value overrides: {exc}")
            continue
        for o in overrides:
            key = o.key_or_group
            if key in DEFAULT_CHOICES or o.is_delete() or o.is_sweep_override():
                problems.append(f"ray.server_overrides[{k}]: {o.input_line!r}: only key=value overrides here "
                                f"(select groups such as {key}=... on the command line, for every server)")
                continue
            OmegaConf.update(node, key, o.value(), merge=True, force_add=True)
        node.server.run_dir = str(run_dir / f"server_{k}")
        if int(node.server.port):
            node.server.port = int(node.server.port) + k
        try:
            out.append(validated(node))
        except ConfigError as exc:
            problems.extend(f"server {k}: {p}" for p in exc.problems)
    if problems:
        raise ConfigError(problems)
    return out


def _env_vars() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k in FORWARDED_ENV or k.startswith("SWARMKIT_")}


class RayDriver:
    """The main job's driver on a Ray cluster: places the swarm of one validated config, calls its server
    actors, starts, pauses and replaces its client actors (see the module docstring)."""

    launcher = "ray"

    def __init__(self, cfg: DictConfig):
        self.ray = import_ray()
        self.cfg = cfg
        self.rcfg = RayConfig(**to_dict(cfg.ray))
        self.run_dir = Path(str(cfg.server.run_dir)).resolve()
        self.namespace: str | None = self.rcfg.namespace or f"swarmkit-{self.run_dir.name}"
        self.servers: list[_Server] = []
        self._connected = False

    # ------------------------------------------------------------------ cluster and placement
    def connect(self) -> None:
        ray = self.ray
        address = self.rcfg.address
        try:  # "local": a new private Ray (address=None would join a cluster it finds on this machine)
            ray.init(address=address or "local", namespace=self.namespace, logging_level=logging.WARNING,
                     runtime_env={"env_vars": _env_vars()})
        except ConnectionError as exc:
            raise LaunchError(f"no Ray cluster at ray.address={address!r} ({exc}); start one with "
                               "`ray start --head`, or set ray.address=null to start a private Ray here") from exc
        self._connected = True
        say(f"ray: connected to {ray.get_runtime_context().gcs_address} (namespace {self.namespace}); "
            f"cluster resources {ray.cluster_resources()}")

    def strategy(self, cfg: DictConfig) -> str:
        if self.rcfg.placement_strategy != "auto":
            return self.rcfg.placement_strategy
        return "STRICT_PACK" if is_loopback(str(cfg.server.host)) else "PACK"

    def server_resources(self, cfg: DictConfig) -> dict[str, float]:
        """The server actor's bundle: itself plus its training ranks when ``optim.nprocs > 1``."""
        _, launch = optim_launch(to_dict(cfg.optim))
        ranks = launch.nprocs if launch is not None and launch.nprocs > 1 else 0
        res = {"CPU": self.rcfg.server_cpus + ranks * self.rcfg.rank_cpus,
               "GPU": self.rcfg.server_gpus + ranks * self.rcfg.rank_gpus}
        return {k: v for k, v in res.items() if v > 0}

    def place(self, cfgs: list[DictConfig]) -> None:
        """A placement group per server, then its server actor in bundle 0; fails clearly without room."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        for k, cfg in enumerate(cfgs):
            bundles = [self.server_resources(cfg)] + [{"CPU": self.rcfg.client_cpus}] * self.rcfg.clients
            pg = placement_group(bundles, strategy=self.strategy(cfg), name=f"{self.namespace}-server-{k}")
            self.servers.append(_Server(k, cfg, pg, None))
        try:
            ray.get([s.pg.ready() for s in self.servers], timeout=self.rcfg.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            asks = [[self.server_resources(c)] + [{"CPU": self.rcfg.client_cpus}] * self.rcfg.clients for c in cfgs]
            free = {k: v for k, v in ray.available_resources().items() if "group" not in k}
            raise LaunchError(
                f"Ray could not place the swarm in {self.rcfg.placement_timeout_s:g} s: the servers' bundles "
                f"{asks} ({self.strategy(cfgs[0])}), the cluster has {ray.cluster_resources()} "
                f"({free} not reserved)"
            ) from None
        remote = ray.remote(ServerWorker)
        for s in self.servers:
            res = self.server_resources(s.cfg)
            s.actor = remote.options(
                name=f"server-{s.index}", num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0), max_restarts=0,
                max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(s.pg, placement_group_bundle_index=0),
            ).remote(to_dict(s.cfg), s.index)
            s.clients = [_ClientSlot(s.index, j, 1 + j) for j in range(self.rcfg.clients)]
        for s, info in zip(self.servers, ray.get([s.actor.info.remote() for s in self.servers]), strict=True):
            s.info = info
            say(f"[server {s.index}] {info['url']} on node {info['node_ip']} ({info['node_id'][:12]}), "
                f"run dir {info['run_dir']}")

    def start_client(self, s: _Server, slot: _ClientSlot) -> None:
        """A (new) client actor in the slot's bundle of its server's placement group, sampling at once."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        suffix = f".{slot.generation}" if slot.generation else ""
        slot.name = f"client-{s.index}-{slot.index}{suffix}"
        cfg = to_dict(s.cfg)
        slot.actor = self.ray.remote(ClientWorker).options(
            name=slot.name, num_cpus=self.rcfg.client_cpus, max_restarts=0, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(s.pg, placement_group_bundle_index=slot.bundle),
        ).remote(s.info["url"], cfg, name=slot.name, seed=self._seed(s, slot),
                 episode_log=str(Path(str(s.cfg.server.run_dir)) / "clients" / f"{slot.name}.jsonl"),
                 client_token=s.cfg.server.client_token)
        slot.last = {}

    @staticmethod
    def _seed(s: _Server, slot: _ClientSlot) -> int:
        """A different seed per server, slot and replacement, from the main job's."""
        return slot.seed + 1000 * s.index + 100 * slot.index + slot.generation

    def _replace(self, s: _Server, slot: _ClientSlot, exc: Exception) -> None:
        """A dead client actor (an actor crash, a lost node, ``ray.kill``): a new one in its slot."""
        slot.finished_before += int(slot.last.get("finished", 0))
        slot.last = {}
        limit = self.rcfg.max_client_restarts
        if 0 <= limit <= slot.generation:
            raise LaunchError(f"client {slot.name} died and was replaced {slot.generation} times "
                              f"(ray.max_client_restarts={limit})") from exc
        say(f"[server {s.index}] client actor {slot.name} died ({type(exc).__name__}); starting a new one")
        slot.generation += 1
        self.start_client(s, slot)

    def _call(self, k: int, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Server ``k``'s actor's ``method(*args)``; its death or its error is a :class:`LaunchError`."""
        ray = self.ray
        try:
            return ray.get(getattr(self.servers[k].actor, method).remote(*args), timeout=timeout)
        except ray.exceptions.RayActorError as exc:
            raise LaunchError(f"server {k}'s actor died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            raise LaunchError(str(exc.cause)) from None

    # ------------------------------------------------------------------ the main job's driver protocol
    def start(self) -> list[ServerInfo]:
        cfgs = server_configs(self.cfg, self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.connect()
        self.place(cfgs)
        return [ServerInfo(s.index, s.cfg, str(s.info["url"]), str(s.info["node_id"])) for s in self.servers]

    def boot(self, k: int) -> None:
        self._call(k, "boot")

    def warm_start(self, k: int) -> int:
        return int(self._call(k, "warm_start"))

    def evaluate(self, k: int) -> EvalResult:
        result: EvalResult = self._call(k, "evaluate")
        return result

    def status(self, k: int) -> dict[str, Any]:
        status: dict[str, Any] = self._call(k, "status", timeout=120)
        return status

    def metrics(self, k: int, after_step: int) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self._call(k, "metrics", after_step, timeout=120)
        return rows

    def checkpoint(self, k: int) -> dict[str, Any]:
        answer: dict[str, Any] = self._call(k, "checkpoint")
        return answer

    def start_clients(self, k: int, seed: int) -> None:
        """New client actors the first time; later the live ones resume and a dead one is replaced."""
        ray, s = self.ray, self.servers[k]
        for slot in s.clients:
            slot.seed = seed
            if slot.actor is None:
                self.start_client(s, slot)
                continue
            try:
                slot.last = ray.get(slot.actor.resume.remote(self._seed(s, slot)), timeout=120)
            except ray.exceptions.RayActorError as exc:  # died while paused
                self._replace(s, slot, exc)

    def stop_clients(self, k: int) -> None:
        ray = self.ray
        for slot in self.servers[k].clients:
            if slot.actor is not None:
                try:
                    slot.last = ray.get(slot.actor.pause.remote(), timeout=120)
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    pass  # a dead one is replaced when the clients start again

    def check_clients(self, k: int) -> None:
        """Poll each client actor; replace one that died (an actor crash, a lost node, ``ray.kill``)."""
        ray, s = self.ray, self.servers[k]
        for slot in s.clients:
            if slot.actor is None:
                continue
            try:
                slot.last = ray.get(slot.actor.stats.remote(), timeout=30)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                continue  # a transient loss of contact, or a busy actor: ask again next round
            except ray.exceptions.RayActorError as exc:  # dead for good (max_restarts=0)
                self._replace(s, slot, exc)
                continue
            node = str(slot.last.get("node_id", ""))
            if node and node not in slot.nodes:
                slot.nodes.append(node)

    def clients(self, k: int) -> list[dict[str, Any]]:
        return [{"slot": c.index, "name": c.name, "replacements": c.generation, "finished": c.finished,
                 "nodes": c.nodes} for c in self.servers[k].clients]

    def stop(self) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Stop the servers, kill every actor, free the placement groups, leave the cluster."""
        ray = self.ray
        if not self._connected:
            return
        from ray.util.placement_group import remove_placement_group

        for s in self.servers:
            for slot in s.clients:
                if slot.actor is not None:
                    ray.kill(slot.actor)
        live = [s for s in self.servers if s.actor is not None]
        try:
            ray.get([s.actor.shutdown.remote() for s in live], timeout=60)
        except Exception as exc:  # noqa: BLE001 - a dead server has nothing left to stop
            log.warning("stopping the servers: %s", exc)
        for s in self.servers:
            if s.actor is not None:
                ray.kill(s.actor)
            remove_placement_group(s.pg)
        ray.shutdown()
        self._connected = False


def run_ray(cfg: DictConfig) -> int:
    """``launcher=ray``: run the main job on a Ray cluster; the exit status (2: Ray missing or a bad config)."""
    try:
        driver = RayDriver(cfg)
    except RayMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return run_main_job(driver, cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
