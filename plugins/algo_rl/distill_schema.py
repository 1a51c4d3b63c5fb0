"""Config schema of the ``distill`` algorithm (group ``algo``): GRPO's keys plus the teacher's."""

from __future__ import annotations

from dataclasses import dataclass

from swarmkit_plugins.algo_rl.schema import GRPOConfig


@dataclass
class DistillConfig(GRPOConfig):
    name: str = "distill"
    #: the teacher: an OpenAI-compatible API base URL (``http://host:port/v1``) whose ``/completions`` takes
    #: ``echo`` with ``logprobs`` and ``max_tokens: 0`` (vLLM, a swarm server), or with ``teacher_swarm`` a
    #: swarm server's root URL. It must share the student's tokenizer (token ids are sent as they are)
    teacher_url: str = ""
    #: the bearer key sent to the teacher (an API key; with ``teacher_swarm`` the swarm server's client
    #: token, if it has one); empty: none, or ``$SWARMKIT_TEACHER_API_KEY`` when set
    teacher_api_key: str = ""
    #: the ``model`` field sent to the teacher (a swarm server ignores it)
    teacher_model: str = ""
    #: the teacher is a swarm server: each step registers an eval episode there, scores with its key, aborts it
    teacher_swarm: bool = False
    #: seconds one teacher request may take; attempts of a request (connection errors, 429, 5xx, timeouts)
    teacher_timeout_s: float = 120.0
    teacher_retries: int = 3
    #: sequences scored per teacher request
    teacher_batch: int = 16
    #: per-token advantage = rl_coef x the GRPO advantage + distill_coef x (teacher logprob - student logprob)
    #: of each sampled token; rl_coef 0 is distillation alone
    rl_coef: float = 0.0
    distill_coef: float = 1.0
    #: clip the distillation term of each token to [-distill_adv_clip, distill_adv_clip] (0: no clip)
    distill_adv_clip: float = 0.0

    def problems(self) -> list[str]:
        """Every problem of the teacher's keys (the GRPO keys are checked when the algorithm is built)."""
        out = []
        if not self.teacher_url.startswith(("http://", "https://")):
            out.append(f"algo.teacher_url must be an http(s) URL of the teacher, got {self.teacher_url!r}")
        if not self.teacher_timeout_s > 0:
            out.append(f"algo.teacher_timeout_s must be > 0, got {self.teacher_timeout_s}")
        if isinstance(self.teacher_retries, bool) or not isinstance(self.teacher_retries, int) \
                or self.teacher_retries < 1:
            out.append(f"algo.teacher_retries must be an int >= 1, got {self.teacher_retries!r}")
        if isinstance(self.teacher_batch, bool) or not isinstance(self.teacher_batch, int) \
                or not 1 <= self.teacher_batch <= 128:
            out.append(f"algo.teacher_batch must be an int in [1, 128], got {self.teacher_batch!r}")
        if self.rl_coef < 0 or self.distill_coef < 0 or self.rl_coef + self.distill_coef <= 0:
            out.append(f"algo.rl_coef and algo.distill_coef must be >= 0, not both 0 (got {self.rl_coef}, "
                       f"{self.distill_coef})")
        if self.distill_adv_clip < 0:
            out.append(f"algo.distill_adv_clip must be >= 0, got {self.distill_adv_clip}")
        return out
