"""A non-finite loss is never applied: the engine skips the update and the server drops the batch,
keeps its weights and step, and its status and metrics still serialise (issue 18, item 1)."""

from __future__ import annotations

import json
import math
import time

import torch
from omegaconf import OmegaConf
from test_demonstrations import _record, _timeline

from swarmkit.apps.serve import start_server_thread
from swarmkit.client import SwarmClient
from swarmkit.swarm.cycle import TrainingCycle
from swarmkit.swarm.metrics import finite_or_none
from swarmkit.testing.scripted import ScriptedBackend
from swarmkit.training.samples import build_samples

TOKEN = "nonfinite-test-token"


def test_the_engine_skips_an_update_whose_loss_is_not_finite():
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    engine = FSDPEngine(tiny_model_dir(), {"lora_rank": 0}, {"lr": 1e-2, "token_budget": 64}, GRPO())
    ids = [1, 5, 9, 13, 17, 21]
    samples = build_samples([_record([_timeline(ids, [1] * 4, False)], reward=r, task="q") for r in (0.0, 1.0)],
                            GRPO())
    before = {n: p.detach().clone() for n, p in engine.policy.named_parameters()}
    samples[0].advantages = [math.nan] * len(samples[0].advantages)
    out = engine.train_step(samples)
    assert out["skipped"] == 1.0 and out["nonfinite_skipped"] == 1.0 and engine.optimizer_steps == 0
    for n, p in engine.policy.named_parameters():
        assert torch.equal(p, before[n]), n
    fine = build_samples([_record([_timeline(ids, [1] * 4, False)], reward=r, task="q") for r in (0.0, 1.0)], GRPO())
    out = engine.train_step(fine)  # a finite batch afterwards trains as usual
    assert engine.optimizer_steps == 1 and math.isfinite(out["loss"]) and out["nonfinite_skipped"] == 0.0


class _NaNTrainer:
    """Stands in for the trainer: every step is non-finite (nothing applied)."""

    global_step = 0

    def step(self, records):
        return {"skipped": 1.0, "nonfinite_skipped": 1.0, "loss": math.nan}

    def latest_checkpoint(self):
        return None

    def close(self):
        pass


def test_the_server_drops_a_non_finite_batch_and_keeps_serving(train_cfg, tmp_path):
    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.batching.batch_size, cfg.batching.rollouts_per_task = 1, 2
    from swarmkit.models import build_tiny_tokenizer

    backend = ScriptedBackend(build_tiny_tokenizer(), replies=["ok"])
    cycle = TrainingCycle(tmp_path, trainer_factory=lambda c, d: _NaNTrainer())
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path)}},
                            config=cfg, backend_factory=lambda c: backend, cycle=cycle)
    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=20) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=20)
            for _ in range(2):
                with c.episode("nan-task") as ep:
                    ep.report(0.5)
            end = time.monotonic() + 20
            while time.monotonic() < end and not c.status()["pool"].get("last_error"):
                time.sleep(0.1)
            st = c.status()  # serialises (no NaN in it)
            assert "non-finite" in st["pool"]["last_error"] and st["global_step"] == 0
            assert st["pool"]["filtered"] == 2 and st["pool"]["episodes"] == 0 and st["state"] == "ROLLING"
    finally:
        h.stop()


def test_metrics_have_no_nan():
    row = finite_or_none({"loss": math.nan, "grad_norm": math.inf, "step": 3, "note": "x"})
    assert row == {"loss": None, "grad_norm": None, "step": 3, "note": "x"}
    json.dumps(row, allow_nan=False)
