"""``python -m swarmkit.plugins [--json]``: every registered component (needs the ``server`` extra)."""

import sys

from swarmkit.errors import exit_for_missing_server_extra

try:
    from swarmkit.plugins.table import main
except ModuleNotFoundError as exc:
    exit_for_missing_server_extra(exc, "python -m swarmkit.plugins (the component registry)")

sys.exit(main())
