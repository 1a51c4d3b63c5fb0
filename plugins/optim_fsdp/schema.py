"""Config schema of the ``fsdp`` optimizer engine (group ``optim``)."""

from dataclasses import dataclass

from swarmkit.training.config import EngineConfig


@dataclass
class FSDPConfig(EngineConfig):
    name: str = "fsdp"
    #: one process on CUDA: "auto" = bf16 compute copy with fp32 master weights
    #: and fp32 gradient accumulation; "autocast" = fp32 params under bf16 autocast
    mixed_precision: str = "auto"
