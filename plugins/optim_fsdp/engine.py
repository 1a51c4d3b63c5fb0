"""``FSDPEngine``: PyTorch FSDP2 (``fully_shard``) optimizer engine.

- Not initialised torch.distributed (the server's own process): the model
  trains plainly on one device (fp32 on CPU; bf16 autocast over fp32 master
  weights on CUDA).
- Under ``torchrun`` (torch.distributed initialised, any world size ≥ 1):
  every decoder layer and then the root are ``fully_shard``-ed over a 1-D
  device mesh (gloo on CPU, NCCL on GPUs), with bf16 params / fp32 gradient
  reduction on CUDA. Every rank passes the same batch to ``train_step``; the
  engine deals packed micro-batches to ranks and scales losses so the
  gradient equals the single-process one.

Checkpoints (``save_checkpoint(path)``)::

    path/model/ or path/adapter/   HF ``save_pretrained`` folder (full) or peft adapter (LoRA)
    path/value_head.pt             PPO value head (when the algorithm needs values)
    path/dist/                     torch.distributed.checkpoint: trainable params + AdamW state
                                   (sharded; loadable with another world size)
    path/engine_state.pt           scheduler, optimizer/train step counters
    path/rng_rank{r}.pt            RNG states per rank
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmkit_plugins.optim_fsdp.base import BaseEngine, warmup_lambda
from swarmkit_plugins.optim_fsdp.core import MicroBatch


class FSDPEngine(BaseEngine):
    """FSDP2 engine; see the module docstring. Built as ``FSDPEngine(model_path, model_cfg, optim_cfg, algo)``."""

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not hasattr(self, "_mesh"):
            self._mesh = init_device_mesh(self.device.type, (self.world,))
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32) \
            if self.compute_dtype != torch.float32 else MixedPrecisionPolicy()
        clm = module.causal_lm
        decoder = getattr(clm, clm.base_model_prefix)
        for layer in decoder.layers:
            fully_shard(layer, mesh=self._mesh, mp_policy=mp)
        fully_shard(module, mesh=self._mesh, mp_policy=mp)

    def _wrap(self) -> None:
        self.policy.to(self.device)
        if self.reference is not None:
            self.reference.to(self.device)
        if self.distributed:
            self._shard(self.policy)
            if self.reference is not None:
                self._shard(self.reference)
            self._native_low_precision = self.compute_dtype != torch.float32
        params = [p for p in self.policy.parameters() if p.requires_grad]
        betas = tuple(float(b) for b in self.optim_cfg.get("betas", (0.9, 0.999)))
        kw: dict[str, Any] = {}
        if self.device.type == "cuda":
            kw["fused"] = True
        self.optimizer = torch.optim.AdamW(
            params, lr=float(self.optim_cfg.get("lr", 1e-5)), betas=betas,
            weight_decay=float(self.optim_cfg.get("weight_decay", 0.0)), **kw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_lambda(int(self.optim_cfg.get("warmup_steps", 0))))
        self._params = params

    def _forward(self, mb: MicroBatch, model: nn.Module | None = None):
        m = model if model is not None else self.policy
        return m(mb.input_ids, mb.position_ids, mb.select, mb.targets)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        if self.distributed:
            self.policy.set_requires_gradient_sync(last)
        loss.backward()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self._params, max_norm)
        full = getattr(norm, "full_tensor", None)
        norm = full() if callable(full) else norm
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        if not self.distributed:
            return dict(self.policy.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else {}

    # ------------------------------------------------------------------ checkpoints
    def _barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def _dcp_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=True, strict=False)

    def save_checkpoint(self, path: str) -> None:
        """Write the checkpoint folder (layout in the module docstring); collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        path_ = Path(path)
        if self.rank == 0:
            path_.mkdir(parents=True, exist_ok=True)
        self._barrier()
        self.save_hf(path_)
        if self.needs_values:
            vh = self.value_head_state()
            if self.rank == 0:
                torch.save(vh, path_ / "value_head.pt")
        has_optim = bool(self.optimizer.state)  # before the first step AdamW has no state to save
        opts = self._dcp_options()
        if has_optim:
            msd, osd = get_state_dict(self.policy, self.optimizer, options=opts)
            state = {"model": msd, "optim": osd}
        else:
            state = {"model": get_model_state_dict(self.policy, options=opts)}
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=str(path_ / "dist"))
        if self.rank == 0:
            torch.save({"meta": self._meta(), "scheduler": self.scheduler.state_dict(), "has_optim": has_optim},
                       path_ / "engine_state.pt")
        torch.save(self._rng_state(), path_ / f"rng_rank{self.rank}.pt")
        self._barrier()

    def load_checkpoint(self, path: str) -> None:
        """Restore weights, AdamW state, scheduler, counters and this rank's RNG from ``path``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        path_ = Path(path)
        st = torch.load(path_ / "engine_state.pt", weights_only=False)
        opts = self._dcp_options()
        if st["has_optim"]:
            msd, osd = get_state_dict(self.policy, self.optimizer, options=opts)
            state = {"model": msd, "optim": osd}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(path_ / "dist"))
            set_state_dict(self.policy, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"], options=opts)
        else:
            state = {"model": get_model_state_dict(self.policy, options=opts)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=str(path_ / "dist"))
            set_model_state_dict(self.policy, state["model"], options=opts)
        self.scheduler.load_state_dict(st["scheduler"])
        self._set_meta(st["meta"])
        rng = path_ / f"rng_rank{self.rank}.pt"
        if rng.exists():
            self._set_rng_state(torch.load(rng, weights_only=False))
        self._barrier()
