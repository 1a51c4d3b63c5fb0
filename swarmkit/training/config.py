"""The config every engine built on the training core takes (group ``optim``).

An engine's own schema subclasses :class:`EngineConfig` and adds its keys
(``FSDPConfig``, ``DeepSpeedConfig``). The engine reads the typed object: these
defaults are the only ones. That includes the launch keys of a training group
(``nprocs``, ``nnodes``, ``rdzv_*``, ``group_*``, ``threads_per_rank``): any
engine whose schema subclasses :class:`EngineConfig` can train in a torchrun
group, on one host or several, without declaring them; the core reads them
through :func:`launch_config` (a :class:`GroupLaunch`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from swarmkit.procs import is_loopback


@dataclass
class EngineConfig:
    name: str = ""
    #: AdamW learning rate, or "auto": the rate of the model's size and LoRA / full weights
    #: (the table: swarmkit.config.lr), resolved when the engine has loaded the model
    lr: float | int | str = "auto"
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

    def problems(self) -> list[str]:
        """What is wrong with these keys as a whole (validation reports it on every path)."""
        return check_group_launch(launch_config(self))
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


@dataclass(frozen=True)
class GroupLaunch:
    """How an engine's training group starts: the launch keys of its :class:`EngineConfig`, typed.

    No defaults here: :func:`launch_config` reads every field from an :class:`EngineConfig`
    (see its comments for what each key means).
    """

    nprocs: int
    nnodes: int
    rdzv_endpoint: str
    rdzv_id: str
    group_host: str
    group_port: int
    group_start_timeout_s: float
    group_step_timeout_s: float
    threads_per_rank: int

    @property
    def grouped(self) -> bool:
        """Whether the engine trains in a torchrun group of its own (``nprocs > 1`` or ``nnodes > 1``)."""
        return self.nprocs > 1 or self.nnodes > 1


#: the keys of :class:`EngineConfig` that :class:`GroupLaunch` carries
GROUP_LAUNCH_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(GroupLaunch))
#: the launch keys the group's launcher consumes: the ranks' own ``optim`` group goes without them
#: (each rank's engine sees ``nprocs``'s default meaning: "this rank"); ``threads_per_rank`` stays
LAUNCHER_ONLY_KEYS: tuple[str, ...] = tuple(k for k in GROUP_LAUNCH_KEYS if k != "threads_per_rank")


def launch_config(optim: EngineConfig | Mapping[str, Any]) -> GroupLaunch:
    """The :class:`GroupLaunch` of an ``optim`` group: read from its :class:`EngineConfig` (an engine
    schema's instance), or from a plain group through :class:`EngineConfig`, whose defaults fill the
    launch keys it leaves out (its other keys belong to the engine and are not read here)."""
    if not isinstance(optim, EngineConfig):
        optim = EngineConfig(**{k: optim[k] for k in GROUP_LAUNCH_KEYS if k in optim})
    return GroupLaunch(
        nprocs=int(optim.nprocs), nnodes=int(optim.nnodes), rdzv_endpoint=str(optim.rdzv_endpoint),
        rdzv_id=str(optim.rdzv_id), group_host=str(optim.group_host), group_port=int(optim.group_port),
        group_start_timeout_s=float(optim.group_start_timeout_s),
        group_step_timeout_s=float(optim.group_step_timeout_s), threads_per_rank=int(optim.threads_per_rank))


def check_group_launch(launch: GroupLaunch) -> list[str]:
    """Problems of the multi-node keys of a group (``nnodes``, ``rdzv_endpoint``, ``group_host``,
    ``group_port``); empty when they are consistent (always with ``nnodes == 1``)."""
    nnodes = launch.nnodes
    if nnodes < 1:
        return [f"optim.nnodes: must be >= 1, got {nnodes}"]
    if nnodes == 1:
        return []
    problems: list[str] = []
    endpoint = launch.rdzv_endpoint
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        problems.append(f"optim.rdzv_endpoint: optim.nnodes={nnodes} needs HOST:PORT of the c10d rendezvous, "
                        f"an address of this server's host that every node reaches, e.g. "
                        f"optim.rdzv_endpoint=10.0.0.1:29400 (got {endpoint!r})")
    group_host, group_port = launch.group_host, launch.group_port
    if group_host in ("", "0.0.0.0", "::", "*"):
        problems.append(f"optim.group_host: give an address of this host that the other nodes reach "
                        f"(rank 0 connects to it), not {group_host!r}")
    elif host and not is_loopback(host) and is_loopback(group_host):
        problems.append(f"optim.group_host: {group_host} is loopback, but the rendezvous {endpoint} is not: "
                        f"rank 0 may run on another host; set optim.group_host to this host's address there")
    if not 0 <= group_port < 65536:
        problems.append(f"optim.group_port: must be 0 (ephemeral) .. 65535, got {group_port}")
    return problems
