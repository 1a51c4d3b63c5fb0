"""``python -m swarmkit join --spec FILE``: run this host's node of a multi-host training group.

A server with ``optim.nnodes > 1`` writes a join spec (``RUN_DIR/group_join.json``,
mode 0600) when it starts its training group, and hosts the group's c10d
rendezvous at ``optim.rdzv_endpoint``. Copied to another host, the spec is all
that host needs: this command starts ``optim.nprocs`` ranks there with the
worker command the server's own node runs (:func:`swarmkit.training.group.group_command`),
the authkey in their environment, never on the command line. It waits for the
spec (a shared filesystem) and for the rendezvous to answer, streams the
node's output, and ends when the server closes the group.
"""

from __future__ import annotations

import argparse
import collections
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from swarmkit.procs import is_loopback
from swarmkit.training.group import GroupError, group_command, group_env, read_join_spec

#: exit status of a join that failed before or while the node ran
FAILED = 1


def _wait_for_spec(path: Path, wait_s: float) -> dict[str, Any]:
    """The spec at ``path``, polled for up to ``wait_s`` seconds while it does not exist."""
    end = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < end:
        time.sleep(0.5)
    if not path.exists() and wait_s > 0:
        raise GroupError(f"no join spec at {path} after waiting {wait_s:.0f} s: the server writes "
                         "RUN_DIR/group_join.json when it starts a group with optim.nnodes > 1; copy it to "
                         "this host (keep it private: it holds the group's authkey)")
    return read_join_spec(path)


def _wait_for_rendezvous(endpoint: str, wait_s: float) -> None:
    """Return once a TCP connection to ``endpoint`` succeeds; retried for ``wait_s`` seconds."""
    host, _, port = endpoint.rpartition(":")
    end = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            return
        except OSError as exc:
            if time.monotonic() >= end:
                raise GroupError(f"cannot reach the rendezvous at {endpoint} ({exc}) after {wait_s:.0f} s: is "
                                 "the server up with optim.nnodes > 1, and is that TCP port open from this "
                                 "host?") from None
            time.sleep(1.0)


def _diagnose(tail: str, spec: dict[str, Any], rc: int) -> str:
    """A clear message for a node whose torchrun failed, from the tail of its output."""
    ep, rid, nnodes = spec["rdzv_endpoint"], spec["rdzv_id"], spec["nnodes"]
    if "world size mismatch" in tail:
        return ("world size mismatch: the group formed with another number of ranks than "
                f"{nnodes} x {spec['nprocs']}; every node must join with the server's current spec")
    if "RendezvousTimeoutError" in tail:
        return (f"the rendezvous {ep} (rdzv_id {rid}) did not complete within {spec['start_timeout_s']:.0f} s: "
                f"not all {nnodes} nodes joined, or this spec is stale (a server writes a fresh spec, "
                "with a fresh rdzv_id and authkey, each time it starts its group)")
    if "RendezvousConnectionError" in tail or "RendezvousClosedError" in tail:
        return f"lost the rendezvous at {ep} (rdzv_id {rid}): did the server stop, or is a firewall in the way?"
    if "cannot reach the server's group listener" in tail:
        return (f"rank 0 runs on this host and cannot reach the server's group listener at {spec['serve']}: "
                "set optim.group_host (and optim.group_port) on the server to an address this host reaches")
    return f"this node's training processes failed (torchrun exit status {rc}); see its output above"


def main(args: list[str]) -> int:
    """Parse ``args`` (after ``join``), run this host's node until the group closes; the exit status."""
    ap = argparse.ArgumentParser(prog="python -m swarmkit join", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", required=True, type=Path,
                    help="the server's join spec (RUN_DIR/group_join.json), copied to this host")
    ap.add_argument("--wait", type=float, default=60.0,
                    help="seconds to wait for the spec file and for the rendezvous to answer (default 60)")
    ap.add_argument("--local-addr", default=None,
                    help="the address of this host the other nodes reach (default: 127.0.0.1 when the "
                         "rendezvous is on loopback, else this host's FQDN)")
    ap.add_argument("--model", default=None,
                    help="this host's copy of the model (a folder or hub id) when the server's model.path "
                         "does not resolve here")
    ns = ap.parse_args(args)
    try:
        spec = _wait_for_spec(ns.spec, ns.wait)
        if ns.model:
            spec["model"] = ns.model
            spec["model_cfg"] = {**spec["model_cfg"], "path": ns.model}
        _wait_for_rendezvous(str(spec["rdzv_endpoint"]), ns.wait)
    except GroupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    rdzv_host = str(spec["rdzv_endpoint"]).rpartition(":")[0]
    local_addr = ns.local_addr or ("127.0.0.1" if is_loopback(rdzv_host) else None)
    cmd = group_command(spec, host=False, local_addr=local_addr)
    print(f"swarmkit join: node of {spec['nnodes']} x {spec['nprocs']} {spec['engine']} rank(s), rendezvous "
          f"{spec['rdzv_endpoint']} (rdzv_id {spec['rdzv_id']})", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, env=group_env(str(spec["authkey"])), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")

    def forward(signum: int, _frame: FrameType | None) -> None:  # torchrun stops its ranks on SIGTERM
        if proc.poll() is None:
            proc.send_signal(signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGHUP)}
    tail: collections.deque[str] = collections.deque(maxlen=200)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line)
            sys.stderr.write(line)
        rc = proc.wait()
    except KeyboardInterrupt:  # torchrun got the SIGINT too (same terminal): let it stop its ranks
        rc = proc.wait()
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if rc != 0:
        print(f"error: {_diagnose(''.join(tail), spec, rc)}", file=sys.stderr)
        return FAILED
    print("swarmkit join: the training group closed", file=sys.stderr)
    return 0
