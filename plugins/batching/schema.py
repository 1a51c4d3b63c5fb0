"""Config schema shared by the built-in batching policies (group ``batching``)."""

from dataclasses import dataclass, field


@dataclass
class BatchingConfig:
    name: str = "c2"
    #: B: tasks (C2/C3) or groups of N episodes (C1) per batch
    batch_size: int = 4
    #: N: rollouts per task
    rollouts_per_task: int = 4
    #: a client is active while it sent anything within this many seconds (C4/C5)
    active_window_s: float = 60.0
    #: optional cap of each task family's share of a batch, e.g. {"math": 0.5}
    cocktail: dict[str, float] = field(default_factory=dict)
