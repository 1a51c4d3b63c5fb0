"""Batching policies C1-C5 (``c1`` ... ``c5``)."""

from swarmkit import hookimpl
from swarmkit_plugins.batching.schema import BatchingConfig

_POLICIES = {
    "c1": ("EpisodeCount", "C1: at least B*N completed episodes"),
    "c2": ("TaskCount", "C2: at least B tasks with at least N episodes each"),
    "c3": ("NonDegenerateTaskCount", "C3: like C2, counting tasks whose rewards differ (DAPO)"),
    "c4": ("AllClientsReady", "C4: every active client signalled ready"),
    "c5": ("AnyClientReady", "C5: any active client signalled ready"),
}


@hookimpl
def register_batching_policies(register):
    for name, (cls, description) in _POLICIES.items():
        register(
            name,
            f"swarmkit_plugins.batching.policies:{cls}",
            schema=BatchingConfig,
            description=description,
        )
