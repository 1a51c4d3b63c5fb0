"""Light client SDK (httpx only; never imports torch).

``from swarmkit.client import SwarmClient`` — see :mod:`swarmkit.client.sdk`.
"""

from swarmkit.client.sdk import Episode, ServerUnavailable, SwarmAPIError, SwarmClient, SwarmError

__all__ = ["Episode", "ServerUnavailable", "SwarmAPIError", "SwarmClient", "SwarmError"]
