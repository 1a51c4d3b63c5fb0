"""``optim.nprocs = 2``: the trainer drives a torchrun group (gloo) from this process.

Same records, same seeds: the 2-process group must give the 1-process losses and
weights, keep the step counters, save / resume checkpoints, report a failing
command as an error and keep serving, and leave no process behind when closed.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest
import torch
from test_learning import run_token_rule_job
from test_trainer import Rec, two_turn

from swarmkit.training import Trainer
from swarmkit.training.group import GroupError, ProcessGroupEngine

pytestmark = pytest.mark.slow

MODEL = {"path": "builtin:tiny", "lora_rank": 0}
OPTIM = {"name": "fsdp", "lr": 1e-3, "token_budget": 64, "seed": 3}


def _records(step: int) -> list[Rec]:
    return [Rec(f"e{step}-{i}", f"t{i // 2}", float((i + step) % 2), two_turn("12" * (i + 1), "yes" * (step + 1)))
            for i in range(4)]


def test_two_process_group_matches_one_process_and_resumes(tmp_path):
    one = Trainer(MODEL, {**OPTIM, "nprocs": 1}, {"name": "grpo"}, run_dir=tmp_path / "one")
    two = Trainer(MODEL, {**OPTIM, "nprocs": 2}, {"name": "grpo"}, run_dir=tmp_path / "two")
    try:
        assert isinstance(two.engine, ProcessGroupEngine) and two.engine.alive and two.engine.world == 2
        assert (tmp_path / "two" / "train_group.log").exists()
        for step in range(2):
            a, b = one.step(_records(step)), two.step(_records(step))
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
            assert b["trained_tokens"] == a["trained_tokens"]
        assert one.global_step == two.global_step == 2 and two.train_steps == 2
        wa, wb = dict(one.export_weights()), dict(two.export_weights())
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k].float().cpu(), wa[k].float().cpu(), rtol=1e-5, atol=1e-6)

        path = two.save_checkpoint(extra={"pool": 1})
        want = two.step(_records(2))["loss"]
        # a failing command is an error, and the group keeps serving
        with pytest.raises(GroupError, match="load_checkpoint failed"):
            two.engine.load_checkpoint(str(tmp_path / "nowhere"))
        assert two.engine.alive
        assert two.load_checkpoint(path) == {"pool": 1} and two.global_step == 2
        assert two.step(_records(2))["loss"] == pytest.approx(want, rel=1e-6)
    finally:
        one.close()
        two.close()
    assert not two.engine.alive
    with pytest.raises(GroupError, match="closed"):
        two.engine.train_step([])


def test_a_killed_group_gives_a_clear_error(tmp_path):
    tr = Trainer(MODEL, {**OPTIM, "nprocs": 2}, {"name": "grpo"}, run_dir=tmp_path)
    try:
        os.killpg(tr.engine._proc.pid, signal.SIGKILL)
        tr.engine._proc.wait(30)
        with pytest.raises(GroupError, match="died during train_step"):
            tr.step(_records(0))
    finally:
        tr.close()


def test_main_job_learns_with_a_two_process_group(tmp_path):
    """``python -m swarmkit optim.nprocs=2``: the server drives the group, weights sync, reward goes up."""
    out = run_token_rule_job(tmp_path, "optim.nprocs=2", "trainer.checkpoint_every=15", timeout=900)
    assert "training group up: 2 x fsdp" in out.stderr + out.stdout
    assert (tmp_path / "checkpoints" / "latest").exists()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed (pip install 'swarmkit[deepspeed]')")
def test_deepspeed_group_matches_fsdp_in_process(tmp_path):
    one = Trainer(MODEL, {**OPTIM, "nprocs": 1}, {"name": "grpo"}, run_dir=tmp_path / "one")
    ds = Trainer(MODEL, {**OPTIM, "name": "deepspeed", "zero_stage": 2, "nprocs": 2}, {"name": "grpo"},
                 run_dir=tmp_path / "ds")
    try:
        assert ds.engine.world == 2
        for step in range(2):
            a, b = one.step(_records(step)), ds.step(_records(step))
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        wa, wb = dict(one.export_weights()), dict(ds.export_weights())
        for k in wa:
            torch.testing.assert_close(wb[k].float().cpu(), wa[k].float().cpu(), rtol=1e-4, atol=1e-5)
    finally:
        one.close()
        ds.close()


def test_a_group_that_cannot_start_says_why(tmp_path):
    with pytest.raises(GroupError, match="died during start") as err:
        ProcessGroupEngine("fsdp", 2, str(tmp_path / "no-such-model"), {"lora_rank": 0}, dict(OPTIM),
                           {"name": "grpo"}, log_path=tmp_path / "group.log")
    assert "no-such-model" in str(err.value)  # the tail of the group's log names the cause
