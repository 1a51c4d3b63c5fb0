"""The logger plugins (tensorboard, wandb, mlflow) on a real server that trains the tiny model.

W&B runs offline (no network, no account) and MLflow writes its local file store;
each is read back with its own library after the server stops.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_cycle_e2e import TOKEN, _env, _free_port, _stop  # noqa: E402

from swarmkit.client import SwarmClient  # noqa: E402
from swarmkit.errors import ConfigError  # noqa: E402

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A server that trained 3 steps with all three loggers, then stopped (run_end)."""
    run_dir = tmp_path_factory.mktemp("loggers-run")
    port = _free_port()
    env = dict(_env(), WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("MLFLOW_TRACKING_URI", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}", f"server.run_dir={run_dir}",
         f"hydra.run.dir={run_dir}/hydra"], env=env, stdout=open(run_dir / "server.out", "ab"),
        stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    ctl = SwarmClient(url, token=TOKEN, retry_for=60)
    client = None
    try:
        ctl.wait_for_state("OFFLINE", timeout=60)
        ctl.configure(["model=tiny", "task=token_rule", "batching=c2", "batching.batch_size=2",
                       "batching.rollouts_per_task=2", "optim.lr=1e-3", "trainer.total_steps=3",
                       "logger=[tensorboard,wandb,mlflow]", "trainer.log_trajectories=1"])
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=120)
        client = subprocess.Popen(
            [sys.executable, "-m", "swarmkit.apps.task_client", "--url", url, "--task", "token_rule",
             "--train-size", "8", "--rollouts-per-task", "2", "--max-tokens", "6", "--concurrency", "2"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while ctl.status()["global_step"] < 3 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert ctl.status()["global_step"] == 3
        _stop([client])
        ctl.stop()
        ctl.wait_for_state("OFFLINE", timeout=120)
        yield run_dir
    finally:
        _stop([p for p in (client, server) if p is not None])
        ctl.close()


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_gets_every_step(finished_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(finished_run / "tensorboard"))
    acc.Reload()
    loss = acc.Scalars("train/loss")
    rows = _steps(finished_run)
    assert [e.step for e in loss] == [r["step"] for r in rows] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in rows], rel=1e-5, abs=1e-7)
    assert "train/reward_mean/token_rule" in acc.Tags()["scalars"]


def _wandb_records(path: Path) -> list:
    """The protobuf records of an offline W&B run file (a LevelDB-style log: 32 KiB blocks of
    ``<crc u32, length u16, type u8>``-headed chunks after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, chunks, pending = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
            pending = b""
        else:
            break
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_has_the_metrics_and_a_trajectory_table(finished_run):
    runs = list((finished_run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    records = _wandb_records(next(runs[0].glob("run-*.wandb")))
    history = [{_key(i): json.loads(i.value_json) for i in r.history.item} for r in records
               if r.WhichOneof("record_type") == "history"]
    rows = _steps(finished_run)
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in rows], rel=1e-5, abs=1e-7)
    assert all(h["trajectories/_type"] == "table-file" for h in history)
    summary = {_key(i): json.loads(i.value_json) for r in records if r.WhichOneof("record_type") == "summary"
               for i in r.summary.update}
    assert summary["global_step"] == 3 and summary["reason"] == "stopped by the controller"
    config = {_key(i): i.value_json for r in records if r.WhichOneof("record_type") == "run" for i in r.run.config.update}
    assert "token_rule" in config["task"] and TOKEN not in json.dumps(config)
    tables = list((runs[0] / "files" / "media" / "table").glob("trajectories_*.table.json"))
    assert len(tables) == 3
    table = json.loads(tables[0].read_text())
    assert table["columns"][:4] == ["step", "episode_id", "task_id", "reward"] and table["data"]


def test_mlflow_file_store_has_params_metrics_and_trajectory_artifacts(finished_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(finished_run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("swarmkit")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["batching.name"] == "c2" and run.data.params["logger"].startswith("[")
    assert TOKEN not in json.dumps(run.data.params)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert client.get_metric_history(run.info.run_id, "reward_mean.token_rule")
    rows = _steps(finished_run)
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx([r["loss"] for r in rows], rel=1e-5, abs=1e-7)
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "trajectories")]
    assert artifacts == [f"trajectories/step_{k:06d}.json" for k in (1, 2, 3)]
    local = client.download_artifacts(run.info.run_id, artifacts[0], str(finished_run / "dl"))
    rows = json.loads(Path(local).read_text())["rows"]
    assert rows and rows[0]["completion"] and rows[0]["trained_tokens"] > 0


def test_logger_names_are_checked_with_the_config():
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry
    from swarmkit.plugins.loader import LoggerInfo

    base = {"model": {"path": "builtin:tiny"}, "backend": "hf", "optim": "fsdp", "algo": "grpo", "match": "text",
            "batching": "c2"}
    assert list(validate_config({**base, "logger": ["tensorboard", "mlflow"]}, get_registry()).logger) == \
        ["tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match="unknown logger 'nope'; installed loggers: mlflow, tensorboard, wandb"):
        validate_config({**base, "logger": ["nope"]}, get_registry())
    with pytest.raises(ConfigError, match="expected a list of logger names"):
        validate_config({**base, "logger": "wandb"}, get_registry())
    missing = LoggerInfo("x", "", "no_such_module_xyz", "x", "p").missing()
    assert missing == "logger 'x' needs the no_such_module_xyz package: pip install 'swarmkit[x]'"
