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
writes it, the server reads it).
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
from collections.abc import Iterable, Sequence
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

from swarmkit.contract import OptimEngine, TrainSample

log = logging.getLogger("swarmkit.training.group")

AUTHKEY_ENV = "SWARMKIT_GROUP_AUTHKEY"
#: engine options the launcher consumes (the engines in the group see nprocs = 1's meaning: "this rank")
_LAUNCH_KEYS = ("nprocs", "group_start_timeout_s", "group_step_timeout_s")


class GroupError(RuntimeError):
    """The training group failed a command, or died."""


class ProcessGroupEngine(OptimEngine):
    """An optimizer engine trained by ``nprocs`` torchrun processes.

    :param engine: ``"fsdp"`` or ``"deepspeed"`` (the ``optim`` option every rank builds).
    :param nprocs: processes in the group (``--nproc_per_node``).
    :param model_path: a resolved local model folder.
    :param model_cfg / optim_cfg / algo_cfg: the ``model`` / ``optim`` / ``algo`` groups (plain dicts).
    :param log_path: where the group's stdout/stderr go (default: a temporary file).
    :raises GroupError: the group did not start (the message ends with its log).
    """

    def __init__(self, engine: str, nprocs: int, model_path: str, model_cfg: dict[str, Any],
                 optim_cfg: dict[str, Any], algo_cfg: dict[str, Any], log_path: str | Path | None = None):
        self.engine_name = engine
        self.nprocs = int(nprocs)
        self.start_timeout_s = float(optim_cfg.get("group_start_timeout_s", 600.0))
        self.step_timeout_s = float(optim_cfg.get("group_step_timeout_s", 3600.0))
        self.optimizer_steps = 0
        self.train_steps = 0
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._shm = Path(tempfile.mkdtemp(prefix="swarmkit-group-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        self.log_path = Path(log_path) if log_path else self._shm / "group.log"
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        host, port = listener.address
        inner_optim = {k: v for k, v in optim_cfg.items() if k not in _LAUNCH_KEYS}
        inner_optim["name"] = engine
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(self.nprocs),
               "-m", "swarmkit.training.worker", "--engine", engine, "--model", str(model_path),
               "--model-cfg", json.dumps(model_cfg), "--optim-cfg", json.dumps(inner_optim),
               "--algo-cfg", json.dumps(algo_cfg), "--threads", str(optim_cfg.get("threads_per_rank", 1)),
               "--serve", f"{host}:{port}"]
        env = {**os.environ, AUTHKEY_ENV: key.hex(), "TOKENIZERS_PARALLELISM": "false",
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the group's life
        self._proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            self._conn = self._accept(listener)
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
        if self.world != self.nprocs:
            self.close()
            raise GroupError(f"the training group has {self.world} ranks, expected {self.nprocs}")
        log.info("training group up: %d x %s (pid %d, log %s)", self.nprocs, engine, self._proc.pid, self.log_path)

    # ------------------------------------------------------------------ engine interface
    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """One optimizer step of the group over ``batch`` (a list of ``TrainSample``)."""
        return dict(self._call("train_step", [s.to_dict() for s in batch]))

    def export_weights(self) -> Iterable[tuple[str, Any]]:
        """Full HF-named weights (LoRA merged), read from the file rank 0 wrote; CPU tensors."""
        from safetensors.torch import load_file

        path = self._shm / "weights.safetensors"
        self._call("export_weights", str(path))
        try:
            return list(load_file(str(path)).items())
        finally:
            path.unlink(missing_ok=True)

    def save_checkpoint(self, path: str) -> None:
        self._call("save_checkpoint", str(path))

    def load_checkpoint(self, path: str) -> None:
        self._call("load_checkpoint", str(path))

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
            try:
                box["conn"] = listener.accept()
            except Exception as exc:  # noqa: BLE001 - reported below
                box["error"] = exc

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


def save_weights(weights: dict[str, Any], path: str | Path) -> None:
    """Write named tensors to a safetensors file (CPU copies; tied tensors get their own
    storage, which safetensors requires); written beside and renamed, so readers never see half."""
    from safetensors.torch import save_file

    out, seen = {}, set()
    for k, v in weights.items():
        v = v.detach().to("cpu").contiguous()
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    tmp = f"{path}.tmp"
    save_file(out, tmp)
    os.replace(tmp, path)


def _run(engine: OptimEngine, name: str, arg: Any, rank: int) -> Any:
    if name == "train_step":
        metrics = engine.train_step([TrainSample.from_dict(s) for s in arg])
        return {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
    if name == "export_weights":
        weights = dict(engine.export_weights())
        if rank == 0:
            save_weights(weights, arg)
        return None
    if name == "save_checkpoint":
        Path(arg).mkdir(parents=True, exist_ok=True)
        engine.save_checkpoint(arg)
        return None
    if name == "load_checkpoint":
        engine.load_checkpoint(arg)
        return None
    raise ValueError(f"unknown group command {name!r}")


def serve(engine: OptimEngine, address: str) -> None:
    """Every rank: run the commands rank 0 receives from the server until ``close`` (or EOF)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    conn: Connection | None = None
    if rank == 0:
        host, port = address.rsplit(":", 1)
        conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
        conn.send(("ok", {"world": world}, _state(engine)))
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
