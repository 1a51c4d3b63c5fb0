"""Several named LoRA adapters over one frozen base in one training engine (``model.adapters``).

The engine's peft model carries every adapter on the one base; one is *active* at a time.
:class:`AdapterBank` keeps what belongs to each adapter — its AdamW state and warm-up schedule,
its optimizer / train step counters (the adapter's policy version), its learning-rate factors
and its anchored reference — and :meth:`AdapterBank.select` swaps them into the engine's
attributes, so the engine's one training loop (``TrainingEngine.train_step``) trains the
active adapter only: peft gives only the active adapter's tensors ``requires_grad``, the
optimizer holds only them, and the other adapters' tensors are never in a forward pass.

Checkpoint layout (inside the engine's checkpoint folder)::

    adapters/<name>/adapter/   peft adapter folder (adapter_config.json + adapter_model.safetensors)
    adapters/<name>/state.pt   AdamW state, scheduler, counters, anchored reference of that adapter

One process only (no torch.distributed): the configuration refuses ``optim.nprocs > 1``.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from swarmkit.config.lr import auto_lr, is_auto
from swarmkit.config.schema import AdapterSpec
from swarmkit.runfiles import write_text
from swarmkit.training.lm import adapter_seed

#: the engine attributes that belong to one adapter (swapped by :meth:`AdapterBank.select`)
PER_ADAPTER = ("optimizer", "scheduler", "_params", "optimizer_steps", "train_steps", "_lr_scale", "_lr_factor",
               "_ref_adapter", "_ref_anchored", "_ref_pending")
ADAPTERS_DIR = "adapters"

log = logging.getLogger(__name__)


@dataclass
class LoraTensors:
    """One adapted module of one adapter: ``W x + scale · B (A x)``; A (r, in), B (out, r)."""

    module: str  # HF module name, e.g. "model.layers.0.self_attn.q_proj"
    a: torch.Tensor
    b: torch.Tensor
    scale: float


class AdapterBank:
    """Per-adapter training state of an engine whose model carries several named adapters."""

    def __init__(self, engine: Any, specs: Sequence[AdapterSpec]):
        """``engine``: the :class:`~swarmkit.training.engine.TrainingEngine` whose model carries ``specs``
        (typed Any: the engine imports this module)."""
        if engine.distributed:
            raise ValueError("model.adapters: a training group of several processes is not supported yet")
        if engine.needs_values:
            raise ValueError("model.adapters: an algorithm with a value head (ppo) is not supported yet "
                             "(the value head would be shared by the adapters); use grpo")
        self.engine = engine
        self.specs: list[AdapterSpec] = []
        self.names: list[str] = []
        self.active = ""
        self._state: dict[str, dict[str, Any]] = {}
        for spec in specs:
            self._state[spec.name] = self._fresh_state(spec)
            self.specs.append(spec)
            self.names.append(spec.name)
        self.select(self.names[0])
        log.info("model.adapters: learning rates %s", ", ".join(
            f"{s.name} {self.lr_of(s):.3g}{' (auto)' if is_auto(s.lr) or (s.lr is None and engine.lr_auto) else ''}"
            for s in self.specs))

    def _fresh_state(self, spec: AdapterSpec) -> dict[str, Any]:
        """The per-adapter attributes of adapter ``spec`` (already in the peft model) before its first step:
        a new AdamW over its tensors, its warm-up schedule from step 0, counters at 0, no anchored
        reference. The engine's attributes (the active adapter's) are as they were after."""
        eng = self.engine
        saved = {k: getattr(eng, k) for k in PER_ADAPTER if hasattr(eng, k)}
        try:
            eng._lr_scale, eng._lr_factor = 1.0, 1.0  # the schedule's first LR reads them
            self._activate_peft(spec.name)
            params = [p for p in eng.policy.parameters() if p.requires_grad]
            optimizer = eng._adamw(params, lr=self.lr_of(spec))
            eng.optimizer = optimizer  # _warmup's schedule reads the engine's LR factors at each step
            return {"optimizer": optimizer, "scheduler": eng._warmup(optimizer), "_params": params,
                    "optimizer_steps": 0, "train_steps": 0, "_lr_scale": 1.0, "_lr_factor": 1.0,
                    "_ref_adapter": None, "_ref_anchored": False, "_ref_pending": False}
        finally:
            for k, v in saved.items():
                setattr(eng, k, v)
            if self.active:
                self._activate_peft(self.active)

    # ------------------------------------------------------------------ adding at run time
    @torch.no_grad()
    def add(self, spec: AdapterSpec) -> None:
        """Adapter ``spec`` over the base from now on (``POST /api/v1/admin/adapters``): its LoRA is
        initialised exactly as if ``model.adapters`` had listed it at this position from the start (the
        seed of :func:`~swarmkit.training.lm.load_lm`; B = 0, so it serves the base until its first step),
        with a fresh optimizer. The active adapter stays active; nothing of the others changes."""
        if spec.name in self._state:
            raise ValueError(f"adapter '{spec.name}' exists already; this engine trains {self.names}")
        eng = self.engine
        lm = eng.policy.lm
        config = copy.deepcopy(lm.peft_config[self.names[0]])
        try:
            with torch.random.fork_rng(devices=[]):  # the process's random stream is not disturbed
                torch.manual_seed(adapter_seed(eng.seed, len(self.names)))
                lm.add_adapter(spec.name, config)
                added = getattr(eng, "_adapter_added", None)
                if callable(added):  # an engine with a compute copy of the model adds it there too
                    added(spec.name, config)
            self._state[spec.name] = self._fresh_state(spec)
        except BaseException:
            self._delete_peft(spec.name)
            raise
        self.specs.append(spec)
        self.names.append(spec.name)
        log.info("model.adapters: adapter %s added (learning rate %.3g); adapters now %s", spec.name,
                 self.lr_of(spec), ", ".join(self.names))

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (the undo of :meth:`add` when the rest of adding it failed)."""
        if name not in self._state:
            raise KeyError(f"unknown adapter '{name}'; this engine trains {self.names}")
        if len(self.names) == 1:
            raise ValueError("the last adapter cannot be removed")
        if name == self.active:
            self.select(next(n for n in self.names if n != name))
        self._delete_peft(name)
        del self._state[name]
        self.names.remove(name)
        self.specs = [s for s in self.specs if s.name != name]

    def _delete_peft(self, name: str) -> None:
        removed = getattr(self.engine, "_adapter_removed", None)
        if callable(removed):
            removed(name)
        if name in self.engine.policy.lm.peft_config:
            self.engine.policy.lm.delete_adapter(name)
        if self.active:
            self._activate_peft(self.active)

    def lr_of(self, spec: AdapterSpec) -> float:
        """``spec``'s learning rate: its own ``lr``, the LoRA auto rate for ``lr: auto``, else ``optim.lr``
        (already resolved by the engine: with ``optim.lr: auto`` also the LoRA rate of the base's size)."""
        if is_auto(spec.lr):
            return auto_lr(int(self.engine.base_params), lora=True)
        return float(self.engine.cfg.lr if spec.lr is None else spec.lr)

    # ------------------------------------------------------------------ switching
    def _activate_peft(self, name: str) -> None:
        self.engine.policy.lm.set_adapter(name)
        compute = getattr(self.engine, "_compute", None)
        if compute is not None:
            compute.lm.set_adapter(name)

    def select(self, name: str) -> None:
        """Make ``name`` the adapter the engine trains, exports and checkpoints as its own state."""
        if name not in self._state:
            raise KeyError(f"unknown adapter '{name}'; this engine trains {self.names}")
        if name == self.active:
            return
        eng = self.engine
        if self.active:
            self._state[self.active] = {k: getattr(eng, k) for k in PER_ADAPTER}
        for k, v in self._state[name].items():
            setattr(eng, k, v)
        self._activate_peft(name)
        self.active = name

    def steps(self) -> dict[str, int]:
        """Optimizer steps per adapter (each adapter's policy version)."""
        out = {n: int(s["optimizer_steps"]) for n, s in self._state.items()}
        out[self.active] = int(self.engine.optimizer_steps)
        return out

    def train_steps(self) -> dict[str, int]:
        """``train_step`` calls that updated each adapter."""
        out = {n: int(s["train_steps"]) for n, s in self._state.items()}
        out[self.active] = int(self.engine.train_steps)
        return out

    # ------------------------------------------------------------------ export
    def _scalings(self, name: str) -> dict[str, float]:
        from peft.tuners.lora import LoraLayer

        return {mod_name: float(mod.scaling[name]) for mod_name, mod in self.engine.policy.causal_lm.named_modules()
                if isinstance(mod, LoraLayer) and name in mod.scaling}

    @torch.no_grad()
    def lora_tensors(self, name: str) -> list[LoraTensors]:
        """``name``'s adapter as (module, A, B, scale), from the fp32 master weights (detached copies)."""
        if name not in self._state:
            raise KeyError(f"unknown adapter '{name}'; this engine trains {self.names}")
        from peft.tuners.lora import LoraLayer

        out = []
        for mod_name, mod in self.engine.policy.causal_lm.named_modules():
            if isinstance(mod, LoraLayer) and name in mod.lora_A:
                layer: Any = mod  # peft's ModuleDicts are typed loosely
                out.append(LoraTensors(mod_name, layer.lora_A[name].weight.detach().clone(),
                                       layer.lora_B[name].weight.detach().clone(), float(layer.scaling[name])))
        return out

    def save_adapter(self, name: str, folder: str | Path) -> None:
        """Write ``name`` as a peft adapter folder (loadable by peft, or by ``update_weights(path=)``)."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file

        lm = self.engine.policy.lm
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        sd = get_peft_model_state_dict(lm, adapter_name=name)
        save_file({k: v.detach().cpu().contiguous() for k, v in sd.items()}, str(folder / "adapter_model.safetensors"))
        cfg = lm.peft_config[name].to_dict()
        cfg["base_model_name_or_path"] = self.engine.model_path
        write_text(folder / "adapter_config.json", json.dumps(cfg, indent=1, default=str))

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        """Every adapter under ``path/adapters/<name>/`` (layout in the module docstring)."""
        current = self.active
        for name in self.names:
            self.select(name)
            eng = self.engine
            folder = path / ADAPTERS_DIR / name
            self.save_adapter(name, folder / "adapter")
            torch.save({"optimizer": eng.optimizer.state_dict(), "scheduler": eng.scheduler.state_dict(),
                        "optimizer_steps": eng.optimizer_steps, "train_steps": eng.train_steps,
                        "lr_factor": eng._lr_factor, "ref_pending": eng._ref_pending,
                        "ref_adapter": eng._ref_adapter if eng._ref_anchored else None},
                       folder / "state.pt")
        self.select(current)

    @torch.no_grad()
    def load(self, path: Path) -> None:
        """Restore every adapter a checkpoint saved (weights, AdamW, schedule, counters, reference).

        ``model.adapters`` may have changed since: an adapter the checkpoint lacks is new and keeps its
        initial LoRA (B = 0: it serves the base until its first step) with a fresh optimizer; one the
        checkpoint holds that ``model.adapters`` no longer lists is left on disk. Both are logged. (The engine
        refuses a checkpoint saved without ``model.adapters`` before this.)"""
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        root = path / ADAPTERS_DIR
        saved = sorted(p.name for p in root.iterdir()) if root.exists() else []
        new = [n for n in self.names if n not in saved]
        dropped = [n for n in saved if n not in self.names]
        if new:
            log.info("model.adapters: %s not in checkpoint %s: new, starting from their initial LoRA",
                     ", ".join(new), path)
        if dropped:
            log.warning("checkpoint %s holds adapters %s that model.adapters no longer lists: not loaded "
                        "(their episodes stay in the journal, untrained)", path, ", ".join(dropped))
        current = self.active
        for name in self.names:
            if name in new:
                continue
            self.select(name)
            eng = self.engine
            folder = root / name
            sd = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(eng.policy.lm, sd, adapter_name=name)
            bad = [k for k in getattr(result, "unexpected_keys", []) if ".lora_" in k]
            if bad:
                raise ValueError(f"adapter '{name}' of {path}: tensors the model lacks, e.g. {bad[:3]}")
            st = torch.load(folder / "state.pt", weights_only=False)
            if st["optimizer"].get("state"):
                eng.optimizer.load_state_dict(st["optimizer"])
            eng.scheduler.load_state_dict(st["scheduler"])
            eng.optimizer_steps = int(st["optimizer_steps"])
            eng.train_steps = int(st["train_steps"])
            eng._ref_pending = bool(st["ref_pending"])
            eng._ref_adapter = st["ref_adapter"]
            eng._ref_anchored = st["ref_adapter"] is not None
            eng.set_lr_factor(float(st["lr_factor"]))
        self.select(current)
        sync = getattr(self.engine, "_sync_compute", None)
        if callable(sync):
            sync(everything=True)
