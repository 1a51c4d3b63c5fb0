"""Optimizer engine ``fsdp``: PyTorch FSDP2 (``fully_shard``), 1..N processes via torchrun."""

from swarmkit import hookimpl
from swarmkit_plugins.optim_fsdp.schema import FSDPConfig


@hookimpl
def register_optims(register):
    register(
        "fsdp",
        "swarmkit_plugins.optim_fsdp.engine:FSDPEngine",
        schema=FSDPConfig,
        requires=("torch",),
        description="FSDP2 fully_shard; gloo on CPU, NCCL on GPUs",
    )
