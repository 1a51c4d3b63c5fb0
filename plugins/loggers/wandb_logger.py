"""Logger ``wandb``: a Weights & Biases run per swarm run (``pip install 'swarmkit[wandb]'``).

``wandb.init(dir=RUN_DIR, project=$WANDB_PROJECT or "swarmkit", name=<run dir name>)``,
the (token-free) config, every step's scalars under their ``metrics.jsonl`` names,
and the step's logged trajectories as a table ``trajectories``. Mode: ``$WANDB_MODE``,
else online when ``$WANDB_API_KEY`` is set and offline otherwise (``wandb sync`` uploads
an offline run later): a run never waits on the network unless told to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from swarmkit import hookimpl
from swarmkit_plugins.loggers.common import (
    TRAJECTORY_COLUMNS,
    Runs,
    scalars,
    selected,
    trajectory_rows,
)

_runs: Runs[Any] = Runs()


@hookimpl
def register_loggers(register):
    register("wandb", "Weights & Biases: scalars, config, a trajectories table (offline unless WANDB_API_KEY)",
             requires="wandb", extra="wandb")


@hookimpl
def on_run_start(config: dict[str, Any], run_dir: str) -> None:
    if not run_dir or not selected(config, "wandb"):
        return
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    _runs.open(run_dir, lambda: wandb.init(
        project=os.environ.get("WANDB_PROJECT", "swarmkit"), name=Path(run_dir).name, dir=run_dir,
        config=config, mode=mode, reinit="create_new"))


@hookimpl
def on_step_end(step: int, metrics: dict[str, float], run_dir: str, trajectories: list[dict[str, Any]]) -> None:
    run = _runs.get(run_dir)
    if run is None:
        return
    data: dict[str, Any] = dict(scalars(metrics))
    rows = trajectory_rows(step, trajectories)
    if rows:
        import wandb

        data["trajectories"] = wandb.Table(columns=list(TRAJECTORY_COLUMNS),
                                           data=[[r[c] for c in TRAJECTORY_COLUMNS] for r in rows])
    run.log(data, step=step)


@hookimpl
def on_run_end(summary: dict[str, Any], run_dir: str) -> None:
    run = _runs.pop(run_dir)
    if run is not None:
        run.summary.update({k: v for k, v in summary.items() if isinstance(v, int | float | str)})
        run.finish()
