"""``python -m swarmkit``: see :mod:`swarmkit.apps.cli` (needs ``pip install 'swarmkit[server]'``).

On a light install (``pip install swarmkit``: the client SDK only) it says
which extra to install instead of showing an ImportError.
"""

from __future__ import annotations

from collections.abc import Sequence

from swarmkit.errors import exit_for_missing_server_extra


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m swarmkit`` and the ``swarmkit`` script."""
    try:
        from swarmkit.apps.cli import main as cli_main

        cli_main(argv)
    except ModuleNotFoundError as exc:
        exit_for_missing_server_extra(exc, "python -m swarmkit (the server, training and the main job)")


if __name__ == "__main__":
    main()
