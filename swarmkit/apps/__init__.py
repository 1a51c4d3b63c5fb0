"""What you run: the command line, the main job, a served server, the built-in task client.

- :mod:`.cli` and :mod:`.runner`: ``python -m swarmkit`` and its modes.
- :mod:`.wiring`: the composition root (server + training cycle + trainer).
- :mod:`.serve`: a server in the foreground or in a thread.
- :mod:`.local`: the main job (``mode=local``).
- :mod:`.task_client`: the built-in swarm client for the tasks of :mod:`swarmkit.tasks`
  (httpx only: ``python -m swarmkit.apps.task_client`` runs on a laptop).
"""
