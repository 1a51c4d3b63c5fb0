"""Training in a torchrun group of ``optim.nprocs`` processes, driven from the swarm server.

The server process keeps the pool, the cycle and the inference engine; the
optimizer engine (``fsdp`` or ``deepspeed``) lives in ``nprocs`` processes
started with ``torch.distributed.run`` (gloo on CPU, NCCL on CUDA).
:class:`ProcessGroupEngine` has the engine interface the trainer uses
(:class:`swarmkit.contract.OptimEngine`: ``train_step``, ``export_weights``,
checkpoints, ``optimizer_steps`` / ``train_steps``), so the rest of the server does not
know the difference.

Wire: the server listens on 127.0.0.1 (an ephemeral port, a fresh 32-byte
authkey handed to the group in its environment); rank 0 connects back.
Commands are ``(name, args)`` tuples; rank 0 broadcasts each to every rank,
all ranks run it, and rank 0 answers ``("ok", result, state)`` or
``("error", message, state)`` after an all-gather of the ranks' errors, so a
failure on any rank comes back as a clear error and the group keeps serving.
Exported weights go through a safetensors file in ``/dev/shm`` (rank 0
writes it, the server reads it), or over the connection when rank 0 runs on
another host.

Several hosts (``optim.nnodes > 1``): the group forms through torch's c10d
rendezvous at ``optim.rdzv_endpoint``, whose store this server's torchrun
hosts; the server writes a join spec (``group_join.json``, mode 0600: it holds
the authkey) and every other host runs ``python -m swarmkit join --spec FILE``
(:mod:`swarmkit.apps.join`), which starts the same worker command on that host.
Global rank 0 may land on any node; it connects back to ``optim.group_host``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from swarmkit.contract import OptimEngine, TrainSample
from swarmkit.errors import ConfigError
from swarmkit.runfiles import write_json
from swarmkit.training.config import LAUNCHER_ONLY_KEYS, check_group_launch, launch_config
from swarmkit.weights import load_weights, save_weights, weights_from_bytes, weights_to_bytes

log = logging.getLogger("swarmkit.training.group")

AUTHKEY_ENV = "SWARMKIT_GROUP_AUTHKEY"
#: the join spec's file name, beside the group's log (``RUN_DIR/group_join.json`` under a server)
JOIN_SPEC_NAME = "group_join.json"
JOIN_SPEC_VERSION = 1
_JOIN_SPEC_KEYS = ("engine", "model", "model_cfg", "optim_cfg", "algo_cfg", "threads", "nnodes", "nprocs",
                   "rdzv_endpoint", "rdzv_id", "start_timeout_s", "serve", "shm", "authkey")


class GroupError(RuntimeError):
    """The training group failed a command, or died."""


def group_command(spec: Mapping[str, Any], host: bool = True, local_addr: str | None = None) -> list[str]:
    """The torchrun command of one node of the group described by ``spec`` (a join spec).

    One node (``nnodes == 1``): ``--standalone``. Several: the c10d rendezvous at
    ``rdzv_endpoint``, whose store the node with ``host=True`` (the server's) runs.
    ``local_addr``: the address the other nodes reach this one at (torchrun's default: its FQDN).
    No secret is on the command line (the authkey travels in the environment, :func:`group_env`).
    """
    nnodes, nprocs = int(spec["nnodes"]), int(spec["nprocs"])
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if nnodes <= 1:
        cmd += ["--standalone", "--nproc_per_node", str(nprocs)]
    else:
        conf = f"is_host={str(host).lower()},join_timeout={max(1, int(float(spec['start_timeout_s'])))}"
        cmd += ["--nnodes", str(nnodes), "--nproc_per_node", str(nprocs), "--rdzv_backend", "c10d",
                "--rdzv_endpoint", str(spec["rdzv_endpoint"]), "--rdzv_id", str(spec["rdzv_id"]),
                "--rdzv_conf", conf]
        if local_addr:
            cmd += ["--local_addr", local_addr]
    return cmd + [
        "-m", "swarmkit.training.worker", "--engine", str(spec["engine"]), "--model", str(spec["model"]),
        "--model-cfg", json.dumps(spec["model_cfg"]), "--optim-cfg", json.dumps(spec["optim_cfg"]),
        "--algo-cfg", json.dumps(spec["algo_cfg"]), "--threads", str(spec["threads"]),
        "--serve", str(spec["serve"]), "--world", str(nnodes * nprocs), "--shm", str(spec["shm"])]


def group_env(authkey_hex: str) -> dict[str, str]:
    """The environment of a node's torchrun: this one, with the authkey and without a parent's rank variables."""
    env = {**os.environ, AUTHKEY_ENV: authkey_hex, "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def write_join_spec(spec: Mapping[str, Any], path: str | Path) -> None:
    """Write ``spec`` to ``path`` as JSON, mode 0600 from its creation (it holds the authkey), atomically."""
    write_json(path, {"version": JOIN_SPEC_VERSION, **spec}, mode=0o600)


def read_join_spec(path: str | Path) -> dict[str, Any]:
    """The join spec at ``path``.

    :raises GroupError: the file is missing, not a join spec, or of another version.
    """
    try:
        spec = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise GroupError(f"no join spec at {path}: the server writes RUN_DIR/{JOIN_SPEC_NAME} when it starts "
                         "a group with optim.nnodes > 1; copy it to this host (keep it private: it holds "
                         "the group's authkey)") from None
    except (OSError, ValueError) as exc:
        raise GroupError(f"cannot read the join spec {path}: {exc}") from None
    if not isinstance(spec, dict) or spec.get("version") != JOIN_SPEC_VERSION:
        raise GroupError(f"{path} is not a version-{JOIN_SPEC_VERSION} swarmkit join spec")
    missing = [k for k in _JOIN_SPEC_KEYS if k not in spec]
    if missing:
        raise GroupError(f"the join spec {path} misses {', '.join(missing)}")
    if int(spec["nnodes"]) < 2:
        raise GroupError(f"the join spec {path} is for a one-node group: nothing to join")
    return spec


class ProcessGroupEngine(OptimEngine):
    """An optimizer engine trained by ``nprocs`` torchrun processes.

    :param engine: ``"fsdp"`` or ``"deepspeed"`` (the ``optim`` option every rank builds).
    :param nprocs: processes in the group (``--nproc_per_node``).
    :param model_path: a resolved local model folder.
    :param model_cfg / optim_cfg / algo_cfg: the ``model`` / ``optim`` / ``algo`` groups (plain dicts).
    :param log_path: where the group's stdout/stderr go (default: a temporary file).
    :param join_spec_path: with ``optim.nnodes > 1``, where the join spec goes (default:
        ``group_join.json`` beside ``log_path``); removed when the group closes.
    :raises GroupError: the group did not start (the message ends with its log).
    :raises ConfigError: inconsistent multi-node keys (``nnodes``, ``rdzv_endpoint``, ...).
    """

    def __init__(self, engine: str, nprocs: int, model_path: str, model_cfg: dict[str, Any],
                 optim_cfg: dict[str, Any], algo_cfg: dict[str, Any], log_path: str | Path | None = None,
                 join_spec_path: str | Path | None = None):
        self.engine_name = engine
        self.nprocs = int(nprocs)
        #: the launch keys of ``optim_cfg`` (its EngineConfig's), typed
        self.launch = launch_config(optim_cfg)
        #: hosts in the group (torchrun --nnodes); the group has nnodes x nprocs ranks
        self.nnodes = self.launch.nnodes
        problems = check_group_launch(self.launch)
        if problems:
            raise ConfigError(problems)
        self.start_timeout_s = self.launch.group_start_timeout_s
        self.step_timeout_s = self.launch.group_step_timeout_s
        self.optimizer_steps = 0
        self.train_steps = 0
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._shm = Path(tempfile.mkdtemp(prefix="swarmkit-group-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.log_path = Path(log_path) if log_path else self._shm / "group.log"
        #: with nnodes > 1: the join spec the other hosts run ``python -m swarmkit join --spec`` with
        self.join_spec_path: Path | None = None
        # rank 0 reads this back to tell whether it shares this host's /dev/shm (weights by file)
        self._shm_id = secrets.token_hex(8)
        (self._shm / "server.id").write_text(self._shm_id)
        self._shared_shm = True
        key = secrets.token_bytes(32)
        if self.nnodes > 1:
            listen = (self.launch.group_host, self.launch.group_port)
        else:
            listen = ("127.0.0.1", 0)
        listener = Listener(listen, authkey=key)
        host, port = listener.address
        inner_optim = {k: v for k, v in optim_cfg.items() if k not in LAUNCHER_ONLY_KEYS}
        inner_optim["name"] = engine
        spec: dict[str, Any] = {
            "engine": engine, "model": str(model_path), "model_cfg": model_cfg, "optim_cfg": inner_optim,
            "algo_cfg": algo_cfg, "threads": self.launch.threads_per_rank, "nnodes": self.nnodes,
            "nprocs": self.nprocs, "rdzv_endpoint": self.launch.rdzv_endpoint,
            "rdzv_id": self.launch.rdzv_id or f"swarmkit-{secrets.token_hex(6)}",
            "start_timeout_s": self.start_timeout_s, "serve": f"{host}:{port}", "shm": str(self._shm),
            "authkey": key.hex()}
        local_addr = None
        if self.nnodes > 1:
            self.join_spec_path = Path(join_spec_path) if join_spec_path else self.log_path.parent / JOIN_SPEC_NAME
            write_join_spec(spec, self.join_spec_path)
            local_addr = spec["rdzv_endpoint"].rpartition(":")[0]  # this host, as the other nodes reach it
            log.info("training group: waiting %.0f s for %d more node(s) at the rendezvous %s; on each, run: "
                     "python -m swarmkit join --spec %s", self.start_timeout_s, self.nnodes - 1,
                     spec["rdzv_endpoint"], self.join_spec_path)
        self._spec_hint = (f"{self.nnodes} nodes x {self.nprocs} process(es) were expected at the rendezvous "
                           f"{spec['rdzv_endpoint']} (rdzv_id {spec['rdzv_id']}) within {self.start_timeout_s:.0f} s; "
                           f"start each other node with `python -m swarmkit join --spec {self.join_spec_path}` "
                           "(the spec copied to that host)") if self.nnodes > 1 else ""
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the group's life
        self._proc = subprocess.Popen(group_command(spec, host=True, local_addr=local_addr),
                                      env=group_env(key.hex()), stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            try:
                self._conn = self._accept(listener)
            except GroupError as exc:
                if not self._spec_hint:
                    raise
                raise GroupError(f"the training group did not form: {self._spec_hint}.\n{exc}") from None
            state = self._recv(self.start_timeout_s, "start")
        except BaseException:
            self.close()
            raise
        finally:
            listener.close()
        _, hello, group_state = state
        self._set_state(group_state)
        #: ranks in the group, as torch.distributed reports it
        self.world = int(hello["world"])
        self._shared_shm = hello.get("shm_id") == self._shm_id
        if self.world != self.nnodes * self.nprocs:
            self.close()
            raise GroupError(f"the training group has {self.world} ranks, expected {self.nnodes * self.nprocs} "
                             f"({self.nnodes} node(s) x {self.nprocs})")
        log.info("training group up: %s%d x %s (pid %d, log %s)", f"{self.nnodes} nodes x " if self.nnodes > 1 else "",
                 self.nprocs, engine, self._proc.pid, self.log_path)

    # ------------------------------------------------------------------ engine interface
    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step of the group over ``batch`` (a list of ``TrainSample``)."""
        return dict(self._call("train_step", [s.to_dict() for s in batch]))

    def export_weights(self) -> Iterable[tuple[str, Any]]:
        """Full HF-named weights (LoRA merged), read from the file rank 0 wrote; CPU tensors."""
        if not self._shared_shm:  # rank 0 on another host: the file comes over the connection
            return list(weights_from_bytes(self._call("export_weights", None)).items())
        path = self._shm / "weights.safetensors"
        self._call("export_weights", str(path))
        try:
            return list(load_weights(path).items())
        finally:
            path.unlink(missing_ok=True)

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", str(path))

    def set_lr_factor(self, factor: float) -> None:
        """Every rank's :meth:`~swarmkit.training.engine.TrainingEngine.set_lr_factor`."""
        self._call("set_lr_factor", float(factor))
        self._lr_factor = float(factor)

    @property
    def alive(self) -> bool:
        """True while the group's launcher runs."""
        return self._proc.poll() is None

    def close(self, timeout: float = 60.0) -> None:
        """Stop the group (a ``close`` command, then SIGTERM / SIGKILL of its process group)."""
        with self._lock:
            connected = self._conn is not None
            if self._conn is not None:
                try:
                    self._conn.send(("close", None))
                except OSError:
                    pass
                self._conn.close()
                self._conn = None
        if self._proc.poll() is None:
            try:
                self._proc.wait(timeout if connected else 0.1)  # a group that never connected: stop it now
            except subprocess.TimeoutExpired:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(self._proc.pid, sig)
                        self._proc.wait(10)
                        break
                    except (ProcessLookupError, subprocess.TimeoutExpired):
                        continue
        if not self._log.closed:
            self._log.close()
        if self.join_spec_path is not None:  # its authkey is spent; a node started later waits for a fresh one
            self.join_spec_path.unlink(missing_ok=True)
        if self.log_path.parent != self._shm:
            shutil.rmtree(self._shm, ignore_errors=True)

    def __del__(self) -> None:  # a forgotten group must not outlive the server
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    # ------------------------------------------------------------------ wire
    def _log_tail(self) -> str:
        try:
            self._log.flush()
            return self.log_path.read_bytes()[-6000:].decode(errors="replace")
        except OSError:
            return ""

    def _dead(self, what: str) -> GroupError:
        return GroupError(f"the training group died during {what} (rc {self._proc.poll()}); "
                          f"its log {self.log_path} ends with:\n{self._log_tail()}")

    def _accept(self, listener: Listener) -> Connection:
        box: dict[str, Any] = {}

        def accept() -> None:
            while True:
                try:
                    box["conn"] = listener.accept()
                    return
                except (AuthenticationError, EOFError, ConnectionError) as exc:
                    # a connection without the authkey (a port scan, a stale node): wait for rank 0
                    log.warning("training group listener: refused a connection (%s)", exc)
                except Exception as exc:  # noqa: BLE001 - reported below
                    box["error"] = exc
                    return

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        end = time.monotonic() + self.start_timeout_s
        while t.is_alive():
            t.join(0.2)
            if self._proc.poll() is not None and t.is_alive():
                raise self._dead("start")
            if time.monotonic() > end:
                raise GroupError(f"the training group did not connect in {self.start_timeout_s:.0f} s; "
                                 f"log:\n{self._log_tail()}")
        conn = box.get("conn")
        if not isinstance(conn, Connection):
            raise GroupError(f"the training group could not connect: {box.get('error')}")
        return conn

    def _recv(self, timeout: float, what: str) -> tuple[Any, ...]:
        assert self._conn is not None
        end = time.monotonic() + timeout
        while not self._conn.poll(0.2):
            if self._proc.poll() is not None:
                raise self._dead(what)
            if time.monotonic() > end:
                raise GroupError(f"the training group did not answer {what} in {timeout:.0f} s")
        try:
            message: tuple[Any, ...] = self._conn.recv()
            return message
        except (EOFError, OSError):
            raise self._dead(what) from None

    def _set_state(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", self.optimizer_steps))
        self.train_steps = int(state.get("train_steps", self.train_steps))

    def _call(self, name: str, arg: Any) -> Any:
        with self._lock:
            if self._conn is None or self._proc.poll() is not None:
                raise self._dead(name) if self._conn is not None else GroupError("the training group is closed")
            try:
                self._conn.send((name, arg))
            except OSError:
                raise self._dead(name) from None
            status, result, state = self._recv(self.step_timeout_s, name)
        self._set_state(state)
        if status != "ok":
            raise GroupError(f"{name} failed in the training group: {result}")
        return result


# ---------------------------------------------------------------------- group side
def _state(engine: Any) -> dict[str, int]:
    return {"optimizer_steps": int(engine.optimizer_steps), "train_steps": int(engine.train_steps)}


def _run(engine: OptimEngine, name: str, arg: Any, rank: int) -> Any:
    if name == "train_step":
        metrics = engine.train_step([TrainSample.from_dict(s) for s in arg])
        return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    if name == "export_weights":  # arg: a file on the server's host, or None: the safetensors bytes
        weights = dict(engine.export_weights())
        if rank == 0:
            if arg is None:
                return weights_to_bytes(weights)
            save_weights(weights, arg)
        return None
    if name == "save_checkpoint":
        Path(arg).mkdir(parents=True, exist_ok=True)
        engine.save_checkpoint(arg)
        return None
    if name == "load_checkpoint":
        engine.load_checkpoint(arg)
        return None
    if name == "set_lr_factor":
        set_lr_factor = getattr(engine, "set_lr_factor", None)
        if set_lr_factor is None:
            raise ValueError(f"{type(engine).__name__} cannot change its learning rate at run time")
        set_lr_factor(float(arg))
        return None
    raise ValueError(f"unknown group command {name!r}")


def _read_shm_id(shm: str) -> str | None:
    try:
        return (Path(shm) / "server.id").read_text() if shm else None
    except OSError:
        return None


def serve(engine: OptimEngine, address: str, shm: str = "") -> None:
    """Every rank: run the commands rank 0 receives from the server until ``close`` (or EOF).

    ``shm``: the server's /dev/shm folder; rank 0 reports the id it finds there, so the server
    knows whether rank 0 shares its host (weights by file) or not (weights over the connection).
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    conn: Connection | None = None
    if rank == 0:
        host, port = address.rsplit(":", 1)
        try:
            conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
        except (OSError, AuthenticationError, EOFError) as exc:
            raise RuntimeError(f"rank 0 cannot reach the server's group listener at {address} ({exc}): on several "
                               "hosts, set optim.group_host to an address of the server that every node reaches, "
                               "open optim.group_port, and join with the server's current spec") from exc
        conn.send(("ok", {"world": world, "shm_id": _read_shm_id(shm)}, _state(engine)))
    while True:
        box: list[Any] = [None]
        if conn is not None:
            try:
                box[0] = conn.recv()
            except (EOFError, OSError):  # the server went away
                box[0] = ("close", None)
        dist.broadcast_object_list(box, src=0)
        name, arg = box[0]
        if name == "close":
            break
        result, error = None, None
        try:
            result = _run(engine, name, arg, rank)
        except Exception as exc:  # noqa: BLE001 - answered to the server, the group keeps serving
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
            traceback.print_exc()
        errors: list[Any] = [None] * world
        dist.all_gather_object(errors, error)
        if conn is not None:
            bad = [e for e in errors if e]
            msg = ("error", "; ".join(bad), _state(engine)) if bad else ("ok", result, _state(engine))
            try:
                conn.send(msg)
            except OSError:
                pass
    if conn is not None:
        conn.close()
