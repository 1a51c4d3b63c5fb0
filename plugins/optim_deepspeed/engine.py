"""``DeepSpeedEngine``: DeepSpeed ZeRO stage 2 / 3 optimizer engine.

Same interface and training loop as the FSDP2 engine (packing, token-budget
micro-batches, loss weighting, LoRA / full weights, pre-passes), with
DeepSpeed owning gradient reduction, partitioning, clipping, the optimizer
step (torch AdamW as a client optimizer) and the LR scheduler.

- Launch with ``torchrun`` / ``deepspeed`` / ``mp.spawn`` for N processes;
  in a plain process a 1-rank process group is created (gloo on CPU).
- bf16 on CUDA (``"bf16": {"enabled": true}``, fp32 master weights kept by
  ZeRO); fp32 on CPU.
- First start on CPU JIT-compiles DeepSpeed's shm op (needs ninja + g++;
  ≈ 60 s; set ``TORCH_EXTENSIONS_DIR`` to a cache folder).

Checkpoints: ``path/model`` or ``path/adapter`` (HF / peft), ``path/ds``
(DeepSpeed's own checkpoint: partitioned weights, optimizer, scheduler and
counters in ``client_state``), ``path/rng_rank{r}.pt``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmkit.contract import Algorithm
from swarmkit.procs import free_port
from swarmkit.training.engine import TrainingEngine
from swarmkit.training.packing import MicroBatch
from swarmkit_plugins.optim_deepspeed.schema import DeepSpeedConfig

DS_TAG = "state"


def ensure_process_group() -> None:
    """Initialise torch.distributed through DeepSpeed; a 1-rank group when no launcher set it up."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


class DeepSpeedEngine(TrainingEngine):
    """ZeRO-2/3 engine. Built as ``DeepSpeedEngine(model_path, model_cfg, optim_cfg, algo)``."""

    config_cls = DeepSpeedConfig
    cfg: DeepSpeedConfig
    needs_process_group = True  # deepspeed.initialize wraps the model in its own world, one rank included

    def __init__(self, model_path: str | Path, model_cfg: Mapping[str, Any], optim_cfg: Mapping[str, Any],
                 algo: Algorithm):
        ensure_process_group()
        super().__init__(model_path, model_cfg, optim_cfg, algo)

    def ds_config(self) -> dict[str, Any]:
        stage = int(self.cfg.zero_stage)
        if stage not in (2, 3):
            raise ValueError(f"optim.zero_stage must be 2 or 3, got {stage}")
        return {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": {"stage": stage, "overlap_comm": False, "contiguous_gradients": True},
            "bf16": {"enabled": self.compute_dtype == torch.bfloat16},
            "fp16": {"enabled": False},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }

    def _wrap(self) -> None:
        import deepspeed

        if int(self.cfg.zero_stage) == 3 and self.needs_reference and self.reference_mode == "warm_start":
            raise ValueError("algo.reference=warm_start is not supported with optim.zero_stage=3 (partitioned "
                             "parameters); use zero_stage=2, optim=fsdp, or algo.reference=initial")
        self.policy.to(self.device)
        if self.reference is not None:
            self.reference.to(device=self.device, dtype=self.compute_dtype)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = self._adamw(params, fused=False)  # DeepSpeed steps it as a client optimizer
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=self.policy, optimizer=optimizer, config=self.ds_config(),
            lr_scheduler=self._warmup)
        self.zero_stage = int(self.ds_config()["zero_optimization"]["stage"])
        if self.zero_stage == 3:
            # the output embedding is read directly (chunked logprobs), outside its module's forward
            head = self.policy.causal_lm.get_output_embeddings()
            deepspeed.zero.register_external_parameter(self.policy, head.weight)
        self._native_low_precision = self.compute_dtype != torch.float32

    def _forward(self, mb: MicroBatch, model: nn.Module | None = None):
        if model is not None:
            return model(mb.input_ids, mb.position_ids, mb.select, mb.targets)
        return self.ds(mb.input_ids, mb.position_ids, mb.select, mb.targets)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.ds.set_gradient_accumulation_boundary(last)
        self.ds.backward(loss, scale_wrt_gas=False)

    def _zero_grad(self) -> None:
        self.ds.zero_grad()

    def _optimizer_step(self) -> float:
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        self.ds.zero_grad()
        if norm is not None and not math.isfinite(float(norm)):  # DeepSpeed stepped already: fail loudly
            raise FloatingPointError(f"a non-finite gradient norm ({float(norm)}) was applied by DeepSpeed")
        return float(norm) if norm is not None else 0.0

    def current_lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.zero_stage == 3:
            sd = self.ds._zero3_consolidated_16bit_state_dict()
            return dict(sd) if self.rank == 0 and sd is not None else {}
        if self.rank != 0:
            return {}
        return {k: v.detach().cpu() for k, v in self.ds.module.state_dict().items()}

    def save_checkpoint(self, path: str) -> None:
        """HF/peft folder + DeepSpeed checkpoint + RNG; collective."""
        import torch.distributed as dist

        path_ = Path(path)
        if self.rank == 0:
            path_.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        self.save_hf(path_)
        if self.needs_values:
            vh = self.value_head_state()
            if self.rank == 0:
                torch.save(vh, path_ / "value_head.pt")
        self.ds.save_checkpoint(str(path_ / "ds"), tag=DS_TAG, client_state={"swarmkit": self._meta()},
                                exclude_frozen_parameters=self.lora)
        self._save_reference(path_)
        torch.save(self._rng_state(), path_ / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore weights, optimizer, scheduler, counters and this rank's RNG."""
        import torch.distributed as dist

        path_ = Path(path)
        load_path, client = self.ds.load_checkpoint(str(path_ / "ds"), tag=DS_TAG,
                                                    load_module_strict=not self.lora)
        if load_path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint in {path_ / 'ds'}")
        self._set_meta(client["swarmkit"])
        self._load_reference(path_)
        rng = path_ / f"rng_rank{self.rank}.pt"
        if rng.exists():
            self._set_rng_state(torch.load(rng, weights_only=False))
        dist.barrier()
