"""Config schema of the ``fsdp`` optimizer engine (group ``optim``)."""

from dataclasses import dataclass

from swarmkit.training.config import EngineConfig


@dataclass
class FSDPConfig(EngineConfig):
    name: str = "fsdp"
    #: one process on CUDA: "auto" = bf16 compute copy with fp32 master weights
    #: and fp32 gradient accumulation; "autocast" = fp32 params under bf16 autocast
    mixed_precision: str = "auto"
    #: hosts in the training group (torchrun --nnodes); > 1 forms the group through torch's c10d
    #: rendezvous and each other host joins with ``python -m swarmkit join --spec RUN_DIR/group_join.json``
    nnodes: int = 1
    #: with nnodes > 1 (required): HOST:PORT of the c10d rendezvous store, which this server's host
    #: runs; HOST is an address of this host that the other nodes reach
    rdzv_endpoint: str = ""
    #: with nnodes > 1: rendezvous id; "" = a fresh random one each time the group starts
    rdzv_id: str = ""
    #: with nnodes > 1: address the server's command listener binds, and that rank 0 (on any node)
    #: connects to; 127.0.0.1 keeps it local (every node on this host): set an address of this host
    #: on a private network to span hosts
    group_host: str = "127.0.0.1"
    #: with nnodes > 1: port of that listener (0 = an ephemeral one; fix it to open it in a firewall)
    group_port: int = 0
