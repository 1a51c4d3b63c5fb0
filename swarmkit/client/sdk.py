"""The swarm client SDK: controller calls and the episode context manager.

Needs only ``httpx`` and the standard library (it never imports torch,
transformers or the server side of swarmkit), so it runs on any CPU box with
a light install (``pip install swarmkit``)::

    from swarmkit.client import SwarmClient

    client = SwarmClient("http://127.0.0.1:8000", token=ADMIN_TOKEN)
    client.configure(["model.path=builtin:tiny", "backend=hf"])
    client.start()
    client.wait_for_state("ROLLING", timeout=120)

    with client.episode(task_id="t1") as ep:
        llm = openai.OpenAI(base_url=ep.base_url, api_key=ep.api_key)
        ...  # run any agent
        ep.report(1.0)

:class:`AsyncSwarmClient` is the same API for asyncio code (``await
client.start()``, ``async with client.episode(...) as ep``, ``await
ep.report(1.0)``).

Requests are retried with exponential backoff on connection errors and on
"server busy" answers (503 with ``Retry-After``, e.g. while the server trains
in ``ROLLING_POST`` / ``WEIGHT_SYNCING``); every retry is logged at DEBUG on
the ``swarmkit.client`` logger (at INFO the first of its kind, then one a minute with a count)
and passed to the client's ``on_retry``
callback as a :class:`RetryEvent`; after ``retry_for`` seconds a
:class:`ServerUnavailable` says what the server last answered. A connection
that fails mid-request is retried for a GET and raised as :class:`TransportError`
for a call that changes state (it may have been done).

The code lives in :mod:`swarmkit.client.sync` (blocking),
:mod:`swarmkit.client.aio` (asyncio) and :mod:`swarmkit.client._common`
(what both share); this module gathers the public names.
"""

from __future__ import annotations

from swarmkit.client._common import (
           CLIENT_HEADER,
           RetryEvent,
           ServerUnavailable,
           SwarmAPIError,
           SwarmError,
           TransportError,
)
from swarmkit.client.aio import AsyncEpisode, AsyncSwarmClient
from swarmkit.client.multi import (
           AsyncSwarmEpisode,
           SwarmEpisode,
           async_swarm_episode,
           swarm_episode,
)
from swarmkit.client.sync import Episode, SwarmClient

__all__ = ["CLIENT_HEADER", "AsyncEpisode", "AsyncSwarmClient", "AsyncSwarmEpisode", "Episode", "RetryEvent", "ServerUnavailable",
           "SwarmAPIError", "SwarmClient", "SwarmEpisode", "SwarmError", "TransportError", "async_swarm_episode",
           "swarm_episode"]
