"""``optim.nnodes = 2``: a training group over two "nodes" on 127.0.0.1 (gloo, CPU).

The server-side :class:`ProcessGroupEngine` starts node 0 and hosts the c10d
rendezvous; a second process runs ``python -m swarmkit join --spec FILE`` for
node 1. Same records, same seeds: the two-node group must give the one-process
losses and weights (by file, and over the connection as for a rank 0 on
another host), a connection without the authkey must not stop it from forming,
and a misconfigured or incomplete group must fail clearly.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_train_group import MODEL, OPTIM, _records

from swarmkit.apps.join import main as join_main
from swarmkit.config.compose import compose, validated
from swarmkit.errors import ConfigError
from swarmkit.models import resolve_model_path
from swarmkit.training import Trainer
from swarmkit.training.group import GroupError, ProcessGroupEngine, write_join_spec
from swarmkit.training.samples import build_samples
from swarmkit.training.trainer import build_algo

ALGO = {"name": "grpo"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _two_node_optim(timeout_s: float) -> dict[str, object]:
    return {**OPTIM, "nprocs": 1, "nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{_free_port()}",
            "group_start_timeout_s": timeout_s}


def _group(tmp_path: Path, optim: dict[str, object]) -> ProcessGroupEngine:
    return ProcessGroupEngine("fsdp", 1, str(resolve_model_path(MODEL["path"])), dict(MODEL), optim, ALGO,
                              log_path=tmp_path / "train_group.log")


def _knock(spec: Path) -> None:
    """Once the listener is up, connect without the authkey (as a port scan would) and send junk."""
    end = time.monotonic() + 60
    while not spec.exists() and time.monotonic() < end:
        time.sleep(0.1)
    host, port = json.loads(spec.read_text())["serve"].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"\0\0\0\x05hello")
        time.sleep(0.5)


@pytest.mark.slow
def test_two_nodes_match_one_process(tmp_path, caplog):
    spec = tmp_path / "two" / "group_join.json"
    spec.parent.mkdir()
    knock = threading.Thread(target=_knock, args=(spec,), daemon=True)
    knock.start()
    join_log = open(tmp_path / "join.log", "w")  # noqa: SIM115 - closed below
    # node 1 starts first and waits for the spec, as on a cluster whose hosts start together
    node1 = subprocess.Popen([sys.executable, "-m", "swarmkit", "join", "--spec", str(spec), "--wait", "120"],
                             stdout=join_log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    one = Trainer(MODEL, {**OPTIM, "nprocs": 1}, ALGO, run_dir=tmp_path / "one")
    group = None
    try:
        group = _group(tmp_path / "two", _two_node_optim(120))
        assert group.world == 2 and group.nnodes == 2 and group.alive
        assert "refused a connection" in caplog.text  # the stray connection did not end the start
        assert stat.S_IMODE(spec.stat().st_mode) == 0o600
        assert "authkey" in json.loads(spec.read_text())
        algo = build_algo(ALGO)
        for step in range(2):
            a = one.step(_records(step))
            b = group.train_step(build_samples(_records(step), algo, "text"))
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
            assert b["trained_tokens"] == a["trained_tokens"]
        assert group.optimizer_steps == one.global_step == 2
        wa = dict(one.export_weights())
        by_file = dict(group.export_weights())
        group._shared_shm = False  # as for a rank 0 on another host: the weights come over the connection
        by_wire = dict(group.export_weights())
        assert wa.keys() == by_file.keys() == by_wire.keys()
        for k in wa:
            torch.testing.assert_close(by_file[k].float(), wa[k].float().cpu(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(by_wire[k], by_file[k], rtol=0, atol=0)
    finally:
        one.close()
        if group is not None:
            group.close()
        try:
            rc = node1.wait(60)
        finally:
            if node1.poll() is None:
                node1.kill()
            join_log.close()
    out = (tmp_path / "join.log").read_text()
    assert rc == 0, out[-4000:]
    assert "the training group closed" in out
    assert not spec.exists()  # its authkey is spent: removed with the group
    assert not group.alive


@pytest.mark.slow
def test_a_node_that_never_joins_is_a_clear_error(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(GroupError, match="did not form") as err:
        _group(tmp_path, _two_node_optim(8))
    assert "python -m swarmkit join --spec" in str(err.value) and "2 nodes x 1" in str(err.value)
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "group_join.json").exists()


def test_nnodes_needs_a_rendezvous_endpoint(tmp_path):
    with pytest.raises(ConfigError, match="optim.rdzv_endpoint: optim.nnodes=2 needs HOST:PORT"):
        validated(compose(["optim.nnodes=2"]))
    with pytest.raises(ConfigError, match="optim.group_host: 127.0.0.1 is loopback"):
        validated(compose(["optim.nnodes=2", "optim.rdzv_endpoint=10.0.0.1:29400"]))
    with pytest.raises(ConfigError, match="optim.nnodes: must be >= 1"):
        validated(compose(["optim.nnodes=0"]))
    ok = validated(compose(["optim=deepspeed", "optim.nnodes=2", "optim.rdzv_endpoint=10.0.0.1:29400",
                            "optim.group_host=10.0.0.1", "optim.group_port=29401"]))
    assert ok.optim.nnodes == 2 and ok.optim.group_port == 29401
    with pytest.raises(ConfigError, match="rdzv_endpoint"):  # the engine checks too, before starting anything
        ProcessGroupEngine("fsdp", 1, "unused", dict(MODEL), {**OPTIM, "nnodes": 2}, ALGO, log_path=tmp_path / "g.log")


def test_join_without_a_spec_or_a_rendezvous_says_why(tmp_path, capsys):
    assert join_main(["--spec", str(tmp_path / "missing.json"), "--wait", "0"]) == 1
    assert "no join spec at" in capsys.readouterr().err
    spec = {"engine": "fsdp", "model": "builtin:tiny", "model_cfg": MODEL, "optim_cfg": OPTIM, "algo_cfg": ALGO,
            "threads": 1, "nnodes": 2, "nprocs": 1, "rdzv_endpoint": f"127.0.0.1:{_free_port()}", "rdzv_id": "x",
            "start_timeout_s": 5, "serve": "127.0.0.1:1", "shm": "", "authkey": "00"}
    write_join_spec(spec, tmp_path / "group_join.json")
    assert join_main(["--spec", str(tmp_path / "group_join.json"), "--wait", "1"]) == 1
    assert "cannot reach the rendezvous at 127.0.0.1:" in capsys.readouterr().err


@pytest.mark.slow
def test_the_main_job_trains_and_learns_with_a_second_node(tmp_path):
    """The user's path: ``python -m swarmkit optim.nnodes=2 ...`` on this host, ``python -m swarmkit join
    --spec RUN_DIR/group_join.json`` as the second host; the job trains every step in the two-node group."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1", OMP_NUM_THREADS="1")
    spec = tmp_path / "group_join.json"
    joiner = subprocess.Popen([sys.executable, "-m", "swarmkit", "join", "--spec", str(spec), "--wait", "300"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "swarmkit", "model=tiny", "task=token_rule", "task.max_tokens=8",
             "batching.batch_size=4", "batching.rollouts_per_task=8", "optim.lr=1e-2", "trainer.total_steps=30",
             "optim.nnodes=2", f"optim.rdzv_endpoint=127.0.0.1:{_free_port()}", "optim.group_start_timeout_s=300",
             "server.port=0", f"hydra.run.dir={tmp_path}"],
            capture_output=True, text=True, env=env, timeout=900)
        joined = joiner.communicate(timeout=120)[0]
    finally:
        if joiner.poll() is None:
            joiner.kill()
    assert out.returncode == 0, out.stderr[-3000:]
    assert joiner.returncode == 0, joined[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] >= 30
    assert summary["eval_after"]["mean"] >= 0.4 and summary["eval_after"]["mean"] > summary["eval_before"]["mean"] + 0.3
    assert not spec.exists()  # the spec (its authkey) is removed when the group closes
