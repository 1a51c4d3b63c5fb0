"""Processes and ports: the small helpers that launchers, the server and the config checks share.

Children that die with their parent (the research executor, the multirun
launcher in ``hydra_plugins``), whether a port is free (the local and Ray
launchers, torch's rendezvous), whether a host is this machine's loopback (the
config checks, the episode routes, ``join``), a process tree's peak memory (the
multi-server benchmarks and examples). They sit at the bottom of the
layers so that a launcher plugin needs no upper package for them. Pure
standard library.
"""

from __future__ import annotations

import contextlib
import ipaddress
import signal
import socket
import sys
from pathlib import Path

__all__ = ["die_with_parent", "free_port", "is_loopback", "peak_rss_bytes", "port_free"]


def die_with_parent() -> None:
    """In the child before exec (``preexec_fn``): SIGKILL when the launching process dies (Linux;
    elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` (IPv4 or IPv6) now."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) names this machine's loopback interface."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def peak_rss_bytes(pid: int) -> int:
    """Peak resident set of ``pid`` and its live children, summed (``VmHWM`` from /proc; Linux), 0 if
    unreadable (another system, or the process is gone)."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            pids += [int(c) for c in (task / "children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return total
