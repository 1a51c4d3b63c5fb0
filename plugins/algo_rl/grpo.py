"""GRPO: group-relative advantages, clipped surrogate, optional KL to a reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from swarmkit.interfaces import Algorithm
from swarmkit_plugins.algo_rl import losses


class ClippedPolicyAlgorithm(Algorithm):
    """What GRPO and PPO share: the clipped surrogate's settings, loss aggregation and KL."""

    def _init_common(self, name: str, clip_low: float, clip_high: float, kl_coef: float, kl_kind: str,
                     loss_agg: str, loss_norm_constant: float, ppo_epochs: int, mini_batches: int) -> None:
        problems = []
        if not 0 <= clip_low < 1:
            problems.append(f"algo.clip_low must be in [0, 1), got {clip_low}")
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
        if problems:
            from swarmkit.errors import ConfigError

            raise ConfigError(problems)
        self.name = name
        self.clip_low = float(clip_low)
        self.clip_high = float(clip_high)
        self.kl_coef = float(kl_coef)
        self.kl_kind = kl_kind
        self.loss_agg = loss_agg
        self.loss_norm_constant = float(loss_norm_constant)
        self.ppo_epochs = int(ppo_epochs)
        self.mini_batches = int(mini_batches)

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


def expand_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages (B,) broadcast to (B, T); (B, T) passes through."""
    if advantages.dim() == 1:
        return advantages[:, None].expand_as(mask).to(torch.result_type(advantages, 1.0))
    return advantages


class GRPO(ClippedPolicyAlgorithm):
    """GRPO built from the ``algo`` group (fields of ``GRPOConfig``).

    Every generated token of an episode (all spans of all its merged samples)
    gets the episode's advantage. ``ppo_epochs`` passes over the batch, each
    split into ``mini_batches`` optimizer steps, are the engine's job.
    """

    needs_values = False

    def __init__(
        self, name: str = "grpo", std_normalize: bool = True, clip_low: float = 0.2,
        clip_high: float = 0.28, kl_coef: float = 0.0, loss_agg: str = "token-mean",
        loss_norm_constant: float = 1024.0, ppo_epochs: int = 1, mini_batches: int = 1,
        adv_eps: float = 1e-6, kl_kind: str = "k3",
    ):
        self._init_common(name, clip_low, clip_high, kl_coef, kl_kind, loss_agg, loss_norm_constant,
                          ppo_epochs, mini_batches)
        self.std_normalize = bool(std_normalize)
        self.adv_eps = float(adv_eps)

    def episode_advantages(self, rewards: Sequence[float], task_ids: Sequence[str]) -> list[float]:
        """One advantage per episode, relative to the other episodes of its task."""
        if len(rewards) != len(task_ids):
            raise ValueError(f"{len(rewards)} rewards for {len(task_ids)} task ids")
        if not rewards:
            return []
        index: dict[str, int] = {}
        groups = torch.tensor([index.setdefault(t, len(index)) for t in task_ids])
        r = torch.tensor([float(x) for x in rewards], dtype=torch.float64)
        return losses.grpo_advantages(r, groups, self.std_normalize, self.adv_eps).tolist()

    def advantages(self, batch: Mapping[str, Any]) -> list[float]:
        """``episode_advantages(batch["rewards"], batch["task_ids"])``."""
        return self.episode_advantages(batch["rewards"], batch["task_ids"])

    def loss(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Clipped surrogate (+ ``kl_coef`` * KL to the reference) of a micro-batch.

        ``logprobs``, ``old_logprobs``, ``mask``, ``ref_logprobs``: (B, T);
        ``advantages``: (B, T) or (B,) (one per row, broadcast over tokens).
        """
        adv = expand_advantages(advantages, mask)
        loss, metrics = losses.policy_loss(
            logprobs, old_logprobs, adv, mask, self.clip_low, self.clip_high, self.loss_agg,
            self.loss_norm_constant)
        loss = self._add_kl(loss, metrics, logprobs, ref_logprobs, mask)
        metrics["loss"] = float(loss.detach().item())
        return loss, metrics
