"""DeepSpeed ZeRO-2/3 engine: same loss curve on 1 and 2 CPU processes (gloo), and resume.

DeepSpeed runs in torchrun subprocesses only: it initialises torch.distributed,
which must not leak into the test process (the FSDP engine would then shard).
First start JIT-compiles DeepSpeed's shm op (ninja + g++, about a minute);
``TORCH_EXTENSIONS_DIR`` caches it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from swarmkit.training import TrainSample
from swarmkit.training.worker import launch

LORA = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}


def _batch(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        n = 10 + 3 * i
        ids = torch.randint(3, 400, (n,), generator=g).tolist()
        mask = [0] * 5 + [1] * (n - 5)
        adv = 1.0 if i % 2 == 0 else -1.0
        out.append(TrainSample(ids, mask, [-6.0] * n, [adv * m for m in mask]).to_dict())
    return out


def run_worker(tmp: Path, nproc: int, engine: str, model_cfg: dict, optim_cfg: dict, tag: str,
               extra: list[str] | None = None) -> list[dict]:
    steps = tmp / "steps.json"
    if not steps.exists():
        steps.write_text(json.dumps([_batch(k) for k in range(3)]))
    return launch(nproc, steps, tmp / f"m_{tag}_{nproc}.jsonl", engine, model_cfg=model_cfg,
                  optim_cfg=optim_cfg, extra=extra, timeout=400)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (pip install 'swarmkit[deepspeed]')"),
]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_zero_two_processes_match_one_and_fsdp(stage, lora, tmp_path):
    model_cfg = dict(LORA) if lora else {"lora_rank": 0}
    optim = {"lr": 1e-2 if lora else 1e-3, "token_budget": 40}
    one = run_worker(tmp_path, 1, "deepspeed", model_cfg, {**optim, "zero_stage": stage}, "ds")
    two = run_worker(tmp_path, 2, "deepspeed", model_cfg, {**optim, "zero_stage": stage}, "ds")
    fsdp = run_worker(tmp_path, 1, "fsdp", model_cfg, optim, "fsdp")
    for a, b, c in zip(one, two, fsdp, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["loss"] == pytest.approx(c["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


def test_zero2_checkpoint_resume_continues_the_curve(tmp_path):
    optim = {"lr": 1e-3, "token_budget": 40, "zero_stage": 2, "warmup_steps": 2}
    full = run_worker(tmp_path, 2, "deepspeed", {"lora_rank": 0}, optim, "full")
    ck = tmp_path / "ck"
    first = run_worker(tmp_path, 2, "deepspeed", {"lora_rank": 0}, optim, "first",
                       ["--steps", "1", "--save", str(ck)])
    rest = run_worker(tmp_path, 2, "deepspeed", {"lora_rank": 0}, optim, "rest",
                      ["--resume", str(ck), "--skip", "1"])
    assert (ck / "model" / "config.json").exists()
    got = [m["loss"] for m in first + rest]
    assert got == pytest.approx([m["loss"] for m in full], rel=1e-6, abs=1e-8)
    assert [m["optimizer_steps"] for m in rest] == [2.0, 3.0]
