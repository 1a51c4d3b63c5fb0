"""``python -m swarmkit``: see :mod:`swarmkit.cli`."""

from swarmkit.cli import main

if __name__ == "__main__":
    main()
