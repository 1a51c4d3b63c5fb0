"""``python -m swarmkit``: see :mod:`swarmkit.apps.cli`."""

from swarmkit.apps.cli import main

if __name__ == "__main__":
    main()
