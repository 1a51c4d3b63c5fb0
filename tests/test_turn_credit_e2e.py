"""Per-call rewards end to end: a real server process (tiny model, algo=turn_grpo), killed and restarted,
trains a step whose samples carry the advantages the calls' own rewards give."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from swarmkit.client import SwarmClient
from swarmkit.pool import SamplePool
from tests.test_cycle_e2e import TOKEN, _free_port, _stop, _wait_step, start_server

OVERRIDES = ["model=tiny", "task=token_rule", "algo=turn_grpo", "algo.std_normalize=false", "batching=c1",
             "batching.batch_size=1", "batching.rollouts_per_task=2", "optim.lr=1e-3", "trainer.total_steps=1"]


def _two_calls(ep) -> None:
    """Two chat calls; the second sees the first answer as history (the calls merge into one sample)."""
    url, auth = f"{ep.base_url}/chat/completions", {"Authorization": f"Bearer {ep.api_key}"}
    msgs = [{"role": "user", "content": "hello"}]
    r = httpx.post(url, headers=auth, json={"model": "m", "messages": msgs, "max_tokens": 3}, timeout=60)
    r.raise_for_status()
    msgs += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "again"}]
    httpx.post(url, headers=auth, json={"model": "m", "messages": msgs, "max_tokens": 3}, timeout=60).raise_for_status()


@pytest.mark.slow
def test_call_rewards_survive_a_kill_and_reach_the_trained_advantages(tmp_path):
    port = _free_port()
    server = start_server(tmp_path, port)
    try:
        ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
        ctl.configure(OVERRIDES)
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=120)
        with ctl.episode(task_id="q") as first:
            _two_calls(first)
            first.report(0.0, turn_rewards=[1.0, None])  # the first turn decided it
        server.send_signal(signal.SIGKILL)  # one episode of the group of two: no step yet
        server.wait(10)
        pool = SamplePool(tmp_path / "journal.sqlite")
        (kept,) = pool.untrained()
        pool.close()
        assert [t["meta"].get("call_reward") for t in kept.timelines] == [1.0, None]

        server = start_server(tmp_path, port)
        ctl = SwarmClient(f"http://127.0.0.1:{port}", token=TOKEN, retry_for=60)
        ctl.configure(OVERRIDES)
        ctl.start()
        ctl.wait_for_state("ROLLING", timeout=120)
        with ctl.episode(task_id="q") as second:
            _two_calls(second)
            second.report(0.0, turn_rewards=[0.0, 0.0])
        _wait_step(ctl, 1, 90, poll=0.2)
        assert ctl.status()["global_step"] == 1

        lines = [json.loads(x) for x in (tmp_path / "advantages.jsonl").read_text().splitlines()]
        values = {line["episode_id"]: [run[2] for run in line["runs"]] for line in lines}
        # returns (gamma 1): first [1, 0], second [0, 0]; each turn against the other rollout's same turn
        assert values == {first.episode_id: [1.0, 0.0], second.episode_id: [-1.0, 0.0]}

        # the live viewer knows the episodes of this server process (the first one ran before the kill)
        view = httpx.get(f"http://127.0.0.1:{port}/api/v1/dashboard/episodes/{second.episode_id}",
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30).json()
        assert view.get("advantages") is True, str(view)[:1500]
        shown = {tok[4] for s in view["samples"] for b in s["blocks"] for tok in b["tokens"] if tok[3]}
        assert shown == {-1.0, 0.0}
    finally:
        _stop([server])
