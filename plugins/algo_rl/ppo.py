"""PPO: critic values, GAE, clipped surrogate and clipped value loss."""

from __future__ import annotations

from typing import Any

import torch

from swarmkit.contract import LossInputs
from swarmkit_plugins.algo_rl import losses
from swarmkit_plugins.algo_rl.grpo import ClippedPolicyAlgorithm, expand_advantages
from swarmkit_plugins.algo_rl.schema import PPOConfig


class PPO(ClippedPolicyAlgorithm):
    """PPO built from the ``algo`` group: ``PPO(**fields of PPOConfig)``.

    The sequence reward sits on the row's last generated token; GAE runs over
    the generated tokens of a row (environment tokens between turns skipped).
    A KL to the reference (``kl_coef > 0``) is a loss term, not reward shaping.
    """

    config_cls = PPOConfig
    needs_values = True

    def __init__(self, **config: Any):
        self.cfg = PPOConfig(**config)  # the schema holds the only defaults
        self._init_common(self.cfg)
        self.gamma = float(self.cfg.gamma)
        self.lam = float(self.cfg.lam)
        self.value_clip = float(self.cfg.value_clip)
        self.vf_coef = float(self.cfg.vf_coef)
        self.normalize_advantages = bool(self.cfg.normalize_advantages)

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

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        """Policy loss + ``vf_coef`` * value loss (+ ``kl_coef`` * KL − ``entropy_coef`` * entropy); all (B, T)."""
        x = inputs
        if x.values is None or x.old_values is None or x.returns is None:
            raise ValueError("PPO's loss needs values, old_values and returns (the engine's value head)")
        adv = expand_advantages(x.advantages, x.mask)
        loss, metrics = self._policy_loss(x, adv)
        vl, v_metrics = losses.value_loss(x.values, x.old_values, x.returns, x.mask, self.value_clip,
                                          self.loss_agg, self.loss_norm_constant)
        loss = loss + self.vf_coef * vl
        metrics.update(v_metrics)
        loss = self._add_kl(loss, metrics, x.logprobs, x.ref_logprobs, x.mask)
        loss = self._add_entropy(loss, metrics, x)
        metrics["loss"] = float(loss.detach().item())
        return loss, metrics
