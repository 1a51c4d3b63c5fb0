"""``launcher=ray``: the config it reads, and a run on a simulated two-node Ray cluster (CPU).

The slow test: two servers and two clients placed by Ray train and learn; a client actor killed
mid-run is replaced and nothing it was told is accepted is lost. The job runs as the one-line
command a user types (``python -m swarmkit launcher=ray ray.address=...``) in a subprocess; this
process is a second driver on the same cluster (to find and kill the actor).
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmkit.apps.ray_launcher import run_ray, server_configs
from swarmkit.config.compose import compose_checked
from swarmkit.errors import ConfigError

STEPS = 30
NAMESPACE = "swarmkit-test-ray"


def _journal(run_dir: Path) -> dict[str, str]:
    db = sqlite3.connect(f"file:{run_dir / 'journal.sqlite'}?mode=ro", uri=True, timeout=10)
    try:
        return dict(db.execute("SELECT episode_id, status FROM episodes").fetchall())
    finally:
        db.close()


def _accepted(run_dir: Path) -> dict[str, list[str]]:
    """Episode ids each client actor logged as accepted (written only after the server's answer)."""
    return {p.stem: [json.loads(line)["episode_id"] for line in p.read_text().splitlines() if line.strip()]
            for p in sorted((run_dir / "clients").glob("*.jsonl"))}


def _step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step") or 0 for line in path.read_text().splitlines()[:-1] if line.strip()]
    return max(steps, default=0)


def test_plan_validates_the_ray_config_and_reports_every_problem():
    cfg = compose_checked(["launcher=ray", "ray.servers=2", 'ray.server_overrides=["seed=1 optim.lr=0.02","seed=2"]'])
    assert cfg.launcher == "ray" and cfg.ray.servers == 2 and cfg.ray.address == "auto"
    with pytest.raises(ConfigError) as err:
        compose_checked(["launcher=k8s", "ray.servers=0", "ray.client_cpus=0", "ray.placement_strategy=ANY",
                         'ray.server_overrides=["seed=1"]'])
    text = str(err.value)
    for needle in ("launcher: 'k8s'", "ray.servers: must be >= 1", "ray.client_cpus: must be > 0",
                   "ray.placement_strategy: 'ANY'", "ray.server_overrides: 1 override set(s)"):
        assert needle in text, needle
    with pytest.raises(ConfigError, match="ray.nope: unknown key"):
        compose_checked(["launcher=ray", "ray.nope=1"])


def test_server_configs_lay_each_servers_overrides_over_the_job(tmp_path):
    cfg = compose_checked(["launcher=ray", "model=tiny", "ray.servers=2",
                           "ray.server_overrides=['task.options.target=a optim.lr=0.02','seed=3']"])
    a, b = server_configs(cfg, tmp_path)
    assert (a.task.options.target, a.optim.lr, a.seed) == ("a", 0.02, cfg.seed)
    assert (b.seed, b.optim.lr) == (3, cfg.optim.lr)
    assert a.server.run_dir == str(tmp_path / "server_0") and b.server.run_dir == str(tmp_path / "server_1")
    assert b.server.port == cfg.server.port + 1
    bad = compose_checked(["launcher=ray", "ray.servers=2", "ray.server_overrides=['model=tiny','optim.lr=-1']"])
    with pytest.raises(ConfigError) as err:
        server_configs(bad, tmp_path)
    assert "only key=value overrides here" in str(err.value) and "server 1: optim.lr: must be > 0" in str(err.value)


def test_without_ray_the_launcher_names_the_extra(monkeypatch, capsys):
    import sys as _sys

    monkeypatch.setitem(_sys.modules, "ray", None)  # import ray -> ImportError
    assert run_ray(compose_checked(["launcher=ray"])) == 2
    assert "swarmkit[ray]" in capsys.readouterr().err


@pytest.fixture()
def cluster():
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'swarmkit[ray]')")
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "object_store_memory": 100 * 2**20}
    c = Cluster(initialize_head=True, connect=True, head_node_args={**node, "include_dashboard": False})
    c.add_node(**node)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.mark.slow
