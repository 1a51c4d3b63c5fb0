"""What ``python -m swarmkit --help`` says, and the commands that run on the base install.

Light on purpose (the standard library only): the base install (``pip install swarmkit``, the client
SDK) prints this help and runs :data:`LIGHT_COMMANDS` without the ``server`` extra; the full install
prints it as the header of Hydra's help (``conf/config.yaml``), followed by the config groups.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence

USAGE = """\
swarmkit: swarm reinforcement learning for LLM agents.

usage: python -m swarmkit [KEY=VALUE ...]        a Hydra job: mode=local (default), server, client, plan
       python -m swarmkit COMMAND [ARGS ...]    (COMMAND --help for its options)

Modes (need the server extra: pip install 'swarmkit[server]'):
  python -m swarmkit                       the main job: a local swarm (server + task client) that trains
  python -m swarmkit mode=server           a swarm server; given training overrides (model=tiny optim.lr=1e-3 ...)
                                           it configures itself and starts, given only server.* it waits OFFLINE
                                           for SwarmClient(url, token=...).configure([...]) and .start()
  python -m swarmkit mode=client           the built-in task client against server.host:server.port
  python -m swarmkit mode=plan             print the validated configuration and exit
  python -m swarmkit +backend=vllm +algo=grpo   choose components (group=option or +group=option)
  python -m swarmkit --multirun optim.lr=1e-4,3e-4   sweeps, each job in a fresh process
  python -m swarmkit launcher=ray ray.servers=2   the main job's servers and clients as Ray actors (swarmkit[ray])
  (optim=<name>_defaults, model=defaults, task=defaults: the schema defaults an option extends)

Commands:
  status [RUN_DIR] [--url URL] [--watch]   a server's live status (the base install; --watch's panel uses rich)
                                           token: RUN_DIR/admin_token, --token-file, --token or $SWARMKIT_ADMIN_TOKEN
  skills [list|show|copy|path]             the skills for coding agents (the base install)
  new-task NAME                            write a swarm client package (the base install; it runs with openai)
  monitor RUN_DIR [--port 8780]            the dashboard of a finished or crashed run (swarmkit[server])
  research ...                             automated research campaigns (swarmkit[research])
  join --spec FILE                         another host's node of a multi-host training group (swarmkit[server])
  python -m swarmkit.plugins               every installed component (swarmkit[server])

A server prints its URL, its dashboard (URL/dashboard), and where its admin token is:
server.admin_token, else $SWARMKIT_ADMIN_TOKEN, else the file RUN_DIR/admin_token (0600) it writes.

Environment variables:
  SWARMKIT_ADMIN_TOKEN       the admin token (control routes, the dashboard, /metrics)
  SWARMKIT_CLIENT_TOKEN      a token every episode and client route requires (server.client_token)
  SWARMKIT_BLOCK_PLUGINS     plugin names not to load, comma-separated
  SWARMKIT_DISABLE_PLUGIN_AUTOLOAD=1   load the built-in plugins only
  SWARMKIT_CACHE             model cache (builtin:tiny), default ~/.cache/swarmkit
  SWARMKIT_CLIENT_KEYS       where clients keep the keys of their client ids
  SWARMKIT_TORCH_THREADS     torch threads of a server process
  SWARMKIT_COMPILE_LOGPROB=0 no torch.compile of the log-prob kernel (CUDA)
"""

#: ``python -m swarmkit NAME``: the commands the base install runs (module:function, each parses its arguments)
LIGHT_COMMANDS = {
    "status": "swarmkit.apps.monitor:status_main",
    "skills": "swarmkit.apps.skills:main",
    "new-task": "swarmkit.apps.new_task:main",
}


def run_command(target: str, args: Sequence[str]) -> int:
    """Run ``module:function`` with ``args``; the exit status. ``| head`` closing the pipe is not an error."""
    module, _, name = target.partition(":")
    try:
        return int(getattr(importlib.import_module(module), name)(list(args)) or 0)
    except BrokenPipeError:  # no traceback at exit either
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def light_help(missing: str) -> str:
    """The help of a light install: :data:`USAGE` and what is missing."""
    return (f"{USAGE}\nThis is the base install (the client SDK; module {missing!r} of the server extra is not "
            "installed): the modes, monitor, research and join need pip install 'swarmkit[server]'.")
