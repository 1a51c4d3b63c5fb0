"""Optimizer engine ``deepspeed``: DeepSpeed ZeRO stage 2/3 (extra ``swarmkit[deepspeed]``)."""

from swarmkit import hookimpl
from swarmkit_plugins.optim_deepspeed.schema import DeepSpeedConfig


@hookimpl
def register_optims(register):
    register(
        "deepspeed",
        "swarmkit_plugins.optim_deepspeed.engine:DeepSpeedEngine",
        schema=DeepSpeedConfig,
        requires=("deepspeed",),
        extra="deepspeed",
        description="DeepSpeed ZeRO-2/3; gloo on CPU, NCCL on GPUs",
    )
