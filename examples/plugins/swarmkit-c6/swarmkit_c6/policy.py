"""The C6 policy itself (imported only when selected)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from swarmkit.contract import BatchingPolicy, ClientState, Decision, PoolEpisode


class OldestWaited(BatchingPolicy):
    """Fire when the oldest untrained episode waited ``max_wait_s``; the batch is every waiting episode."""

    def decide(
        self, episodes: Sequence[PoolEpisode], clients: Mapping[str, ClientState], now: float
    ) -> Decision:
        max_wait = float(self.options.get("max_wait_s", 30.0))
        min_eps = int(self.options.get("min_episodes", 1))
        waited = now - min((e.accepted_at for e in episodes), default=now)
        fire = len(episodes) >= min_eps and waited >= max_wait
        return Decision(
            fire=fire,
            current=round(waited, 3),
            target=max_wait,
            unit="seconds waited",
            selected=[e.episode_id for e in episodes] if fire else [],
        )