def test_two_servers_two_clients_on_two_nodes_train_and_survive_a_killed_client(cluster, tmp_path):
    import ray

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "swarmkit", "launcher=ray", f"ray.address={cluster.address}",
           f"ray.namespace={NAMESPACE}", "ray.servers=2", "ray.clients=1",
           "model=tiny", "task=token_rule", "task.max_tokens=8", "batching.batch_size=4",
           "batching.rollouts_per_task=8", "optim.lr=1e-2", f"trainer.total_steps={STEPS}", "trainer.eval_every=10",
           # a killed client's open episodes hold a step only this long (as any crashed client's)
           "server.drain_idle_s=2", "server.episode_timeout_s=30", f"hydra.run.dir={run_dir}"]
    t0 = time.monotonic()
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        # mid-run: kill server 0's client actor (no restart by Ray: the launcher must replace it)
        while _step(run_dir / "server_0") < 5:
            assert proc.poll() is None, (tmp_path / "launcher.log").read_text()[-4000:]
            assert time.monotonic() - t0 < 150, "server 0 did not reach step 5"
            time.sleep(0.5)
        victim = ray.get_actor("client-0-0", namespace=NAMESPACE)
        ray.kill(victim)
        killed_at = _step(run_dir / "server_0")
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    out = (tmp_path / "launcher.log").read_text()
    assert rc == 0, out[-4000:]
    assert "client actor client-0-0 died" in out

    summary = json.loads((run_dir / "summary.json").read_text())
    servers = {s["server"]: s for s in summary["servers"]}
    assert sorted(servers) == [0, 1]
    for k, s in servers.items():
        # each server trained all its steps, and its held-out reward rose
        assert s["global_step"] >= STEPS, s
        assert s["eval_after"]["mean"] > s["eval_before"]["mean"] + 0.2, s
        assert s["train_episodes"] > 0
        # trainer.eval_every=10: the clients paused for two evaluations mid-run (ignored under Ray before)
        midway = [int(step) for step in s["eval_midway"]]
        assert len(midway) == 2 and 10 <= midway[0] and midway[0] + 10 <= midway[1] < STEPS, s["eval_midway"]
        # its client ran on its node (loopback binding: STRICT_PACK)
        for c in s["clients"]:
            assert c["nodes"] and set(c["nodes"]) == {s["node_id"]}, (k, c)
    # placement: the two servers (2 CPUs of bundles each) landed on the two different nodes
    assert servers[0]["node_id"] != servers[1]["node_id"]
    assert {servers[0]["node_id"], servers[1]["node_id"]} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    # the killed actor was replaced once, and training went on past the kill
    assert servers[0]["client_replacements"] == 1 and servers[1]["client_replacements"] == 0
    assert servers[0]["clients"][0]["name"] == "client-0-0.1"
    assert killed_at < STEPS

    for k in (0, 1):
        folder = run_dir / f"server_{k}"
        journal = _journal(folder)
        accepted = _accepted(folder)
        # nothing a client was told is accepted is missing from the journal (the killed actor's included)
        for name, ids in accepted.items():
            missing = [i for i in ids if i not in journal]
            assert not missing, (k, name, missing[:5])
        assert sum(1 for st in journal.values() if st == "trained") >= STEPS * 32
        if k == 0:
            assert len(accepted.get("client-0-0", [])) > 0
        summary_k = json.loads((folder / "summary.json").read_text())
        assert summary_k["global_step"] == servers[k]["global_step"]
    print(f"ray launcher test: {time.monotonic() - t0:.0f} s; kill at step {killed_at}; "
          + "; ".join(f"server {k}: eval {s['eval_before']['mean']:.3f} -> {s['eval_after']['mean']:.3f}, "
                      f"{s['global_step']} steps, {s['train_episodes']} episodes" for k, s in servers.items()))
