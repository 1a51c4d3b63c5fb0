"""The design card's command line with vLLM: ``python -m swarmkit +backend=vllm +algo=grpo`` learns.

Needs vllm (``vllm-cpu`` on CPU machines); CI runs it in its vLLM step. ``SWARMKIT_TEST_DEVICE=cuda``:
the trainer and the engine (bfloat16, 30% of the memory) share the GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_main_job_with_vllm_backend_learns(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    out = subprocess.run(
        [sys.executable, "-m", "swarmkit", "+backend=vllm", "+algo=grpo", "model=tiny", "task=token_rule",
         "task.max_tokens=8", "batching.batch_size=4", "batching.rollouts_per_task=8", "optim.lr=1e-2",
         "trainer.total_steps=20", "server.port=0", f"hydra.run.dir={tmp_path}",
         *(["optim.device=cuda", "backend.gpu_memory_utilization=0.3"]
           if os.environ.get("SWARMKIT_TEST_DEVICE", "cpu") != "cpu" else [])],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] >= 20
    assert summary["eval_after"]["mean"] > summary["eval_before"]["mean"] + 0.3, summary

