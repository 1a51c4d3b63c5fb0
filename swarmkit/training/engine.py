"""The training loop every engine built on the training core shares.

A subclass (``FSDPEngine``, ``DeepSpeedEngine``) supplies the distributed
wrapping (:meth:`TrainingEngine._wrap`), backward / optimizer step, full state
dicts and checkpoint I/O. Everything else — model loading (full weights or
LoRA), packing, gradient accumulation, PPO epochs / mini-batches, pre-passes
(reference logprobs, missing rollout logprobs, PPO values), LoRA merging for
weight export — lives here, and reads only the algorithm contract
(:class:`swarmkit.contract.Algorithm`) and the typed configs.

``train_step(samples)`` expects the *whole* batch on every rank (every rank
gets the same list); the engine deals packed micro-batches to ranks itself.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from swarmkit.config.lr import auto_lr, base_param_count, is_auto
from swarmkit.config.schema import AdapterSpec, ModelConfig
from swarmkit.contract import Algorithm, LossInputs, OptimEngine, TrainSample, check_algorithm
from swarmkit.training.adapters import AdapterBank, LoraTensors
from swarmkit.training.config import EngineConfig, resolve_token_budget
from swarmkit.training.hostmem import release_freed_memory
from swarmkit.training.lm import default_device, dist_info, load_lm, resolve_dtype
from swarmkit.training.logprob import DEFAULT_LOGIT_CHUNK_ELEMENTS
from swarmkit.training.lora import merge_lora_state
from swarmkit.training.packing import (
    MicroBatch,
    Prepared,
    loss_units,
    loss_weight,
    mark_current_tokens,
    micro_batch_tensors,
    plan_micro_batches,
    prepare_sample,
    split_mini_batches,
)
from swarmkit.training.policy import PolicyModel

log = logging.getLogger(__name__)

#: metric keys of the per-mini-batch entropy sums (summed over micro-batches and ranks, then divided)
_ENT_SUM, _ENT_TOKENS = "_entropy_sum", "_entropy_tokens"
#: ... and of the mismatch KL's (first epoch only; summed over the step, then divided)
_MIS_SUM, _MIS_TOKENS = "_mismatch_sum", "_mismatch_tokens"
#: checkpoint folder of an anchored reference (``reference=warm_start``): torch.distributed.checkpoint
REFERENCE_DIR = "reference"


class TrainingEngine(OptimEngine):
    """Common engine: ``FSDPEngine`` / ``DeepSpeedEngine`` fill in the distributed parts.

    :param model_path: local HF model folder.
    :param model_cfg: the ``model`` group (fields of :class:`~swarmkit.config.schema.ModelConfig`).
    :param optim_cfg: the ``optim`` group (fields of the engine's ``config_cls``).
    :param algo: the RL algorithm (checked against :class:`swarmkit.contract.Algorithm`).
    """

    #: the schema of the ``optim`` group this engine reads (a subclass of EngineConfig)
    config_cls: ClassVar[type[EngineConfig]] = EngineConfig
    #: the optimizer's LR scheduler (made by :meth:`_warmup` in ``_wrap``)
    scheduler: torch.optim.lr_scheduler.LambdaLR
    #: × lr of every coming optimizer step, set at run time (:meth:`set_lr_factor`: the collapse alarm's rollback)
    _lr_factor: float = 1.0
    #: the wrapper runs only inside a process group, a world of one included (DeepSpeed); else a world of one
    #: trains as a plain process
    needs_process_group: ClassVar[bool] = False

    def __init__(self, model_path: str | Path, model_cfg: Mapping[str, Any], optim_cfg: Mapping[str, Any],
                 algo: Algorithm):
        check_algorithm(algo)
        self.model_path = str(model_path)
        self.model = ModelConfig.of(model_cfg)
        self.cfg = self.config_cls(**dict(optim_cfg or {}))
        self.algo = algo
        self.distributed, self.rank, self.world = dist_info()
        if self.distributed and self.world == 1 and (self.model.adapters or not self.needs_process_group):
            # a world of one trains as one process. An in-process vLLM engine forms such a group for its own
            # worker; sharding over it only cost: no bf16 compute copy, no compiled layers, a state-dict gather
            # per weight export (the main job on vLLM trained 4.5x slower per step than on hf on one H100).
            # Several adapters always train plainly in this one process (swarmkit.training.adapters).
            self.distributed = False
        device = self.cfg.device
        self.device = torch.device(device) if device and device != "auto" else default_device()
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": this rank's / the current card
            idx = os.environ.get("LOCAL_RANK") if self.distributed else None
            self.device = torch.device("cuda", int(idx) if idx is not None else torch.cuda.current_device())
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.compute_dtype = resolve_dtype(self.cfg.dtype, self.device)
        self.seed = int(self.cfg.seed or 0)
        self.token_budget = resolve_token_budget(self.cfg.token_budget, self.device.type)
        self.grad_clip = float(self.cfg.grad_clip or 0.0)
        self.lora = self.model.lora_rank > 0
        self.adapter_specs = self.model.adapter_specs()
        self._lr_scale = 1.0  # × lr of the coming optimizer steps (optim.sft_lr on a demonstration batch)
        self.optimizer_steps = 0  # optimizer updates taken
        self.train_steps = 0  # train_step calls that updated the model
        self.needs_values = algo.needs_values
        self.needs_reference = algo.needs_reference
        self.needs_proximal = bool(getattr(algo, "needs_proximal", False))
        self.reference_mode = algo.reference  # "initial" | "warm_start" (checked by check_algorithm)
        #: LoRA: the adapter tensors of an anchored reference (swapped in for its forward); None: adapter off
        self._ref_adapter: dict[str, torch.Tensor] | None = None
        self._ref_anchored = False  # the reference no longer holds the initial weights
        self._ref_pending = False  # demonstration-only steps since the reference was last anchored
        chunk = int(self.cfg.logit_chunk_elements or DEFAULT_LOGIT_CHUNK_ELEMENTS)

        torch.manual_seed(self.seed)
        lm = load_lm(self.model_path, self.model, self.seed)
        self._resolve_lr(lm)
        if self.cfg.activation_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        keep = self._keep_logits_bytes()
        self.policy = PolicyModel(lm, self.compute_dtype, value_head=self.needs_values, chunk_elements=chunk,
                                  keep_logits_bytes=keep)
        self.policy.train()
        self.pad_id = int(getattr(self.policy.causal_lm.config, "pad_token_id", None) or 0)
        self.reference: PolicyModel | None = None
        if self.needs_reference and not self.lora:
            ref_lm = load_lm(self.model_path, dataclasses.replace(self.model, lora_rank=0), self.seed)
            self.reference = PolicyModel(ref_lm, self.compute_dtype, chunk_elements=chunk).eval()
            self.reference.requires_grad_(False)
        self._wrap()
        #: several named adapters over the one base (``model.adapters``); None: one model
        self.adapters: AdapterBank | None = AdapterBank(self, self.adapter_specs) if self.adapter_specs else None
        self.compiled_layers = 0
        if self._wants_compile():
            backend = str(self.cfg.compile_backend or "inductor")
            self.compiled_layers = self._compute_model().compile_layers(backend)
            if self.reference is not None:
                self.reference.compile_layers(backend)

    def _resolve_lr(self, lm: nn.Module) -> None:
        """``optim.lr: auto``: the rate of :func:`~swarmkit.config.lr.auto_lr` for this model's
        base parameters and LoRA (``lr_auto`` True); a number stays as it is."""
        self.lr_auto = is_auto(self.cfg.lr)
        self.base_params = base_param_count(lm.named_parameters())
        if self.lr_auto:
            self.cfg.lr = auto_lr(self.base_params, self.lora)
            if self.rank == 0:
                log.info("optim.lr=auto: %.3g (%.3gM parameters, %s)", self.cfg.lr, self.base_params / 1e6,
                         "LoRA" if self.lora else "full weights")
        else:
            self.cfg.lr = float(self.cfg.lr)

    def _wants_compile(self) -> bool:
        """``optim.compile``: "auto" = on CUDA in one process (no process group); true / false force it."""
        mode = self.cfg.compile
        if isinstance(mode, str):
            low = mode.strip().lower()
            if low == "auto":
                return self.device.type == "cuda" and not self.distributed
            if low in ("true", "on", "1", "yes"):
                return True
            if low in ("false", "off", "0", "no", ""):
                return False
            raise ValueError(f"optim.compile must be auto, true or false, not {mode!r}")
        return bool(mode)

    def _keep_logits_bytes(self) -> int:
        """``optim.keep_logits_bytes``: -1 (auto) = a tenth of the GPU's memory on CUDA, 0 on CPU."""
        val = int(self.cfg.keep_logits_bytes)
        if val >= 0:
            return val
        if self.device.type == "cuda":
            return int(torch.cuda.get_device_properties(self.device).total_memory // 10)
        return 0

    # ------------------------------------------------------------------ subclass hooks
    def _wrap(self) -> None:
        """Shard / wrap ``self.policy`` (and ``self.reference``); create optimizer + scheduler."""
        raise NotImplementedError

    def _forward(self, mb: MicroBatch,
                 model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Logprobs (M,), values (M,) | None and entropies (M,) of a packed micro-batch
        (:meth:`PolicyModel.forward`)."""
        raise NotImplementedError

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        raise NotImplementedError

    def _optimizer_step(self) -> float:
        """Clip, step optimizer and scheduler, zero grads; returns the grad norm before clipping.

        A non-finite norm means the update was not applied (the grads are zeroed, nothing steps);
        an engine that cannot check before stepping raises instead.
        """
        raise NotImplementedError

    def _zero_grad(self) -> None:
        raise NotImplementedError

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict of ``self.policy`` on CPU, on rank 0 (others: {}); collective."""
        raise NotImplementedError

    def current_lr(self) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------------ helpers
    def _adamw(self, params: list[nn.Parameter], fused: bool | None = None,
               lr: float | None = None) -> torch.optim.AdamW:
        """AdamW over ``params`` with the ``optim`` group's settings (``fused`` None: fused on CUDA;
        ``lr`` None: ``optim.lr``)."""
        fused = self.device.type == "cuda" if fused is None else fused
        kw: dict[str, Any] = {"fused": True} if fused else {}
        return torch.optim.AdamW(params, lr=float(self.cfg.lr if lr is None else lr), betas=(float(self.cfg.betas[0]), float(self.cfg.betas[1])),
                                 weight_decay=float(self.cfg.weight_decay), **kw)

    def _warmup(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear LR warm-up over ``optim.warmup_steps`` optimizer steps, then constant, × the phase's scale.

        The engine keeps the returned scheduler as ``self.scheduler`` (its LR scale is set
        per train step by :meth:`_set_lr_scale`).
        """
        warm = warmup_lambda(self.cfg.warmup_steps)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warm(step) * self._lr_scale * self._lr_factor)

    def _set_lr_scale(self, scale: float) -> None:
        """Multiply the learning rate of the coming optimizer steps by ``scale`` (1 = ``optim.lr``)."""
        if scale == self._lr_scale:
            return
        self._lr_scale = scale
        sched = self.scheduler
        for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(sched.last_epoch)

    def set_lr_factor(self, factor: float) -> None:
        """Multiply ``optim.lr`` (and ``optim.sft_lr``) by ``factor`` from now on, on top of the
        warm-up schedule (the collapse alarm's rollback lowers it). Not saved in checkpoints: the
        caller keeps it (the training cycle stores it with its checkpoints' ``extra``)."""
        self._lr_factor = float(factor)
        sched = self.scheduler
        for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
            group["lr"] = base * fn(sched.last_epoch)

    def _step_lr_scale(self, batch: Sequence[TrainSample]) -> float:
        """``optim.sft_lr / optim.lr`` for a batch of demonstrations only, else 1."""
        sft = self.cfg.sft_lr
        if sft is None or not batch or not all(s.demonstration for s in batch):
            return 1.0
        return float(sft) / float(self.cfg.lr)

    def _autocast(self) -> torch.autocast:
        use = self.device.type == "cuda" and self.compute_dtype != torch.float32 and not self._native_low_precision
        return torch.autocast("cuda", dtype=self.compute_dtype, enabled=use)

    #: True when the wrapper already computes in ``compute_dtype`` (FSDP2 mixed precision, DeepSpeed bf16)
    _native_low_precision = False

    def _all_gather_objects(self, obj: Any) -> list[Any]:
        if not self.distributed or self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    @torch.no_grad()
    def _prepass(self, prepared: list[Prepared]) -> None:
        """Fill missing rollout logprobs, proximal logprobs (the weights before the step, for the
        decoupled loss), reference logprobs and PPO values/advantages.

        Every rank scores every sample (same number of collective forwards on all
        ranks); cheap next to training, and only run when needed.
        """
        missing = any(torch.isnan(p.old_logprobs).any() for p in prepared)
        want_ref = self.needs_reference
        want_prox = self.needs_proximal
        if not (missing or want_ref or want_prox or self.needs_values):
            return
        plan = plan_micro_batches([len(p.input_ids) for p in prepared], self.token_budget, 1)
        for bin_ in plan.per_rank[0]:
            mb = micro_batch_tensors(prepared, bin_, self.device, self.pad_id)
            with self._autocast():
                lp, values, _ = self._forward(mb)
            if missing or want_prox or self.needs_values:
                for i, x, v in zip(bin_, mb.split(lp), mb.split(values) if values is not None else [None] * len(bin_), strict=True):
                    p = prepared[i]
                    scored = x.float().cpu()
                    nan = torch.isnan(p.old_logprobs)
                    if nan.any():
                        p.old_logprobs = torch.where(nan, scored, p.old_logprobs)
                    if want_prox:
                        p.prox_logprobs = scored
                    if v is not None:
                        p.old_values = v.float().cpu()
            if want_ref:
                ref_lp = self._reference_logprobs(mb)
                for i, x in zip(bin_, mb.split(ref_lp), strict=True):
                    prepared[i].ref_logprobs = x.float().cpu()
        if self.needs_values:
            self._ppo_advantages(prepared)

    def _compute_model(self) -> PolicyModel:
        """The module that runs forward/backward (``self.policy`` unless the engine keeps a compute copy)."""
        return self.policy

    # ------------------------------------------------------------------ the reference policy
    def _track_warm_start(self, batch: Sequence[TrainSample]) -> bool:
        """``reference=warm_start``: note a demonstration-only batch (the warm start); at the first
        other batch after some, anchor the reference to the current weights. True when it anchored."""
        if not (self.needs_reference and self.reference_mode == "warm_start"):
            return False
        if all(s.demonstration for s in batch):
            self._ref_pending = True
            return False
        if not self._ref_pending:
            return False
        self._anchor_reference()
        self._ref_pending = False
        return True

    @staticmethod
    def _adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
        """The trainable tensors of a LoRA model's LM (the adapter; the value head excluded)."""
        return {n: p for n, p in model.named_parameters() if p.requires_grad and n.startswith("lm.")}

    def _before_reference_write(self) -> None:
        """Called before the reference's weights change in place (FSDP2: drop gathered copies)."""

    @torch.no_grad()
    def _anchor_reference(self) -> None:
        """Make the reference policy the current weights (of the module that runs forward, so the
        reference forward equals the policy's). LoRA: a frozen copy of the adapter tensors only;
        full weights: the policy's parameters copied into the reference module."""
        model = self._compute_model()
        if self.lora:
            self._ref_adapter = {n: p.detach().clone() for n, p in self._adapter_params(model).items()}
        else:
            if self.reference is None:
                raise RuntimeError("a reference model is kept only when the algorithm needs_reference")
            src = dict(model.named_parameters())
            self._before_reference_write()
            for n, p in self.reference.named_parameters():
                p.copy_(src[n])
        self._ref_anchored = True

    @contextmanager
    def _swapped_adapter(self) -> Iterator[None]:
        """LoRA: the anchored reference adapter in place of the live one, restored on exit."""
        anchor = self._ref_adapter
        assert anchor is not None, "only an anchored reference swaps adapters"
        params = self._adapter_params(self._compute_model())
        with torch.no_grad():
            live = {n: p.detach().clone() for n, p in params.items()}
            for n, p in params.items():
                p.copy_(anchor[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(live[n])

    def _reference_state(self) -> dict[str, torch.Tensor] | None:
        """The tensors a checkpoint keeps of an anchored reference; None while it is the initial one."""
        if not self._ref_anchored:
            return None
        if self.lora:
            return self._ref_adapter
        assert self.reference is not None
        return dict(self.reference.named_parameters())

    def _save_reference(self, path: Path) -> None:
        """Write an anchored reference to ``path/reference`` (torch.distributed.checkpoint: sharded
        tensors save sharded); nothing while it is the initial one. Collective."""
        state = self._reference_state()
        if state is None:
            return
        from torch.distributed.checkpoint.state_dict_saver import save

        with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
            warnings.simplefilter("ignore", UserWarning)
            save({"reference": state}, checkpoint_id=str(path / REFERENCE_DIR))

    @torch.no_grad()
    def _load_reference(self, path: Path) -> None:
        """Restore the reference a checkpoint kept (``path/reference``), or go back to the initial one
        when it kept none. Collective."""
        if not self.needs_reference:
            return
        folder = path / REFERENCE_DIR
        if not folder.exists():
            self._reset_reference()
            return
        from torch.distributed.checkpoint.state_dict_loader import load

        if self.lora:
            state = {n: p.detach().clone() for n, p in self._adapter_params(self._compute_model()).items()}
        else:
            assert self.reference is not None
            self._before_reference_write()
            state = dict(self.reference.named_parameters())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            load({"reference": state}, checkpoint_id=str(folder))
        if self.lora:
            self._ref_adapter = state
        self._ref_anchored = True

    @torch.no_grad()
    def _reset_reference(self) -> None:
        """The reference back to the initial weights (a checkpoint saved before any anchoring)."""
        if not self._ref_anchored:
            return
        if self.lora:
            self._ref_adapter = None
        else:
            assert self.reference is not None
            initial = load_lm(self.model_path, dataclasses.replace(self.model, lora_rank=0), self.seed)
            sd = {"lm." + k: v for k, v in initial.state_dict().items()}
            self._before_reference_write()
            from torch.distributed.tensor import DTensor, distribute_tensor

            for n, p in self.reference.named_parameters():
                src = sd[n]
                if isinstance(p, DTensor):  # a shard (FSDP2): give every rank its part
                    src = distribute_tensor(src.to(p.dtype), p.device_mesh, p.placements)
                p.copy_(src)
        self._ref_anchored = False

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Logprobs (M,) of the reference policy: with LoRA the model with its adapter disabled, or
        with the anchored adapter swapped in (``reference=warm_start``); with full weights the
        frozen copy."""
        if self.lora:
            if self._ref_adapter is not None:
                with self._swapped_adapter(), self._autocast():
                    lp, _, _ = self._forward(mb)
                return lp
            with self._compute_model().lm.disable_adapter(), self._autocast():
                lp, _, _ = self._forward(mb)
            return lp
        with self._autocast():
            lp, _, _ = self._forward(mb, model=self.reference)
        return lp

    def _ppo_advantages(self, prepared: list[Prepared]) -> None:
        t = max(p.k for p in prepared)
        mask = torch.zeros(len(prepared), t)
        values = torch.zeros(len(prepared), t)
        for r, p in enumerate(prepared):
            mask[r, : p.k] = 1.0
            assert p.old_values is not None, "the pre-pass scores values when the algorithm needs them"
            values[r, : p.k] = p.old_values
        rewards = torch.tensor([p.reward for p in prepared])
        adv, ret = self.algo.token_advantages(rewards, values, mask)
        for r, p in enumerate(prepared):
            p.advantages = adv[r, : p.k].float()
            p.returns = ret[r, : p.k].float()

    def _loss(self, mb: MicroBatch, lp: torch.Tensor, values: torch.Tensor | None,
              entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        if mb.tokens == 0:  # dummy: gradient 0, graph still touches every parameter group
            loss = lp.sum() * 0.0
            if values is not None:
                loss = loss + values.sum() * 0.0
            return loss, {}
        inputs = LossInputs(logprobs=mb.scatter(lp), old_logprobs=mb.old_logprobs, advantages=mb.advantages,
                            mask=mb.mask, ref_logprobs=mb.ref_logprobs, prox_logprobs=mb.prox_logprobs,
                            entropy=mb.scatter(entropy) if entropy is not None else None)
        if self.needs_values:
            assert values is not None, "an algorithm that needs values gets a value head"
            inputs.values, inputs.old_values, inputs.returns = mb.scatter(values), mb.old_values, mb.returns
        return self.algo.loss(inputs)

    @staticmethod
    def _mismatch_sums(mb: MicroBatch, lp: torch.Tensor) -> tuple[float, float]:
        """``(Σ k3, tokens)`` of KL(engine ‖ trainer) over the micro-batch's trained tokens whose
        logprob the rollout recorded with the weights the trainer holds: the trainer's side is the pre-step policy (the proximal
        pre-pass when it ran, else this forward: exact in the first optimizer step of a batch)."""
        trainer = mb.prox_logprobs if mb.prox_logprobs is not None else mb.scatter(lp.detach().float())
        mask = mb.mask if mb.recorded is None else mb.mask * mb.recorded
        return mismatch_k3_sum(trainer, mb.old_logprobs, mask)

    # ------------------------------------------------------------------ OptimEngine
    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """PPO epochs × mini-batches of optimizer steps over ``batch`` (TrainSamples).

        Returns metrics: ``loss`` (mean over the optimizer steps of the full
        mini-batch loss), ``tokens`` (packed tokens forwarded, all ranks, one
        epoch), ``trained_tokens``, ``samples``, ``micro_batches``, ``grad_norm``,
        ``lr``, ``optimizer_steps``, ``step_time_s``, ``entropy`` (the policy's mean
        next-token entropy over the trained tokens, in nats, as the step's forward passes saw
        it; averaged over the optimizer steps), the algorithm's metrics, with demonstrations
        ``sft_nll`` (their tokens' mean negative logprob before the step: the supervised loss,
        which the policy-gradient ``loss`` at ratio 1 does not show), and
        ``reference_reanchored`` = 1 on the step that moved the reference to the warm-started
        weights (``reference=warm_start``).
        """
        t0 = time.perf_counter()
        pairs = [(s, p) for s in batch if (p := prepare_sample(s)).k > 0]
        for s, p in pairs:  # mismatch_kl counts the tokens the current weights sampled
            mark_current_tokens(s, p, self.optimizer_steps)
        prepared = [p for _, p in pairs]
        if not prepared:
            return {"skipped": 1.0, "samples": 0.0, "trained_tokens": 0.0, "step_time_s": time.perf_counter() - t0}
        reanchored = self._track_warm_start(batch)
        self._prepass(prepared)
        sft = sft_nll([p for s, p in pairs if s.demonstration])
        self._set_lr_scale(self._step_lr_scale(batch))
        mode = self.algo.loss_agg
        epochs = self.algo.ppo_epochs
        n_mini = self.algo.mini_batches
        sums: dict[str, float] = {}
        losses: list[float] = []
        grad_norm = 0.0
        skipped = 0  # updates not applied: non-finite loss or gradient norm
        micro = 0
        mis_sum = mis_tokens = 0.0  # mismatch_kl over the first epoch's trained tokens, all ranks
        for epoch in range(epochs):
            split_seed = self.seed * 1_000_003 + self.optimizer_steps * 31 + epoch
            for idxs in split_mini_batches(len(prepared), n_mini, split_seed):
                subset = [prepared[i] for i in idxs]
                plan = plan_micro_batches([len(p.input_ids) for p in subset], self.token_budget, self.world)
                total = loss_units(subset, mode)
                self._zero_grad()
                # entropy: a token mean whatever the loss aggregation (summed here, divided below)
                local: dict[str, float] = {"loss": 0.0, _ENT_SUM: 0.0, _ENT_TOKENS: 0.0, _MIS_SUM: 0.0,
                                           _MIS_TOKENS: 0.0}
                for k, bin_ in enumerate(plan.per_rank[self.rank]):
                    mb = micro_batch_tensors(subset, bin_, self.device, self.pad_id)
                    units = loss_units([subset[j] for j in bin_], mode)
                    share = units / total if total else 0.0
                    with self._autocast():
                        lp, values, ent = self._forward(mb)
                    loss, metrics = self._loss(mb, lp, values, ent)
                    self._backward(loss * loss_weight(units, total, self.world), last=k == plan.steps - 1)
                    if mb.tokens:
                        local[_ENT_SUM] += float(ent.detach().float().sum().item())
                        local[_ENT_TOKENS] += float(ent.numel())
                        if epoch == 0:
                            k3_sum, k3_tokens = self._mismatch_sums(mb, lp)
                            local[_MIS_SUM] += k3_sum
                            local[_MIS_TOKENS] += k3_tokens
                    local["loss"] += float(loss.detach().item()) * share
                    for key, v in metrics.items():
                        if key != "loss":
                            local[key] = local.get(key, 0.0) + float(v) * share
                    micro += 1
                merged: dict[str, float] = {}
                for part in self._all_gather_objects(local):
                    for key, v in part.items():
                        merged[key] = merged.get(key, 0.0) + v
                mini_loss = merged.pop("loss")
                ent_sum, ent_tokens = merged.pop(_ENT_SUM), merged.pop(_ENT_TOKENS)
                if ent_tokens:
                    merged["entropy"] = ent_sum / ent_tokens
                mis_sum += merged.pop(_MIS_SUM)
                mis_tokens += merged.pop(_MIS_TOKENS)
                if not math.isfinite(mini_loss):  # NaN / inf loss (same on every rank): never applied
                    self._zero_grad()
                    skipped += 1
                    continue
                norm = self._optimizer_step()
                if not math.isfinite(norm):  # the engine did not step (see _optimizer_step)
                    skipped += 1
                    continue
                grad_norm = norm
                self.optimizer_steps += 1
                losses.append(mini_loss)
                for key, v in merged.items():
                    sums[key] = sums.get(key, 0.0) + v
        if not losses:  # every update of the batch was non-finite: the weights are untouched
            return {"skipped": 1.0, "nonfinite_skipped": float(skipped), "samples": float(len(prepared)),
                    "trained_tokens": 0.0, "optimizer_steps": float(self.optimizer_steps),
                    "step_time_s": time.perf_counter() - t0}
        self.train_steps += 1
        n_opt = len(losses)
        out = {key: v / n_opt for key, v in sums.items()}
        out.update(
            loss=sum(losses) / n_opt,
            loss_last=losses[-1],
            tokens=float(sum(len(p.input_ids) for p in prepared)),
            trained_tokens=float(sum(p.k for p in prepared)),
            samples=float(len(prepared)),
            micro_batches=float(sum(self._all_gather_objects(micro))),
            grad_norm=float(grad_norm),
            lr=self.current_lr(),
            optimizer_steps=float(self.optimizer_steps),
            nonfinite_skipped=float(skipped),
            step_time_s=time.perf_counter() - t0,
        )
        if mis_tokens:
            out["mismatch_kl"] = mis_sum / mis_tokens
        if sft is not None:
            out["sft_nll"] = sft
        if reanchored:
            out["reference_reanchored"] = 1.0
        if self.device.type == "cpu":
            release_freed_memory()
        return out

    def _lora_scalings(self) -> dict[str, float]:
        from peft.tuners.lora import LoraLayer

        key = self.adapters.active if self.adapters is not None else "default"
        out = {}
        for name, mod in self._unwrapped().causal_lm.named_modules():
            if isinstance(mod, LoraLayer) and key in mod.scaling:
                out[name] = float(mod.scaling[key])
        return out

    def _unwrapped(self) -> PolicyModel:
        return self.policy

    def _export_state_dict(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """State dict ``export_weights`` reads (default: the full state dict); collective."""
        return self._full_state_dict()

    def _hf_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full state dict with HF names of the *causal LM* (LoRA merged); rank 0 only."""
        full = self._export_state_dict(dtype)
        if not full:
            return {}
        lm_sd = {k[3:]: v for k, v in full.items() if k.startswith("lm.")}
        if self.adapters is not None:  # the active adapter merged; the others' tensors left out
            other = tuple(f".{n}.weight" for n in self.adapters.names if n != self.adapters.active)
            lm_sd = {k: v for k, v in lm_sd.items() if not (".lora_" in k and k.endswith(other))}
        if self.lora:
            return merge_lora_state(lm_sd, self._lora_scalings())
        return lm_sd

    def export_weights(self, dtype: torch.dtype | None = None) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the full HF model (LoRA merged into base names); rank 0 only.

        Collective under torch.distributed: every rank must call it; ranks > 0
        get an empty list. Tensors are detached; on the engine's GPU when it trains in one
        process (bf16 compute weights on CUDA, or the fp32 weights) or in a 1-rank group,
        on the CPU when sharded over several ranks. Treat them as read-only and valid until
        the next ``train_step``.
        """
        sd = self._hf_state(dtype)
        return [(k, v.detach().to(dtype) if dtype else v.detach()) for k, v in sd.items()]

    # ------------------------------------------------------------------ several adapters
    def select_adapter(self, name: str) -> None:
        """Train, export and count steps of adapter ``name`` from now on (``model.adapters``)."""
        if self.adapters is None:
            raise ValueError("select_adapter needs model.adapters")
        self.adapters.select(name)

    def add_adapter(self, spec: AdapterSpec) -> None:
        """Train adapter ``spec`` over the base too, from now on (:meth:`AdapterBank.add`)."""
        if self.adapters is None:
            raise ValueError("add_adapter needs an engine started with model.adapters")
        self.adapters.add(spec)
        self.adapter_specs = list(self.adapters.specs)

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (:meth:`AdapterBank.remove`: the undo of a failed run-time add)."""
        if self.adapters is None:
            raise ValueError("remove_adapter needs model.adapters")
        self.adapters.remove(name)
        self.adapter_specs = list(self.adapters.specs)

    def adapter_steps(self) -> dict[str, int]:
        """Optimizer steps per adapter (each one's policy version); {} without ``model.adapters``."""
        return self.adapters.steps() if self.adapters is not None else {}

    def export_lora(self, name: str) -> list[LoraTensors]:
        """Adapter ``name`` as (module, A, B, scale) for a backend that applies adapters per request."""
        if self.adapters is None:
            raise ValueError("export_lora needs model.adapters")
        return self.adapters.lora_tensors(name)

    def _save_adapters_checkpoint(self, path: Path) -> None:
        """The checkpoint of an engine with several adapters (one process): every adapter's folder
        (:meth:`AdapterBank.save`), the engine's meta and the RNG."""
        assert self.adapters is not None
        path.mkdir(parents=True, exist_ok=True)
        self.adapters.save(path)
        torch.save({"meta": {**self._meta(), "adapters": self.adapters.names}}, path / "engine_state.pt")
        torch.save(self._rng_state(), path / f"rng_rank{self.rank}.pt")

    def _load_adapters_checkpoint(self, path: Path) -> None:
        assert self.adapters is not None
        st = torch.load(path / "engine_state.pt", weights_only=False)
        if "adapters" not in st.get("meta", {}):
            raise ValueError(f"checkpoint {path} was saved without model.adapters; it cannot resume an engine "
                             f"with adapters {self.adapters.names}")
        self.adapters.load(path)
        rng = path / f"rng_rank{self.rank}.pt"
        if rng.exists():
            self._set_rng_state(torch.load(rng, weights_only=False))

    def export_adapter(self, path: str | Path) -> None:
        """Write the LoRA adapter as a peft folder (``adapter_config.json`` + safetensors); rank 0.
        With ``model.adapters``: the active adapter."""
        if not self.lora:
            raise ValueError("export_adapter needs model.lora_rank > 0")
        if self.adapters is not None:
            self.adapters.save_adapter(self.adapters.active, path)
            return
        full = self._full_state_dict()
        if self.rank != 0:
            return
        lm_sd = {k[3:]: v for k, v in full.items() if k.startswith("lm.") and ".lora_" in k}
        lm = self._unwrapped().lm
        lm.peft_config["default"].base_model_name_or_path = self.model_path
        lm.save_pretrained(str(path), state_dict=lm_sd, safe_serialization=True)

    def save_hf(self, path: str | Path) -> None:
        """HF-format model at ``path`` (full: ``save_pretrained`` + tokenizer; LoRA: peft adapter)."""
        path = Path(path)
        if self.lora:
            self.export_adapter(path / "adapter")
            return
        full = self._full_state_dict()
        if self.rank != 0:
            return
        from transformers import AutoTokenizer

        lm_sd = {k[3:]: v for k, v in full.items() if k.startswith("lm.")}
        self._unwrapped().causal_lm.save_pretrained(str(path / "model"), state_dict=lm_sd, safe_serialization=True)
        try:
            AutoTokenizer.from_pretrained(self.model_path).save_pretrained(str(path / "model"))
        except Exception:  # noqa: BLE001 - a model folder without tokenizer still saves
            pass

    def value_head_state(self) -> dict[str, torch.Tensor]:
        full = self._full_state_dict()
        return {k: v for k, v in full.items() if k.startswith("value_head.")}

    # ------------------------------------------------------------------ RNG / meta
    def _rng_state(self) -> dict[str, Any]:
        st: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available():
            st["cuda"] = torch.cuda.get_rng_state_all()
        try:
            import numpy as np

            st["numpy"] = np.random.get_state()
        except ImportError:  # pragma: no cover
            pass
        return st

    def _set_rng_state(self, st: dict[str, Any]) -> None:
        torch.set_rng_state(st["torch"])
        random.setstate(st["python"])
        if "cuda" in st and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(st["cuda"])
        if "numpy" in st:
            import numpy as np

            np.random.set_state(st["numpy"])

    def _meta(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps, "train_steps": self.train_steps,
                "world": self.world, "lora": self.lora, "model_path": self.model_path,
                "reference_pending": self._ref_pending}

    def _set_meta(self, meta: dict[str, Any]) -> None:
        self.optimizer_steps = int(meta["optimizer_steps"])
        self.train_steps = int(meta["train_steps"])
        self._ref_pending = bool(meta.get("reference_pending", False))  # absent in older checkpoints


def warmup_lambda(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear warm-up over ``warmup_steps`` optimizer steps, then constant."""
    w = int(warmup_steps or 0)

    def f(step: int) -> float:
        return 1.0 if w <= 0 else min(1.0, (step + 1) / w)

    return f


def mismatch_k3_sum(trainer_logprobs: torch.Tensor, engine_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> tuple[float, float]:
    """``(Σ k3, tokens)`` over ``mask`` of the k3 estimate of KL(engine ‖ trainer), all inputs (B, T).

    The engine sampled the tokens, so with ``d = trainer − engine`` the per-token
    ``exp(d) − 1 − d`` is an unbiased, non-negative estimate of KL(engine ‖ trainer); the step
    metric ``mismatch_kl`` is the sum over the step's trained tokens divided by their count.
    """
    on = mask.bool()
    d = torch.where(on, trainer_logprobs.detach().double() - engine_logprobs.detach().double(),
                    torch.zeros((), dtype=torch.float64, device=mask.device))
    return float((torch.expm1(d) - d).sum().item()), float(on.sum().item())


def sft_nll(demos: Sequence[Prepared]) -> float | None:
    """Mean negative logprob of demonstrated tokens (their ``old_logprobs``, scored before the
    step), or None without demonstrations."""
    tokens = sum(p.k for p in demos)
    if not tokens:
        return None
    return -float(sum(float(p.old_logprobs.sum()) for p in demos)) / tokens
