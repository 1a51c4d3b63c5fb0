"""Light client SDK (httpx only; never imports torch).

``from swarmkit.client import SwarmClient, AsyncSwarmClient`` — see :mod:`swarmkit.client.sdk`.
"""

from swarmkit.client.sdk import (
    AsyncEpisode,
    AsyncSwarmClient,
    AsyncSwarmEpisode,
    Episode,
    RetryEvent,
    ServerUnavailable,
    SwarmAPIError,
    SwarmClient,
    SwarmEpisode,
    SwarmError,
    TransportError,
    async_swarm_episode,
    swarm_episode,
)

__all__ = ["AsyncEpisode", "AsyncSwarmClient", "AsyncSwarmEpisode", "Episode", "RetryEvent", "ServerUnavailable", "SwarmAPIError",
           "SwarmClient", "SwarmEpisode", "SwarmError", "TransportError", "async_swarm_episode", "swarm_episode"]
