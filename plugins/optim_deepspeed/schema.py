"""Config schema of the ``deepspeed`` optimizer engine."""

from dataclasses import dataclass

from swarmkit.training.config import EngineConfig


@dataclass
class DeepSpeedConfig(EngineConfig):
    name: str = "deepspeed"
    #: ZeRO stage: 2 or 3
    zero_stage: int = 2
