"""What you run: the command line, the main job, a served server, the built-in task client.

- :mod:`.cli` and :mod:`.runner`: ``python -m swarmkit`` and its modes.
- :mod:`.wiring`: the composition root (server + training cycle + trainer).
- :mod:`.serve`: a server in the foreground or in a thread.
- :mod:`.main_job`: the main job's flow (boot, evaluate, warm start, train, evaluate, ``summary.json``),
  written once for its drivers:
- :mod:`.local`: ``mode=local``, the main job's server and client in this process.
- :mod:`.ray_launcher`: ``launcher=ray``, the main job's servers and clients as Ray actors.
- :mod:`.join`: ``python -m swarmkit join``, another host's node of a multi-node training group.
- :mod:`.skills` and :mod:`.new_task`: the coding-agent skills and the client scaffold.
- :mod:`.task_client`: the built-in swarm client for the tasks of :mod:`swarmkit.tasks`
  (httpx only: ``python -m swarmkit.apps.task_client`` runs on a laptop).
"""
