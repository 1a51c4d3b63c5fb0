"""Config schemas of the ``grpo`` and ``ppo`` algorithms (group ``algo``)."""

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class MismatchConfig:
    """``algo.mismatch``: correcting the engine/trainer mismatch (``plugins/algo_rl/mismatch.py``,
    docs/training.md "Train/inference mismatch"). With a mode other than "none" the policy loss takes
    its trust region around the trainer's own logprobs before the step and weights every token by
    the trainer/engine probability ratio at ``level``, bounded by ``mode``."""

    #: "none" (the loss's old policy is the engine's recorded logprobs, uncorrected) | "truncate"
    #: (weights above `cap` become `cap`) | "mask" (tokens or sequences whose weight is outside
    #: [floor, cap] are left out of the loss)
    mode: str = "none"
    #: the ratio one weight is taken over: "token" | "sequence" (product over the sequence) |
    #: "geometric" (per-token geometric mean over the sequence)
    level: str = "geometric"
    #: upper bound of the weights (>= 1)
    cap: float = 2.0
    #: mask: lower bound of the weights kept, in [0, 1] (0: none)
    floor: float = 0.5


def _mismatch(value: object) -> MismatchConfig:
    """A :class:`MismatchConfig` from itself or a plain group (a dict, an OmegaConf node)."""
    if isinstance(value, MismatchConfig):
        return value
    if isinstance(value, Mapping):
        return MismatchConfig(**dict(value))
    raise TypeError(f"algo.mismatch must be a group of keys (mode, level, cap, floor), got {value!r}")


@dataclass
class GRPOConfig:
    name: str = "grpo"
    #: divide centred group rewards by the group's std (Dr. GRPO sets False)
    std_normalize: bool = True
    clip_low: float = 0.2
    clip_high: float = 0.28
    #: KL penalty to the frozen reference policy (see `reference`); 0 disables (no reference kept)
    kl_coef: float = 0.0
    #: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum-norm"
    loss_agg: str = "token-mean"
    #: constant the summed token losses are divided by in seq-mean-token-sum-norm
    loss_norm_constant: float = 1024.0
    ppo_epochs: int = 1
    mini_batches: int = 1
    #: added to the group's std before dividing (std_normalize)
    adv_eps: float = 1e-6
    #: KL estimator of the penalty: "k1" | "k2" | "k3"
    kl_kind: str = "k3"
    #: decoupled PPO loss (trust region around the trainer's pre-step weights, importance weights
    #: to the sampling policy); null = on when trainer.mode=async, off when sync
    decoupled: bool | None = None
    #: decoupled loss: tokens whose importance weight exceeds this are left out (<= 0: no cap)
    behav_weight_cap: float = 5.0
    #: entropy bonus: the loss subtracts entropy_coef x the policy's entropy on the trained tokens
    #: (aggregated like the loss); 0 = no bonus. The step metric `entropy` is reported either way
    entropy_coef: float = 0.0
    #: the KL term's reference (kl_coef > 0): "initial" = the loaded weights; "warm_start" = the
    #: weights at the first RL step after demonstration-only steps (a warm start), re-anchored there
    reference: str = "initial"
    #: generations cut by their request's max_tokens: "none" | "filter" (their episode's samples are
    #: left out of the loss) | "penalty" (DAPO's soft length penalty is added to the reward)
    overlong: str = "none"
    #: "penalty": the penalty ramps from 0 to -1 over this many tokens before the limit
    overlong_buffer: int = 128
    #: the policy objective: "clip" (PPO's clipped surrogate) | "gspo" (one length-normalised ratio
    #: per sequence; use far narrower clip ranges, e.g. 3e-4 / 4e-4) | "cispo" (clipped, stop-gradient
    #: importance weight times the logprob: no token loses its gradient)
    policy_loss: str = "clip"
    #: train/inference mismatch correction (MismatchConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)

    def __post_init__(self) -> None:
        self.mismatch = _mismatch(self.mismatch)


@dataclass
class PPOConfig:
    name: str = "ppo"
    #: discount and GAE lambda over a row's generated tokens
    gamma: float = 1.0
    lam: float = 0.95
    clip_low: float = 0.2
    clip_high: float = 0.2
    #: clip range of the value loss (<= 0: no clipping); weight of the value loss
    value_clip: float = 0.2
    vf_coef: float = 0.5
    kl_coef: float = 0.0
    loss_agg: str = "token-mean"
    loss_norm_constant: float = 1024.0
    ppo_epochs: int = 1
    mini_batches: int = 1
    #: whiten advantages over the batch's generated tokens
    normalize_advantages: bool = True
    kl_kind: str = "k3"
    decoupled: bool | None = None
    behav_weight_cap: float = 5.0
    #: the guard rails, as in GRPOConfig
    entropy_coef: float = 0.0
    reference: str = "initial"
    overlong: str = "none"
    overlong_buffer: int = 128
    #: the policy objective: "clip" (PPO's clipped surrogate) | "gspo" (one length-normalised ratio
    #: per sequence; use far narrower clip ranges, e.g. 3e-4 / 4e-4) | "cispo" (clipped, stop-gradient
    #: importance weight times the logprob: no token loses its gradient)
    policy_loss: str = "clip"
    #: train/inference mismatch correction (MismatchConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)

    def __post_init__(self) -> None:
        self.mismatch = _mismatch(self.mismatch)
