"""``python -m swarmkit.plugins [--json]``: every registered component (needs the ``server`` extra)."""

import sys

from swarmkit.errors import missing_server_extra

try:
    from swarmkit.plugins.table import main
except ModuleNotFoundError as exc:
    message = missing_server_extra(exc, "python -m swarmkit.plugins (the component registry)")
    if message is None:
        raise
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

sys.exit(main())
