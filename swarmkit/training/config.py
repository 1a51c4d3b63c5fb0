"""The config every engine built on the training core takes (group ``optim``).

An engine's own schema subclasses :class:`EngineConfig` and adds its keys
(``FSDPConfig``, ``DeepSpeedConfig``). The engine reads the typed object: these
defaults are the only ones.
"""

from dataclasses import dataclass, field


@dataclass
class EngineConfig:
    name: str = ""
    #: AdamW learning rate (the packaged option files set 3e-4, tuned for LoRA)
    lr: float = 1e-5
    #: learning rate of a step whose batch is all demonstrations (the supervised warm start;
    #: null = ``lr``): formats are learnt faster than RL stays stable
    sft_lr: float | None = None
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    grad_clip: float = 1.0
    warmup_steps: int = 0
    #: processes (torchrun --nproc_per_node); 1 trains inside the server process, more start a
    #: torchrun group that the server drives (swarmkit.training.group)
    nprocs: int = 1
    #: with nprocs > 1: seconds for the group to start, and for one command (a step, a sync)
    group_start_timeout_s: float = 600.0
    group_step_timeout_s: float = 3600.0
    #: with nprocs > 1: torch threads per rank
    threads_per_rank: int = 1
    #: tokens per micro-batch (gradient accumulation over micro-batches); 0 = auto: 8192 on CUDA,
    #: 2048 on CPU (activations of SmolLM2-135M take about 1 MB per token in float32)
    token_budget: int = 0
    #: "auto" = bfloat16 on CUDA, float32 on CPU
    dtype: str = "auto"
    #: "auto" = cuda if available else cpu
    device: str = "auto"
    #: RNG seed of the engine (null = the run's seed)
    seed: int | None = None
    #: logits computed per chunk in the logprob kernel (bounds activation memory)
    logit_chunk_elements: int = 67108864
    #: keep a micro-batch's logits for backward when they fit in this many bytes (saves one
    #: matmul of the LM head); -1 = auto (a tenth of the GPU's memory on CUDA, 0 on CPU)
    keep_logits_bytes: int = -1
    #: torch.compile every decoder layer (fuses RMSNorm, rotary, SiLU gate, residuals):
    #: "auto" = on CUDA in one process, or true / false
    compile: str = "auto"
    #: torch.compile backend ("inductor"; "aot_eager" to debug)
    compile_backend: str = "inductor"
    #: recompute activations in backward (less memory, one more forward)
    activation_checkpointing: bool = False


#: ``optim.token_budget`` of 0 (auto), by device type
AUTO_TOKEN_BUDGET = {"cuda": 8192, "cpu": 2048}


def resolve_token_budget(value: int, device_type: str) -> int:
    """The micro-batch token budget: ``value``, or the device's auto budget for 0."""
    if int(value) < 0:
        raise ValueError(f"optim.token_budget must be >= 0 (0 = auto), got {value}")
    return int(value) or AUTO_TOKEN_BUDGET.get(device_type, AUTO_TOKEN_BUDGET["cuda"])
