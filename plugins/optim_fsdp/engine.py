"""``FSDPEngine``: PyTorch FSDP2 (``fully_shard``) optimizer engine.

- Not initialised torch.distributed (the server's own process): the model
  trains plainly on one device: fp32 on CPU; on CUDA a bf16 *compute copy*
  of the model runs forward/backward (no per-micro-batch weight casts, bf16
  activations), each gradient is added into the fp32 master weights' ``.grad``
  as soon as it is ready (fp32 accumulation over micro-batches), fused AdamW
  steps the fp32 masters and the compute copy is refreshed from them
  (``optim.mixed_precision: autocast`` keeps the older fp32-params-under-autocast
  path). Checkpoints, ``save_hf`` and the optimizer see only the fp32 masters.
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
    path/reference/                an anchored reference (algo.reference=warm_start): the frozen
                                   adapter (LoRA) or the reference's weights (torch.distributed.checkpoint)
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from swarmkit.training.engine import TrainingEngine
from swarmkit.training.packing import MicroBatch
from swarmkit.training.policy import PolicyModel
from swarmkit_plugins.optim_fsdp.schema import FSDPConfig


class FSDPEngine(TrainingEngine):
    """FSDP2 engine; see the module docstring. Built as ``FSDPEngine(model_path, model_cfg, optim_cfg, algo)``."""

    config_cls = FSDPConfig
    cfg: FSDPConfig

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

    _compute: PolicyModel | None = None
    _export_cache: dict[str, torch.Tensor] | None = None

    def _wants_compute_copy(self) -> bool:
        mode = str(self.cfg.mixed_precision or "auto")
        if mode not in ("auto", "autocast"):
            raise ValueError(f"optim.mixed_precision must be 'auto' or 'autocast', not {mode!r}")
        return (mode == "auto" and not self.distributed and self.device.type == "cuda"
                and self.compute_dtype != torch.float32)

    def _make_compute_copy(self) -> None:
        """bf16 copy of the policy for forward/backward; its grads flow into the fp32 masters."""
        cd = self.compute_dtype
        compute = copy.deepcopy(self.policy)  # on the CPU, before the masters move: no fp32 GPU transient
        with torch.no_grad():
            for p in compute.parameters():  # params only: buffers (rotary inv_freq) stay fp32
                p.data = p.data.to(cd)
        compute.to(self.device)
        masters = dict(self.policy.named_parameters())
        self._pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        several = bool(self.adapter_specs)
        for name, p in compute.named_parameters():
            master = masters[name]
            self._pairs.append((master, p))
            if p.requires_grad or (several and ".lora_" in name):  # an adapter not active now: for when it is
                _feed_master(p, master)
        self._compute = compute
        if self.reference is not None:
            with torch.no_grad():
                for p in self.reference.parameters():
                    p.data = p.data.to(cd)
        self._native_low_precision = True

    @torch.no_grad()
    def _adapter_added(self, name: str, config: Any) -> None:
        """Adapter ``name``, just added to the fp32 masters (:meth:`AdapterBank.add`), in the compute copy
        too: the same tensors in the compute dtype, their gradients flowing into the masters."""
        if self._compute is None:
            return
        self._compute.lm.add_adapter(name, config)
        masters = dict(self.policy.named_parameters())
        mine = f".{name}."
        for pname, p in self._compute.named_parameters():
            if ".lora_" not in pname or mine not in pname:
                continue
            master = masters[pname]
            p.data = master.data.to(device=self.device, dtype=self.compute_dtype)
            self._pairs.append((master, p))
            _feed_master(p, master)

    def _adapter_removed(self, name: str) -> None:
        """Adapter ``name`` out of the compute copy (the undo of :meth:`_adapter_added`)."""
        if self._compute is None:
            return
        mine = f".{name}."
        gone = {id(p) for pname, p in self._compute.named_parameters() if ".lora_" in pname and mine in pname}
        self._pairs = [(m, p) for m, p in self._pairs if id(p) not in gone]
        if name in self._compute.lm.peft_config:
            self._compute.lm.delete_adapter(name)

    @torch.no_grad()
    def _sync_compute(self, everything: bool = False) -> None:
        """Copy the fp32 masters into the compute copy: trainable ones after an optimizer step, all after a load."""
        if self._compute is None:
            return
        pairs = [(m, p) for m, p in self._pairs if everything or p.requires_grad]
        torch._foreach_copy_([p.data for _, p in pairs], [m.data for m, _ in pairs])

    def _compute_model(self) -> PolicyModel:
        return self._compute if self._compute is not None else self.policy

    def _before_reference_write(self) -> None:
        """FSDP2 may keep a module's gathered parameters after a no-grad forward (the root's): free
        them, so the next forward gathers the shards written in place."""
        if self.distributed and self.reference is not None:
            from torch.distributed.fsdp import FSDPModule

            for m in self.reference.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def _wrap(self) -> None:
        if self._wants_compute_copy():
            self._make_compute_copy()
        self.policy.to(self.device)
        if self.reference is not None:
            self.reference.to(self.device)
        if self.distributed:
            self._shard(self.policy)
            if self.reference is not None:
                self._shard(self.reference)
            self._native_low_precision = self.compute_dtype != torch.float32
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = self._adamw(params)
        self.scheduler = self._warmup(self.optimizer)
        self._params = params

    def _forward(self, mb: MicroBatch, model: nn.Module | None = None):
        m = model if model is not None else self._compute_model()
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
        if not torch.isfinite(norm):  # NaN / inf gradient: never applied
            self.optimizer.zero_grad(set_to_none=True)
            return float(norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync_compute()
        return float(norm)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        if not self.distributed:
            return dict(self.policy.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if self.rank == 0 else {}

    def _export_state_dict(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """Weights for ``export_weights``, kept on the GPU where one device holds them all.

        In one process with a compute copy: the bf16 compute weights when ``dtype`` is None or
        the compute dtype (they equal the fp32 masters rounded, i.e. what a bf16 backend holds), so
        a same-GPU backend does one plain copy per tensor. Sharded over several ranks the full state
        dict is offloaded to rank 0's CPU (a world of one trains as a plain process: no shards).
        """
        if self._compute is not None and dtype in (None, self.compute_dtype):
            # the compute copy is refreshed in place, so its state dict (name -> tensor) is built once
            if self._export_cache is None:
                self._export_cache = dict(self._compute.state_dict())
            return self._export_cache
        return self._full_state_dict()

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
        if self.adapters is not None:  # several adapters (one process): a folder per adapter
            self._save_adapters_checkpoint(path_)
            return
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
        self._save_reference(path_)
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
        if self.adapters is not None:
            self._load_adapters_checkpoint(path_)
            return
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
        self._sync_compute(everything=True)
        self._load_reference(path_)
        rng = path_ / f"rng_rank{self.rank}.pt"
        if rng.exists():
            self._set_rng_state(torch.load(rng, weights_only=False))
        self._barrier()


def _feed_master(p: nn.Parameter, master: nn.Parameter) -> None:
    """Route the gradients of compute tensor ``p`` into ``master.grad``, whether ``p`` trains now or only once its
    adapter is active (a hook can only be registered while ``p`` requires grad; its flag is left as it was)."""
    trainable = p.requires_grad
    p.requires_grad_(True)
    p.register_post_accumulate_grad_hook(_grad_to_master(master))
    p.requires_grad_(trainable)


def _grad_to_master(master: nn.Parameter):
    """Post-accumulate-grad hook: add the compute param's (bf16) gradient into ``master.grad`` (fp32)."""

    def hook(p: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = p.grad.to(master.dtype)
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook
