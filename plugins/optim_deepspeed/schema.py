"""Config schema of the ``deepspeed`` optimizer engine."""

from dataclasses import dataclass, field


@dataclass
class DeepSpeedConfig:
    name: str = "deepspeed"
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    warmup_steps: int = 0
    nprocs: int = 1
    token_budget: int = 8192
    dtype: str = "auto"
    #: "auto" = cuda if available else cpu
    device: str = "auto"
    #: RNG seed of the engine (null = the run's seed)
    seed: int | None = None
    #: logits computed per chunk in the logprob kernel (bounds activation memory)
    logit_chunk_elements: int = 67108864
    #: ZeRO stage: 2 or 3
    zero_stage: int = 2
