"""The command line: ``python -m swarmkit [overrides...]``.

Hydra composes the packaged config (:mod:`swarmkit.config.compose`); the
overrides are checked first and every problem is reported at once; then
``mode`` picks what runs (:mod:`swarmkit.apps.runner`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from swarmkit.apps.runner import run
from swarmkit.apps.usage import LIGHT_COMMANDS, USAGE, run_command
from swarmkit.config.compose import (
    CONFIG_MODULE,
    compose_checked,
    hydra_argv,
    missing_engines,
    override_value,
    server_training_overrides,
    validated,
)
from swarmkit.errors import ConfigError, SwarmkitError


def make_private(run_dir: Path, hydra_subdir: str | None, secrets: Sequence[str]) -> None:
    """The run folder 0700 and what this process writes 0600 from now on (umask 077); the tokens
    given on the command line replaced by ``***`` in Hydra's record of the run (``.hydra/*.yaml``)."""
    os.umask(0o077)
    if run_dir.is_dir():
        os.chmod(run_dir, 0o700)
    folder = run_dir / hydra_subdir if hydra_subdir else None
    if folder is None or not folder.is_dir():
        return
    for path in folder.glob("*.yaml"):
        text = path.read_text()
        for secret in secrets:
            text = text.replace(secret, "***")
        path.write_text(text)
        os.chmod(path, 0o600)


#: the training overrides of this process's ``mode=server`` command line (set by :func:`main`): a server
#: given some configures itself from the composed config and starts; one given none waits OFFLINE
_SERVER_TRAINING: list[str] = []

#: modes that run something in a run folder (the others print, or talk to a server elsewhere)
RUN_MODES = ("local", "server")


def hydra_output_overrides(cfg: DictConfig, args: Sequence[str]) -> list[str]:
    """Where Hydra puts its own output (``.hydra/``, ``cli.log``): in the run folder, or nowhere.

    A run (``mode=local``, ``mode=server``) with ``server.run_dir=auto`` runs in Hydra's run dir
    (``runs/<date>``); one given a ``server.run_dir`` gets Hydra's output there. ``mode=plan`` and
    ``mode=client`` run nothing here: no folder, no log file (the console only). A ``hydra.run.dir``,
    ``hydra.output_subdir`` or ``hydra/job_logging`` on the command line is left as given.
    """
    if any(a.lstrip("+~").startswith(("hydra.run.dir=", "hydra.output_subdir=", "hydra/job_logging=",
                                       "hydra.job_logging")) for a in args):
        return []
    if cfg.mode in RUN_MODES:
        run_dir = str(cfg.server.run_dir)
        return [] if run_dir == "auto" else [f"hydra.run.dir={override_value(run_dir)}"]
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "~hydra.job_logging.handlers.file",
            "hydra.job_logging.root.handlers=[console]"]


def _sweeps(args: Sequence[str]) -> list[str]:
    """The overrides that list several values (``optim.lr=1e-4,3e-4``), which only ``--multirun`` runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    found = []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            if parser.parse_overrides([arg])[0].is_sweep_override():
                found.append(arg)
        except Exception:  # noqa: BLE001 - a grammar error: compose_checked reports it
            continue
    return found


def quiet_progress_bars() -> None:
    """Turn transformers' progress bars off (\"Loading weights\" at every model load, \"Writing model shards\"
    at every checkpoint): in a log or a pipe each is a line of carriage returns, and the server logs what
    it loaded and saved. ``hydra.verbose=true`` keeps them."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # a backend without transformers
        return
    hf_logging.disable_progress_bar()


def _hydra_entry(cfg: DictConfig) -> None:
    try:
        checked = validated(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from hydra.core.hydra_config import HydraConfig

    configure_server = checked.mode == "server" and bool(_SERVER_TRAINING)
    if checked.mode == "local" or configure_server:
        missing = missing_engines(checked)
        if missing:
            print("error: " + "; ".join(missing), file=sys.stderr)
            sys.exit(2)
    hc = HydraConfig.get()
    if checked.mode in RUN_MODES and checked.server.run_dir == "auto":
        checked.server.run_dir = hc.runtime.output_dir
    if checked.mode in RUN_MODES or hc.output_subdir is not None:  # never the working directory of plan/client
        make_private(Path(hc.runtime.output_dir), hc.output_subdir,
                     [t for t in (checked.server.admin_token, checked.server.client_token) if t])
    if checked.mode in RUN_MODES and not hc.verbose:
        quiet_progress_bars()
    status = run(checked, server_overrides=_SERVER_TRAINING if configure_server else ())
    if status:
        sys.exit(status)


#: ``python -m swarmkit NAME ...``: the commands that are not a Hydra job (``module:function``, each parses its
#: own arguments); the light ones run on the base install too (:mod:`swarmkit.apps.usage`)
SUBCOMMANDS: dict[str, str] = {
    **LIGHT_COMMANDS, "monitor": "swarmkit.apps.monitor:monitor_main", "research": "swarmkit.research.cli:main",
    "join": "swarmkit.apps.join:main",
}


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m swarmkit`` and the ``swarmkit`` script."""
    import hydra

    from hydra_plugins.swarmkit_launcher.subprocess_launcher import register_launcher

    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in SUBCOMMANDS:  # the commands that are not a Hydra job
        sys.exit(run_command(SUBCOMMANDS[args[0]], args[1:]))
    # the help's header (conf/config.yaml: ${swarmkit_usage:}); "$" escaped for Hydra's help template
    OmegaConf.register_new_resolver("swarmkit_usage", lambda: USAGE.replace("$", "$$"), replace=True)
    try:
        hargs = hydra_argv(args)
        if not any(a in ("--help", "-h", "--hydra-help", "--info", "-i") or a.startswith(("--cfg", "-c"))
                   for a in args):
            multirun = any(a in ("--multirun", "-m") for a in args)
            sweeps = [] if multirun else _sweeps(args)
            if sweeps:
                raise ConfigError([f"{a}: several values sweep, which needs --multirun (a list: key=[a,b]; "
                                   "a string with commas: key='a,b')" for a in sweeps])
            checked = compose_checked(args)  # every problem of the overrides at once, before Hydra runs
            if not multirun:
                hargs += hydra_output_overrides(checked, args)
                if checked.mode == "server":
                    _SERVER_TRAINING[:] = server_training_overrides(args)
    except SwarmkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    register_launcher()  # --multirun's launcher, also where Hydra's plugin scan misses it (editable installs)
    sys.argv = [sys.argv[0] if sys.argv else "swarmkit", *hargs]
    entry = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")(_hydra_entry)
    entry()


__all__ = ["main"]
