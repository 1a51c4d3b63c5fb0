"""Logger ``tensorboard``: event files in ``RUN_DIR/tensorboard`` (the default logger).

Scalars as ``train/<metric>``; the step's logged trajectories as a text summary.
Needs the ``tensorboard`` package (``torch.utils.tensorboard``); without it the
run goes on and says so once.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from swarmkit import hookimpl
from swarmkit_plugins.loggers.common import Runs, scalars, selected, trajectory_rows

log = logging.getLogger(__name__)
_runs: Runs[Any] = Runs()


@hookimpl
def register_loggers(register):
    register("tensorboard", "TensorBoard event files in RUN_DIR/tensorboard (train/<metric>; trajectories as text)")


@hookimpl
def on_run_start(config: dict[str, Any], run_dir: str) -> None:
    if not run_dir or not selected(config, "tensorboard"):
        return
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("logger tensorboard: the tensorboard package is not installed (pip install tensorboard); "
                    "metrics.jsonl is written anyway")
        return
    _runs.open(run_dir, lambda: SummaryWriter(os.path.join(run_dir, "tensorboard")))


@hookimpl
def on_step_end(step: int, metrics: dict[str, float], run_dir: str, trajectories: list[dict[str, Any]]) -> None:
    writer = _runs.get(run_dir)
    if writer is None:
        return
    for key, value in scalars(metrics).items():
        writer.add_scalar(f"train/{key}", value, step)
    for row in trajectory_rows(step, trajectories):
        writer.add_text(f"trajectories/{row['task_id']}",
                        f"**{row['episode_id']}** reward {row['reward']}\n\n    "
                        + (row["prompt"] + "⟦" + row["completion"] + "⟧").replace("\n", "\n    "), step)
    writer.flush()


@hookimpl
def on_run_end(summary: dict[str, Any], run_dir: str) -> None:
    writer = _runs.pop(run_dir)
    if writer is not None:
        writer.close()
