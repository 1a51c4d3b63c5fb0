"""GRPO: group-relative advantages, clipped surrogate, optional KL to a reference and entropy bonus."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from swarmkit.contract import OVERLONG_MODES, REFERENCE_MODES, Algorithm, LossInputs
from swarmkit.errors import ConfigError
from swarmkit_plugins.algo_rl import losses, mismatch, objectives
from swarmkit_plugins.algo_rl.schema import GRPOConfig, PPOConfig


class ClippedPolicyAlgorithm(Algorithm):
    """What GRPO and PPO share: the clipped surrogate's settings, loss aggregation, KL, entropy bonus
    and the guard rails the engine and trainer read (``reference``, ``overlong``)."""

    def _init_common(self, cfg: GRPOConfig | PPOConfig) -> None:
        name, clip_low, clip_high, kl_coef, kl_kind = cfg.name, cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.kl_kind
        loss_agg, loss_norm_constant = cfg.loss_agg, cfg.loss_norm_constant
        ppo_epochs, mini_batches = cfg.ppo_epochs, cfg.mini_batches
        problems = []
        if not (0 <= clip_low <= 1 if cfg.policy_loss == "cispo" else 0 <= clip_low < 1):
            bound = "[0, 1] with policy_loss=cispo" if cfg.policy_loss == "cispo" else "[0, 1)"
            problems.append(f"algo.clip_low must be in {bound}, got {clip_low}")
        if clip_high < 0:
            problems.append(f"algo.clip_high must be >= 0, got {clip_high}")
        if loss_agg not in losses.AGG_MODES:
            problems.append(f"algo.loss_agg must be one of {losses.AGG_MODES}, got {loss_agg!r}")
        if loss_norm_constant <= 0:
            problems.append(f"algo.loss_norm_constant must be > 0, got {loss_norm_constant}")
        if ppo_epochs < 1 or mini_batches < 1:
            problems.append("algo.ppo_epochs and algo.mini_batches must be >= 1")
        if kl_coef < 0:
            problems.append(f"algo.kl_coef must be >= 0, got {kl_coef}")
        if kl_kind not in losses.KL_KINDS:
            problems.append(f"algo.kl_kind must be one of {losses.KL_KINDS}, got {kl_kind!r}")
        if cfg.decoupled not in (None, True, False):
            problems.append(f"algo.decoupled must be true, false or null, got {cfg.decoupled!r}")
        if not cfg.entropy_coef >= 0:
            problems.append(f"algo.entropy_coef must be >= 0, got {cfg.entropy_coef}")
        if cfg.reference not in REFERENCE_MODES:
            problems.append(f"algo.reference must be one of {REFERENCE_MODES}, got {cfg.reference!r}")
        if cfg.overlong not in OVERLONG_MODES:
            problems.append(f"algo.overlong must be one of {OVERLONG_MODES}, got {cfg.overlong!r}")
        if isinstance(cfg.overlong_buffer, bool) or not isinstance(cfg.overlong_buffer, int) \
                or cfg.overlong_buffer < 0:
            problems.append(f"algo.overlong_buffer must be an int >= 0, got {cfg.overlong_buffer!r}")
        if cfg.policy_loss not in objectives.POLICY_LOSSES:
            problems.append(f"algo.policy_loss must be one of {objectives.POLICY_LOSSES}, got {cfg.policy_loss!r}")
        mm = cfg.mismatch
        problems += mismatch.check_mismatch(mm.mode, mm.level, mm.cap, mm.floor)
        if problems:
            raise ConfigError(problems)
        self.name = name
        self.policy_loss = cfg.policy_loss
        self.mismatch = mm
        self.decoupled = bool(cfg.decoupled)
        self.behav_weight_cap = float(cfg.behav_weight_cap)
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.kl_coef = float(kl_coef)
        self.kl_kind = kl_kind
        self.loss_agg = loss_agg
        self.loss_norm_constant = float(loss_norm_constant)
        self.ppo_epochs = int(ppo_epochs)
        self.mini_batches = int(mini_batches)
        self.entropy_coef = float(cfg.entropy_coef)
        self.reference = cfg.reference
        self.overlong = cfg.overlong
        self.overlong_buffer = int(cfg.overlong_buffer)

    @property
    def corrects_mismatch(self) -> bool:
        """Whether the loss corrects the engine/trainer mismatch (``algo.mismatch.mode`` not "none")."""
        return self.mismatch.mode != "none"

    @property
    def needs_proximal(self) -> bool:
        """Whether the engine scores the pre-step (proximal) logprobs: the decoupled loss, or a
        mismatch correction whose batch takes more than one optimizer step (with one, the
        logprobs of the step's own forward are the pre-step ones: no pre-pass needed)."""
        return self.decoupled or (self.corrects_mismatch and self.ppo_epochs * self.mini_batches > 1)

    def _policy_loss(self, x: LossInputs, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The policy objective (``policy_loss``): around the rollout logprobs, or (``decoupled``,
        or a mismatch correction) around the trainer's pre-step ones with importance weights to the
        rollout policy."""
        if self.policy_loss != "clip" or self.corrects_mismatch:
            return self._weighted_policy_loss(x, adv)
        if not self.decoupled:
            return losses.policy_loss(x.logprobs, x.old_logprobs, adv, x.mask, self.clip_low, self.clip_high,
                                      self.loss_agg, self.loss_norm_constant)
        if x.prox_logprobs is None:
            raise ValueError(f"{type(self).__name__} with decoupled=true needs prox_logprobs (needs_proximal)")
        return losses.decoupled_policy_loss(
            x.logprobs, x.prox_logprobs, x.old_logprobs, adv, x.mask, self.clip_low, self.clip_high,
            self.behav_weight_cap, self.loss_agg, self.loss_norm_constant)

    def _weighted_policy_loss(self, x: LossInputs, adv: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """``policy_loss`` with its anchor and importance weights: no correction and not decoupled,
        around the engine's logprobs, unweighted; otherwise around the trainer's pre-step logprobs
        (``prox_logprobs``, or this forward's own when no pre-pass ran) weighted to the engine's,
        by ``mismatch`` (raw weights when "none"), tokens past ``behav_weight_cap`` left out when
        ``decoupled``."""
        if not (self.decoupled or self.corrects_mismatch):
            return objectives.weighted_policy_loss(x.logprobs, x.old_logprobs, adv, x.mask, None, self.policy_loss,
                                                   self.clip_low, self.clip_high, self.loss_agg,
                                                   self.loss_norm_constant)
        anchor = x.prox_logprobs
        if anchor is None:
            if self.needs_proximal:
                raise ValueError(f"{type(self).__name__} with decoupled=true or a mismatch correction over "
                                 "several optimizer steps needs prox_logprobs (needs_proximal)")
            anchor = x.logprobs.detach()  # one optimizer step: this forward is the pre-step policy
        mm = self.mismatch
        level = mm.level if self.corrects_mismatch else "token"  # uncorrected (decoupled): the raw token weights
        weights, changed = mismatch.importance_weights(anchor, x.old_logprobs, x.mask, level, mm.mode, mm.cap,
                                                       mm.floor)
        if self.decoupled and self.behav_weight_cap > 0:
            raw = torch.exp((anchor - x.old_logprobs).detach())
            weights = torch.where(raw <= self.behav_weight_cap, weights, torch.zeros_like(weights))
        loss, metrics = objectives.weighted_policy_loss(x.logprobs, anchor, adv, x.mask, weights, self.policy_loss,
                                                        self.clip_low, self.clip_high, self.loss_agg,
                                                        self.loss_norm_constant)
        if self.corrects_mismatch:
            metrics |= mismatch.weight_metrics(weights, changed, x.mask, mm.mode)
        return loss, metrics

    #: the schema of the ``algo`` group (GRPOConfig, PPOConfig)
    config_cls: ClassVar[type[GRPOConfig] | type[PPOConfig]]

    @classmethod
    def resolve_config(cls, config: dict[str, Any], *, trainer_mode: str) -> dict[str, Any]:
        """``decoupled: null`` (the default): the decoupled loss is on when the trainer is
        asynchronous (``trainer.mode=async``), off when it is synchronous."""
        if cls.config_cls(**config).decoupled is None:
            return {**config, "decoupled": trainer_mode == "async"}
        return config

    @property
    def needs_reference(self) -> bool:
        """Whether the engine must keep a frozen reference policy (``kl_coef > 0``)."""
        return self.kl_coef > 0

    def _add_kl(self, loss: torch.Tensor, metrics: dict[str, float], logprobs: torch.Tensor,
                ref_logprobs: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
        """``loss + kl_coef * KL(policy || reference)`` when ``kl_coef > 0``; records its metrics."""
        if self.kl_coef <= 0:
            return loss
        if ref_logprobs is None:
            raise ValueError(f"{type(self).__name__} with kl_coef > 0 needs ref_logprobs")
        kl, kl_metrics = losses.kl_penalty(logprobs, ref_logprobs, mask, self.kl_kind,
                                           self.loss_agg, self.loss_norm_constant)
        metrics.update(kl_metrics)
        return loss + self.kl_coef * kl

    def _add_entropy(self, loss: torch.Tensor, metrics: dict[str, float], x: LossInputs) -> torch.Tensor:
        """``loss − entropy_coef * entropy`` (aggregated like the loss) when ``entropy_coef > 0``."""
        if self.entropy_coef <= 0:
            return loss
        if x.entropy is None:
            raise ValueError(f"{type(self).__name__} with entropy_coef > 0 needs LossInputs.entropy")
        term, ent_metrics = losses.entropy_loss(x.entropy, x.mask, self.loss_agg, self.loss_norm_constant)
        metrics.update(ent_metrics)
        return loss + self.entropy_coef * term


def expand_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages (B,) broadcast to (B, T); (B, T) passes through."""
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(mask).to(torch.result_type(advantages, 1.0))
    return advantages


class GRPO(ClippedPolicyAlgorithm):
    """GRPO built from the ``algo`` group: ``GRPO(**fields of GRPOConfig)``.

    Every generated token of an episode (all spans of all its merged samples)
    gets the episode's advantage. ``ppo_epochs`` passes over the batch, each
    split into ``mini_batches`` optimizer steps, are the engine's job.
    """

    config_cls = GRPOConfig
    needs_values = False

    def __init__(self, **config: Any):
        self.cfg = GRPOConfig(**config)  # the schema holds the only defaults
        self._init_common(self.cfg)
        self.std_normalize = bool(self.cfg.std_normalize)
        self.adv_eps = float(self.cfg.adv_eps)

    def episode_advantages(self, rewards: Sequence[float], groups: Sequence[str]) -> list[float]:
        """One advantage per reward unit, relative to the other units of its group (task)."""
        if len(rewards) != len(groups):
            raise ValueError(f"{len(rewards)} rewards for {len(groups)} groups")
        if not rewards:
            return []
        index: dict[str, int] = {}
        group_index = torch.tensor([index.setdefault(g, len(index)) for g in groups])
        r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
        return losses.grpo_advantages(r, group_index, self.std_normalize, self.adv_eps).tolist()

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped surrogate (+ ``kl_coef`` * KL to the reference − ``entropy_coef`` * entropy) of a
        micro-batch.

        ``logprobs``, ``old_logprobs``, ``mask``, ``ref_logprobs``, ``entropy``: (B, T);
        ``advantages``: (B, T) or (B,) (one per row, broadcast over tokens).
        """
        x = inputs
        adv = expand_advantages(x.advantages, x.mask)
        loss, metrics = self._policy_loss(x, adv)
        loss = self._add_kl(loss, metrics, x.logprobs, x.ref_logprobs, x.mask)
        loss = self._add_entropy(loss, metrics, x)
        metrics["loss"] = float(loss.detach().item())
        return loss, metrics
