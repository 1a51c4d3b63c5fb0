"""The batching-policy contract: when the sample pool trains and on which episodes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def scalar_reward(reward: float | Mapping[str, float]) -> float:
    """The one float a reward counts as: the number itself, or the mean over roles of a
    role -> number dict (an empty dict: 0.0). Batching policies see this float; the
    trainer uses it for a timeline whose role has no reward of its own."""
    if isinstance(reward, Mapping):
        return float(sum(reward.values()) / len(reward)) if reward else 0.0
    return float(reward)


@dataclass
class PoolEpisode:
    """What a batching policy sees of one accepted training episode."""

    episode_id: str
    task_id: str
    reward: float
    client_id: str = ""
    task_family: str = ""
    policy_version: int = 0
    accepted_at: float = 0.0
    #: the LoRA adapter it trains (``model.adapters``; "" = the one model): a batch holds one adapter's
    adapter: str = ""


@dataclass
class ClientState:
    """What a batching policy sees of one client."""

    client_id: str
    last_seen: float
    ready: bool = False


@dataclass
class Decision:
    """A policy's verdict on the pool.

    ``fill`` is progress towards the trigger (``current``/``target`` in the
    policy's own unit, e.g. complete tasks) for the status API.
    ``selected`` are the episode ids that form the batch when ``fire`` is true.
    """

    fire: bool
    current: float
    target: float
    unit: str
    selected: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)


class BatchingPolicy(ABC):
    """Decides when the pool trains and which episodes form the batch.

    Built as ``cls(**config)`` from the ``batching`` config group (at least
    ``batch_size`` B and ``rollouts_per_task`` N; the other keys are kept in
    ``options``).

    ``active_window_s`` is the one definition of an *active* client: one that
    sent anything within that many seconds. The server's client tracker takes
    the selected policy's value (``batching.active_window_s`` when the group has
    it), and :meth:`decide` gets every known client to judge with it.
    """

    active_window_s: float = 60.0

    def __init__(self, batch_size: int, rollouts_per_task: int, *, active_window_s: float | None = None,
                 **options: Any):
        self.batch_size = batch_size
        self.rollouts_per_task = rollouts_per_task
        self.options = options
        if active_window_s is not None:
            self.active_window_s = float(active_window_s)

    @abstractmethod
    def decide(
        self, episodes: Sequence[PoolEpisode], clients: Mapping[str, ClientState], now: float
    ) -> Decision:
        """Look at the untrained episodes (oldest first) and the known clients (``last_seen``, ``ready``)."""
