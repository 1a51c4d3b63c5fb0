"""Watching runs from outside: ``python -m swarmkit monitor RUN_DIR`` and ``python -m swarmkit status``.

``monitor`` serves the dashboard of a run folder (finished, crashed or still
running elsewhere), read-only, from its ``metrics.jsonl``, ``states.jsonl`` and
``journal.sqlite``. ``status`` prints a server's status once, or, with
``--watch``, as a live view in a terminal (plain lines when piped).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from swarmkit.config.schema import ServerConfig
from swarmkit.swarm.auth import ADMIN_TOKEN_FILE, ENV_ADMIN_TOKEN

#: a server's default port (the schema's: dataclasses and the standard library, so ``status`` stays light)
SERVER_PORT = ServerConfig.port
#: the monitor's default port, apart from a server's (a monitor next to a running server)
MONITOR_PORT = 8780


def monitor_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarmkit monitor",
        description="Serve the dashboard of a run folder (finished, crashed or running elsewhere), read-only, "
                    "from its metrics.jsonl, states.jsonl and journal.sqlite.")
    parser.add_argument("run_dir", help="the run folder (server.run_dir of the run)")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=MONITOR_PORT,
                        help=f"port (0: any free one; default {MONITOR_PORT}, apart from a server's {SERVER_PORT})")
    parser.add_argument("--model", default=None,
                        help="model folder (or builtin:NAME) whose tokenizer splits tokens; default: the model "
                             "named in the run's newest checkpoint")
    args = parser.parse_args(list(argv))
    from swarmkit.server.app import create_monitor_app
    from swarmkit.server.dashboard.source import RunDirSource
    from swarmkit.server.run import serve_app

    token, where = _monitor_token(Path(args.run_dir))
    try:
        source = RunDirSource(args.run_dir, token, model_path=args.model)
    except (FileNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    if source.decoder() is None:  # load the tokenizer now, not on the first page
        print("  (no tokenizer for per-token text: pass --model; episodes show whole blocks)", flush=True)

    def announce(url: str) -> None:
        print(f"dashboard of {args.run_dir}: {url}/dashboard", flush=True)
        print(f"  log in with the admin token {where}", flush=True)

    return serve_app(create_monitor_app(source), args.host, args.port, announce)


def _monitor_token(run_dir: Path) -> tuple[str, str]:
    """The token that guards a monitor: $SWARMKIT_ADMIN_TOKEN, else the run's own token file, else a
    fresh one written to a new private file (never printed)."""
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env:
        return env, f"from ${ENV_ADMIN_TOKEN}"
    own = run_dir / ADMIN_TOKEN_FILE
    try:
        text = own.read_text().strip()
    except OSError:
        text = ""
    if text:
        return text, f"in {own}"
    token = secrets.token_urlsafe(32)
    fd, path = tempfile.mkstemp(prefix="swarmkit-monitor-", suffix=".token")
    os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
    os.write(fd, (token + "\n").encode())
    os.close(fd)
    return token, f"in {path} (made for this monitor)"


# --------------------------------------------------------------------------- status
def status_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m swarmkit status",
        description="Print a swarm server's status; --watch keeps a live view (a terminal) or prints a line "
                    "per refresh (a pipe).")
    parser.add_argument("run_dir", nargs="?", default=None,
                        help="a server's run folder: its URL (RUN_DIR/server.json) and admin token "
                             "(RUN_DIR/admin_token) come from there")
    parser.add_argument("--url", default=None,
                        help=f"the server (default: RUN_DIR's server, else http://127.0.0.1:{SERVER_PORT}, a "
                             "server's default)")
    parser.add_argument("--token", default=None, help=f"the admin token itself (default: ${ENV_ADMIN_TOKEN}, "
                                                      "else RUN_DIR/admin_token)")
    parser.add_argument("--token-file", default=None, help="a file holding the admin token (e.g. RUN_DIR/admin_token)")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    parser.add_argument("--json", action="store_true", help="print the raw status JSON once")
    args = parser.parse_args(list(argv))
    try:
        url, token = _status_target(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from swarmkit.client import ServerUnavailable, SwarmClient, SwarmError

    with SwarmClient(url, token=token, retry_for=0) as client:
        try:
            if args.json:
                print(json.dumps(client.status(), indent=2))
                return 0
            if not args.watch:
                print(status_text(client.status()))
                return 0
            return _watch(client, max(0.2, args.interval))
        except SwarmError as exc:  # unreachable, a wrong token...: one line, not a traceback
            hint = (f" - is the server running? (a finished run's dashboard: python -m swarmkit monitor "
                    f"{args.run_dir or 'RUN_DIR'})" if isinstance(exc, ServerUnavailable) else "")
            print(f"error: {exc}{hint}", file=sys.stderr)
            return 1


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the admin token from {path}: {exc.strerror or exc}") from None
    if not token:
        raise ValueError(f"{path} is empty")
    return token


def _status_target(args: argparse.Namespace) -> tuple[str, str]:
    """The server's URL and admin token from ``--url``/``--token``/``--token-file``, ``$SWARMKIT_ADMIN_TOKEN``
    and a run folder (its ``server.json`` and ``admin_token``), in that order.

    :raises ValueError: no token anywhere, or one that cannot be read (the message says where to give it).
    """
    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is not None and not run_dir.is_dir():
        raise ValueError(f"{run_dir} is not a folder (give a server's run folder, or --url)")
    url = args.url
    if url is None and run_dir is not None:
        try:
            url = json.loads((run_dir / "server.json").read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError):
            url = None
    url = url or f"http://127.0.0.1:{SERVER_PORT}"
    if args.token and Path(args.token).is_file():
        raise ValueError(f"--token takes the token itself; {args.token} is a file: --token-file {args.token}")
    if args.token:
        return url, args.token
    if args.token_file:
        return url, _read_token(Path(args.token_file))
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env:
        return url, env
    if run_dir is not None:
        return url, _read_token(run_dir / ADMIN_TOKEN_FILE)
    raise ValueError(f"no admin token: give the server's run folder (python -m swarmkit status RUN_DIR reads "
                     f"RUN_DIR/{ADMIN_TOKEN_FILE}), --token-file FILE, --token TOKEN or ${ENV_ADMIN_TOKEN}")


def status_line(st: dict[str, Any]) -> str:
    """One line: state, step, policy version, pool fill, episodes, clients, the last step's reward."""
    pool = st.get("pool") or {}
    fill = pool.get("fill")
    fill_txt = f"{fill['current']:g}/{fill['target']:g} {fill['unit']}" if isinstance(fill, dict) else "-"
    eps = st.get("episodes") or {}
    last = pool.get("last_step") or {}
    reward = last.get("reward_mean")
    parts = [f"{st.get('state', '?'):<14}", f"step {st.get('global_step', 0):>4}", f"policy v{st.get('policy_version', 0)}",
             f"pool {fill_txt} ({pool.get('episodes', 0)} episodes)", f"running {eps.get('running', 0)}",
             f"finished {eps.get('finished', 0)}", f"aborted {eps.get('aborted', 0)}",
             f"clients {(st.get('clients') or {}).get('active', 0)}"]
    if isinstance(reward, int | float):
        parts.append(f"reward {reward:.3f}")
    adapters = pool.get("adapters") or {}
    if adapters:  # model.adapters: each adapter's step and its episodes waiting in the pool
        parts.append("adapters " + ", ".join(f"{n} s{a.get('step') or 0} w{a.get('waiting', 0)}"
                                             for n, a in adapters.items()))
    trainer = pool.get("trainer") or {}
    if trainer.get("mode") == "async":
        doing = "training in background" if trainer.get("training") else "trainer idle"
        parts.append(f"async η={trainer.get('max_staleness')}: {doing}, {trainer.get('ready_batches', 0)} batch(es) "
                     f"ready, {trainer.get('in_flight', 0)}/{trainer.get('capacity', 0)} in flight")
    return "  ".join(parts)


