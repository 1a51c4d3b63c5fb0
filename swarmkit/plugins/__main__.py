"""``python -m swarmkit.plugins [--json]``: every registered component."""

import sys

from swarmkit.plugins.table import main

sys.exit(main())
