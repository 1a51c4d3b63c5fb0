"""The composition root: one place that wires a server, its training cycle and its trainer.

Nothing below this module builds a trainer or a pool for a server, and
nothing rewires a server after construction: :func:`build_server` makes the
:class:`~swarmkit.swarm.cycle.TrainingCycle` (journal, batching policy, and a
factory for :class:`~swarmkit.training.Trainer`) and hands it to the
:class:`~swarmkit.swarm.server.SwarmServer` constructor.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from starlette.applications import Starlette

from swarmkit.config.plain import as_dict
from swarmkit.config.schema import TrainerConfig
from swarmkit.server.app import create_app
from swarmkit.swarm.cycle import StepFn, TrainingCycle
from swarmkit.swarm.server import SwarmServer
from swarmkit.training import Trainer


def make_trainer(cfg: dict[str, Any], run_dir: Path) -> Trainer:
    """The trainer of a validated training config (``model``, ``optim``, ``algo``, ``match``, ``seed``,
    ``trainer.mode``, which the algorithm may resolve its keys by)."""
    return Trainer(cfg["model"], cfg["optim"], cfg["algo"], match=cfg["match"], run_dir=run_dir,
                   seed=int(cfg["seed"]), trainer_mode=TrainerConfig(**as_dict(cfg.get("trainer"))).mode)


def build_server(cfg: Any, *, train: bool = True, step_fn: StepFn | None = None,
                 **server_kwargs: Any) -> tuple[SwarmServer, Starlette]:
    """A server and its app from a full config (only ``server`` is read) or a ``server`` group.

    :param train: wire in the training cycle (journal + batching policy + trainer);
        ``False`` keeps accepted episodes in memory only (unless ``cycle=`` is given).
    :param step_fn: a custom step function for the cycle (replaces the trainer).
    :param server_kwargs: passed to :class:`SwarmServer` (``config=``, ``backend_factory=``,
        ``cycle=``, ``admin_token=``, ``renderer_factory=``).
    """
    full = as_dict(cfg)
    scfg = dict(as_dict(full["server"])) if "server" in full else full
    if not scfg.get("run_dir") or scfg.get("run_dir") == "auto":
        scfg["run_dir"] = str(Path("runs") / time.strftime("server_%Y-%m-%d_%H-%M-%S"))
    if train and "cycle" not in server_kwargs:
        server_kwargs["cycle"] = TrainingCycle(scfg["run_dir"], trainer_factory=make_trainer, step_fn=step_fn)
    srv = SwarmServer(scfg, **server_kwargs)
    return srv, create_app(srv)
