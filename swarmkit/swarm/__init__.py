"""The swarm server's core, without HTTP.

- :mod:`.server`: :class:`~swarmkit.swarm.server.SwarmServer` (life cycle, inference calls, status)
  and the :class:`~swarmkit.swarm.server.Cycle` it hands accepted episodes to.
- :mod:`.cycle`: the training cycle (journal, batching policy, trainer).
- :mod:`.state`, :mod:`.auth`, :mod:`.episodes`, :mod:`.presence`, :mod:`.metrics`:
  the state machine, the admin token, episodes and their keys, which clients are
  alive, per-step metrics.
"""
