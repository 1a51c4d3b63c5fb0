"""Logger ``mlflow``: an MLflow run per swarm run (``pip install 'swarmkit[mlflow]'``).

Tracking URI ``$MLFLOW_TRACKING_URI``, else a local file store in ``RUN_DIR/mlruns``
(``MLFLOW_ALLOW_FILE_STORE=true`` is set for it: MLflow 3 keeps that store behind an opt-in);
experiment ``$MLFLOW_EXPERIMENT_NAME`` or ``swarmkit``. Logs the flattened (token-free)
config as params, every step's scalars under their ``metrics.jsonl`` names (``/`` written as
``.``: :func:`mlflow_name`), and the
step's logged trajectories as the artifact ``trajectories/step_<N>.json``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from swarmkit import hookimpl
from swarmkit_plugins.loggers.common import Runs, scalars, selected, trajectory_rows

_runs: Runs[Any] = Runs()


@hookimpl
def register_loggers(register):
    register("mlflow", "MLflow: params, scalars, trajectories as JSON artifacts (file store in RUN_DIR/mlruns "
             "unless MLFLOW_TRACKING_URI)", requires="mlflow", extra="mlflow")


def mlflow_name(metric: str) -> str:
    """The MLflow name of a metric: ``/`` written as ``.`` (``reward_mean/calc`` -> ``reward_mean.calc``);
    the file store makes ``/`` a folder, which collides with the metric ``reward_mean`` itself."""
    return metric.replace("/", ".")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, name + "."))
        else:
            out[name] = str(value)[:500]
    return out


@hookimpl
def on_run_start(config: dict[str, Any], run_dir: str) -> None:
    if not run_dir or not selected(config, "mlflow"):
        return
    from mlflow.tracking import MlflowClient

    def start() -> tuple[Any, str]:
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:  # the local file store (MLflow 3 asks for this opt-in; mlflow-skinny has no SQL store)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = Path(run_dir, "mlruns").resolve().as_uri()
        client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "swarmkit")
        experiment = client.get_experiment_by_name(name)
        exp_id = experiment.experiment_id if experiment is not None else client.create_experiment(name)
        run = client.create_run(exp_id, run_name=Path(run_dir).name)
        params = _flat(config)
        for start_at in range(0, len(params), 100):  # MLflow's batch limit
            from mlflow.entities import Param

            client.log_batch(run.info.run_id, params=[Param(k, v) for k, v in
                                                      list(params.items())[start_at:start_at + 100]])
        return client, run.info.run_id

    _runs.open(run_dir, start)


@hookimpl
def on_step_end(step: int, metrics: dict[str, float], run_dir: str, trajectories: list[dict[str, Any]]) -> None:
    handle = _runs.get(run_dir)
    if handle is None:
        return
    client, run_id = handle
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    values = [Metric(mlflow_name(k), v, now, step) for k, v in scalars(metrics).items()]
    for start_at in range(0, len(values), 1000):
        client.log_batch(run_id, metrics=values[start_at:start_at + 1000])
    rows = trajectory_rows(step, trajectories)
    if rows:
        client.log_dict(run_id, {"step": step, "rows": rows}, f"trajectories/step_{step:06d}.json")


@hookimpl
def on_run_end(summary: dict[str, Any], run_dir: str) -> None:
    handle = _runs.pop(run_dir)
    if handle is not None:
        client, run_id = handle
        client.set_terminated(run_id, "FINISHED")
