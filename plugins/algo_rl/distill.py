"""On-policy distillation (``algo=distill``): the student learns the teacher's logprobs on its own tokens.

The student samples as in RL; before each step the trainer asks the teacher (any OpenAI-compatible
endpoint that scores prompts with ``echo``, another swarm server included: :mod:`.teacher`) for the
logprob of every token the student generated. Each trained token ``t`` then gets the advantage

    A_t = rl_coef · A_grpo + distill_coef · clip(log p_teacher(y_t | y_<t) − log p_student(y_t | y_<t))

where ``log p_student`` is the logprob the engine recorded when it sampled the token (the behaviour
policy). ``log p_student − log p_teacher`` of a sampled token is the one-sample estimate of the reverse
KL(student ‖ teacher) at that position, so with ``rl_coef = 0`` the clipped surrogate (GRPO's loss, with
its ratio, clipping, KL and entropy terms) follows the policy gradient of −reverse KL with no credit
across positions (discount 0): the *advantage form* of on-policy distillation. At ratio 1 its gradient
is that of the naive loss ``mean_t sg(log p_student − log p_teacher) · log p_student`` (tested to 1e-6).
``rl_coef > 0`` mixes in the episode's group-relative reward advantage.

Demonstrations keep their supervised advantage; tokens with no recorded logprob (NaN: constrained
decoding) get no distillation term.
"""

from __future__ import annotations

from typing import Any

import torch

from swarmkit.contract import TrainSample
from swarmkit.errors import ConfigError
from swarmkit_plugins.algo_rl.distill_schema import DistillConfig
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.algo_rl.teacher import TeacherClient


def distill_advantages(rl_advantages: torch.Tensor, student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                       mask: torch.Tensor, rl_coef: float, distill_coef: float,
                       clip: float = 0.0) -> torch.Tensor:
    """Per-token advantages of on-policy distillation, (B, T).

    :param rl_advantages: (B, T) the RL advantage of each token (GRPO's, broadcast over the episode).
    :param student_logprobs: (B, T) the sampling policy's logprob of each token.
    :param teacher_logprobs: (B, T) the teacher's logprob of the same token given the same prefix.
    :param mask: (B, T) 1.0 on trained tokens.
    :param clip: > 0 clips the distillation term to ``[-clip, clip]``.
    :returns: ``rl_coef·A + distill_coef·clip(teacher − student)`` on trained tokens whose logprobs are both
        finite, ``rl_coef·A`` on trained tokens without them, 0 elsewhere.
    """
    gap = teacher_logprobs - student_logprobs
    ok = torch.isfinite(gap) & (mask > 0)
    gap = torch.where(ok, gap, torch.zeros_like(gap))
    if clip > 0:
        gap = gap.clamp(-clip, clip)
    return torch.where(mask > 0, rl_coef * rl_advantages + distill_coef * gap, torch.zeros_like(gap))


def reverse_kl_estimate(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """The mean over trained tokens with finite logprobs of ``student − teacher``: a one-sample (k1) estimate
    of KL(student ‖ teacher) per token on the student's own samples, 0-d (0 when no token counts)."""
    gap = student_logprobs - teacher_logprobs
    ok = torch.isfinite(gap) & (mask > 0)
    n = ok.sum()
    return torch.where(ok, gap, torch.zeros_like(gap)).sum() / n.clamp(min=1)


class Distill(GRPO):
    """GRPO's loss on per-token distillation advantages from a teacher endpoint (see the module docstring).

    Built from the ``algo`` group: ``Distill(**fields of DistillConfig)``; a ``teacher`` client may be
    passed instead of the URL (tests, a custom transport).
    """

    config_cls = DistillConfig  # type: ignore[assignment]

    def __init__(self, teacher: TeacherClient | None = None, **config: Any):
        self.cfg = DistillConfig(**config)
        self._init_common(self.cfg)
        self.std_normalize = bool(self.cfg.std_normalize)
        self.adv_eps = float(self.cfg.adv_eps)
        problems = [p for p in DistillConfig.problems(self.cfg) if teacher is None or not p.startswith("algo.teacher_url")]
        if problems:
            raise ConfigError(problems)
        self.rl_coef = float(self.cfg.rl_coef)
        self.distill_coef = float(self.cfg.distill_coef)
        self.adv_clip = float(self.cfg.distill_adv_clip)
        self.teacher = teacher or TeacherClient(
            self.cfg.teacher_url, api_key=self.cfg.teacher_api_key, model=self.cfg.teacher_model,
            swarm=self.cfg.teacher_swarm, timeout_s=self.cfg.teacher_timeout_s, retries=self.cfg.teacher_retries,
            batch=self.cfg.teacher_batch)

    def prepare_samples(self, samples: list[TrainSample]) -> dict[str, float]:
        """Ask the teacher for the logprobs of every sampled sequence and rewrite its trained tokens'
        advantages in place. Metrics: ``distill_reverse_kl`` (mean student − teacher logprob over the trained
        tokens), ``teacher_logprob_mean``, ``student_logprob_mean``, ``distill_adv_mean``, ``teacher_tokens``,
        ``teacher_time_s``, ``teacher_retries``."""
        todo = [s for s in samples if not s.demonstration and any(s.loss_mask)]
        if not todo:
            return {}
        before = dict(self.teacher.stats)
        teacher = self.teacher.score([s.input_ids for s in todo])
        kl_sum = t_sum = s_sum = a_sum = 0.0
        n = 0
        for s, t_lps in zip(todo, teacher, strict=True):
            mask = torch.tensor(s.loss_mask, dtype=torch.float64)
            student = torch.tensor(s.old_logprobs, dtype=torch.float64)
            tl = torch.tensor(t_lps, dtype=torch.float64)
            adv = distill_advantages(torch.tensor(s.advantages, dtype=torch.float64), student, tl, mask,
                                     self.rl_coef, self.distill_coef, self.adv_clip)
            s.advantages = adv.tolist()
            ok = torch.isfinite(student - tl) & (mask > 0)
            k = int(ok.sum())
            n += k
            kl_sum += float(reverse_kl_estimate(student, tl, mask)) * k
            t_sum += float(tl[ok].sum())
            s_sum += float(student[ok].sum())
            a_sum += float(adv[mask > 0].sum())
        trained = sum(sum(s.loss_mask) for s in todo)
        d = max(n, 1)
        return {
            "distill_reverse_kl": kl_sum / d,
            "teacher_logprob_mean": t_sum / d,
            "student_logprob_mean": s_sum / d,
            "distill_adv_mean": a_sum / max(trained, 1),
            "teacher_tokens": float(n),
            "teacher_time_s": float(self.teacher.stats["time_s"] - before["time_s"]),
            "teacher_retries": float(self.teacher.stats["retries"] - before["retries"]),
        }
