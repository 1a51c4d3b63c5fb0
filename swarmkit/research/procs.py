"""Process helpers of long-running jobs, shared by the research executor and swarmkit's multirun
launcher (``hydra_plugins.swarmkit_launcher``): children that die with their parent. (JSON records a
kill never leaves half-written: :mod:`swarmkit.runfiles`.)"""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launching process dies (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
