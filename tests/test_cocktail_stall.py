"""A batch held back by ``batching.cocktail`` alone is said in the server log, and trains once another family
arrives (the silent stall: one family's client alone, or an adapter only one family trains, never fires C1-C3)."""

from __future__ import annotations

import logging
import time

import httpx

from swarmkit.client import SwarmClient

TOKEN = "cocktail-stall-token-0123456789"


def _episode(client: SwarmClient, task: str, family: str) -> None:
    with client.episode(task_id=task, meta={"task_family": family}) as ep:
        r = httpx.post(f"{ep.base_url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       headers={"Authorization": f"Bearer {ep.api_key}"}, timeout=30)
        assert r.status_code == 200, r.text
        assert ep.report(1.0)["accepted"]


def _wait(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_a_batch_held_back_by_the_caps_alone_is_said_and_trains_when_another_family_comes(tmp_path, caplog):
    from swarmkit.apps.wiring import build_server
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.server.run import run_in_thread
    from swarmkit.testing.scripted import ScriptedBackend

    config = validate_config(compose(["model=tiny", "batching=c2", "batching.batch_size=2",
                                      "batching.rollouts_per_task=1", "++batching.cocktail={calc:0.5}"]),
                             get_registry())
    steps: list[list[str]] = []

    def step_fn(records, step):  # the cycle under test, not the trainer: record each batch's families
        steps.append(sorted(r.task_family for r in records))
        return {}

    srv, app = build_server({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path)}},
                            step_fn=step_fn, config=config,
                            backend_factory=lambda cfg: ScriptedBackend(build_tiny_tokenizer(), replies=["ok"]))
    handle = run_in_thread(srv, app)
    client = SwarmClient(handle.url, token=TOKEN, retry_for=10)
    caplog.set_level(logging.WARNING, logger="swarmkit.swarm.cycle")
    try:
        client.start()
        client.wait_for_state("ROLLING", timeout=30)
        for k in range(3):  # three complete calc tasks: enough for a batch of 2, but calc may fill only 1
            _episode(client, f"calc-{k}", "calc")
        assert _wait(lambda: "holds the batch back" in caplog.text), caplog.text
        said = [r.getMessage() for r in caplog.records if "holds the batch back" in r.getMessage()]
        assert len(said) == 1, said  # once per stall
        assert "2 tasks are ready and a batch needs 2" in said[0] and "{'calc': 0.5} let only 1 count" in said[0]
        assert "'calc': 1 over its cap" in said[0]
        assert steps == []
        _episode(client, "game-0", "game")  # another family: the batch forms (1 calc + 1 game)
        assert _wait(lambda: len(steps) == 1), steps
        assert steps[0] == ["calc", "game"]
    finally:
        client.close()
        handle.stop()
