"""Process and file helpers of long-running jobs, shared by the research executor and swarmkit's
multirun launcher (``hydra_plugins.swarmkit_launcher``): children that die with their parent, and
JSON records a kill never leaves half-written."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launching process dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as strict JSON so that a reader (or a resume after a kill) sees the old file or the
    new one, never half of one (written beside, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str, allow_nan=False))
    os.replace(tmp, path)
