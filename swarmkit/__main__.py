"""``python -m swarmkit``: see :mod:`swarmkit.apps.cli` (needs ``pip install 'swarmkit[server]'``).

On a light install (``pip install swarmkit``: the client SDK only) ``--help`` still prints the modes
and commands and which extra each needs, the light commands (``status``, ``skills``, ``new-task``)
run, and anything else says which extra to install instead of showing an ImportError.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from swarmkit.apps.usage import LIGHT_COMMANDS, light_help, run_command
from swarmkit.errors import exit_for_missing_server_extra, missing_server_extra


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m swarmkit`` and the ``swarmkit`` script.

    Ctrl-C is how a server, a monitor or a main job is stopped: each shuts down in its own handlers,
    then this prints ``interrupted`` and exits 130 (the shell's code for SIGINT) instead of a traceback.
    """
    try:
        _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


def _main(args: list[str]) -> None:
    if args and args[0] in LIGHT_COMMANDS:  # they need httpx at most: no Hydra, no torch
        sys.exit(run_command(LIGHT_COMMANDS[args[0]], args[1:]))
    try:
        from swarmkit.apps.cli import main as cli_main

        cli_main(args)
    except ModuleNotFoundError as exc:
        if args[:1] in (["--help"], ["-h"]) and missing_server_extra(exc) is not None:
            print(light_help((exc.name or "").split(".")[0]))
            sys.exit(0)
        exit_for_missing_server_extra(exc, "python -m swarmkit (the server, training and the main job)")


if __name__ == "__main__":
    main()
