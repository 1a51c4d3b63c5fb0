"""PPO: critic values, GAE, clipped surrogate and clipped value loss."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from swarmkit_plugins.algo_rl import losses
from swarmkit_plugins.algo_rl.grpo import ClippedPolicyAlgorithm, expand_advantages


class PPO(ClippedPolicyAlgorithm):
    """PPO built from the ``algo`` group (fields of ``PPOConfig``).

    The sequence reward sits on the row's last generated token; GAE runs over
    the generated tokens of a row (environment tokens between turns skipped).
    A KL to the reference (``kl_coef > 0``) is a loss term, not reward shaping.
    """

    needs_values = True

    def __init__(
        self, name: str = "ppo", gamma: float = 1.0, lam: float = 0.95, clip_low: float = 0.2,
        clip_high: float = 0.2, value_clip: float = 0.2, vf_coef: float = 0.5,
        kl_coef: float = 0.0, loss_agg: str = "token-mean", loss_norm_constant: float = 1024.0,
        ppo_epochs: int = 1, mini_batches: int = 1, normalize_advantages: bool = True,
        kl_kind: str = "k3",
    ):
        self._init_common(name, clip_low, clip_high, kl_coef, kl_kind, loss_agg, loss_norm_constant,
                          ppo_epochs, mini_batches)
        self.gamma = float(gamma)
        self.lam = float(lam)
        self.value_clip = float(value_clip)
        self.vf_coef = float(vf_coef)
        self.normalize_advantages = bool(normalize_advantages)

    def token_advantages(
        self, rewards_per_sequence: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)``, both (B, T), from rewards (B,) and old values (B, T).

        Advantages are whitened over the mask when ``normalize_advantages``
        (returns are not). Call once on the whole batch, before mini-batching.
        """
        values = values.detach()
        token_rewards = losses.sequence_rewards_to_tokens(
            rewards_per_sequence.to(values.dtype), mask)
        adv, returns = losses.gae(token_rewards, values, mask, self.gamma, self.lam)
        if self.normalize_advantages:
            adv = losses.masked_whiten(adv, mask)
        return adv, returns

    def advantages(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_advantages(batch["rewards"], batch["values"], batch["mask"])``."""
        return self.token_advantages(batch["rewards"], batch["values"], batch["mask"])

    def loss(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor, values: torch.Tensor, old_values: torch.Tensor,
        returns: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss + ``vf_coef`` * value loss (+ ``kl_coef`` * KL); all (B, T)."""
        adv = expand_advantages(advantages, mask)
        loss, metrics = losses.policy_loss(
            logprobs, old_logprobs, adv, mask, self.clip_low, self.clip_high, self.loss_agg,
            self.loss_norm_constant)
        vl, v_metrics = losses.value_loss(values, old_values, returns, mask, self.value_clip,
                                          self.loss_agg, self.loss_norm_constant)
        loss = loss + self.vf_coef * vl
        metrics.update(v_metrics)
        loss = self._add_kl(loss, metrics, logprobs, ref_logprobs, mask)
        metrics["loss"] = float(loss.detach().item())
        return loss, metrics
