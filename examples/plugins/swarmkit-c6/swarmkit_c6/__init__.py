"""Batching policy ``c6``: train once the oldest untrained episode waited ``max_wait_s``.

A worked example of a third-party swarmkit plugin: one module, one entry point,
a config schema, and a config group option shipped on Hydra's search path.
Select it with ``python -m swarmkit batching=c6 batching.max_wait_s=30``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from swarmkit import hookimpl


@dataclass
class C6Config:
    name: str = "c6"
    batch_size: int = 4
    rollouts_per_task: int = 4
    active_window_s: float = 60.0
    cocktail: dict[str, float] = field(default_factory=dict)
    #: fire when the oldest untrained episode is at least this old...
    max_wait_s: float = 30.0
    #: ...and at least this many episodes are waiting
    min_episodes: int = 1


@hookimpl
def register_batching_policies(register):
    register(
        "c6",
        "swarmkit_c6.policy:OldestWaited",
        schema=C6Config,
        description="C6 (example plugin): oldest sample waited max_wait_s",
    )


@hookimpl
def config_search_paths():
    return ["pkg://swarmkit_c6.conf"]