def status_text(st: dict[str, Any]) -> str:
    """The status as a few labelled lines (the non-watch answer)."""
    pool = st.get("pool") or {}
    last = pool.get("last_step") or {}
    lines = [status_line(st), f"model {st.get('model', '-')}  uptime {st.get('uptime_s', 0):.0f}s  "
             f"calls {st.get('calls', 0)}  tokens generated {st.get('tokens_generated', 0)}"]
    if last:
        lines.append("last step: " + "  ".join(f"{k} {last[k]:.4g}" for k in
                                              ("reward_mean", "loss", "samples", "cycle_time_s", "weight_sync_s")
                                              if isinstance(last.get(k), int | float)))
    for name, a in (pool.get("adapters") or {}).items():  # model.adapters: one line each
        reward = a.get("reward_mean")
        lines.append(f"adapter {name}: step {a.get('step') or 0}  policy v{a.get('policy_version') or 0}  "
                     f"waiting {a.get('waiting', 0)}  running {a.get('running', 0)}  last reward "
                     + (f"{reward:.3f}" if isinstance(reward, int | float) else "-"))
    replicas = st.get("replicas") or []
    if replicas:
        alive = sum(1 for r in replicas if r.get("alive"))
        lines.append(f"replicas {alive}/{len(replicas)} in rotation: " + ", ".join(
            f"#{r.get('index')} {r.get('device') or 'default'} "
            + (f"{r.get('in_flight', 0)} in flight, {r.get('episodes', 0)} episodes" if r.get("alive")
               else f"OUT ({r.get('error')})") for r in replicas))
    if st.get("training_finished"):  # the cycle's own sentence ("training finished: ...")
        lines.append(str(st["training_finished"]))
    if st.get("last_error"):
        lines.append(f"last error: {st['last_error']}")
    return "\n".join(lines)


def _watch(client: Any, interval: float) -> int:
    from swarmkit.client import SwarmError

    try:
        import rich  # noqa: F401 - the live panel; without it (the base install) a line per refresh
    except ImportError:
        rich = None
    if not sys.stdout.isatty() or rich is None:
        try:
            while True:
                try:
                    print(time.strftime("%H:%M:%S ") + status_line(client.status()), flush=True)
                except SwarmError as exc:
                    print(time.strftime("%H:%M:%S ") + f"unreachable: {exc}", flush=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0
    from rich.live import Live
    from rich.panel import Panel

    try:
        with Live(refresh_per_second=4, screen=False) as live:
            while True:
                try:
                    body = status_text(client.status())
                except SwarmError as exc:
                    body = f"unreachable: {exc}"
                live.update(Panel(body, title=f"swarmkit {client.url}  {time.strftime('%H:%M:%S')}"))
                time.sleep(interval)
    except KeyboardInterrupt:
        return 0
