"""The command line: ``python -m swarmkit [overrides...]``.

Hydra composes the packaged config (``swarmkit/conf``) with plugin search
paths; component groups are appended with their defaults, so both
``+backend=vllm`` (the design card's form) and ``backend=vllm`` select an
option. The config is validated against the registered schemas before
anything heavy is imported; then ``mode`` picks what runs.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

from swarmkit.errors import ConfigError, SwarmkitError
from swarmkit.registry import KINDS

#: group -> default option, appended when the command line does not choose one
DEFAULT_CHOICES: dict[str, str] = {
    "backend": "hf",
    "optim": "fsdp",
    "algo": "grpo",
    "match": "text",
    "batching": "c2",
    "model": "smollm2",
    "task": "arithmetic",
}
CONFIG_MODULE = "swarmkit.conf"
_GROUP_RE = re.compile(r"^(~|\+\+|\+)?(" + "|".join(DEFAULT_CHOICES) + r")=(.*)$")


def normalize_overrides(args: Sequence[str]) -> list[str]:
    """Rewrite group selections to appends and add the defaults not chosen.

    ``backend=vllm`` and ``+backend=vllm`` both become ``+backend=vllm``;
    every group not chosen gets ``+group=<default>``. Other arguments (Hydra
    flags, ``key=value`` overrides) pass through unchanged.
    """
    out: list[str] = []
    chosen: set[str] = set()
    for arg in args:
        m = _GROUP_RE.match(arg)
        if m and m.group(1) != "~":
            out.append(f"+{m.group(2)}={m.group(3)}")
            chosen.add(m.group(2))
        else:
            out.append(arg)
    for group, default in DEFAULT_CHOICES.items():
        if group not in chosen:
            out.append(f"+{group}={default}")
    return out


def _packaged_options(module: str, group: str) -> set[str]:
    try:
        folder = resources.files(module) / group
        return {p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")}
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
        return set()


def plugin_search_paths() -> list[str]:
    from swarmkit.plugins import get_hooks

    return get_hooks().config_search_paths()


def store_schema_options(search_paths: Sequence[str]) -> None:
    """Give every registered component without a YAML option one from its schema defaults."""
    from hydra.core.config_store import ConfigStore

    from hydra_plugins.swarmkit_launcher.subprocess_launcher import register_launcher_config
    from swarmkit.plugins import get_registry

    register_launcher_config()
    modules = [CONFIG_MODULE] + [p[len("pkg://") :].replace("/", ".") for p in search_paths if p.startswith("pkg://")]
    cs = ConfigStore.instance()
    for component in get_registry():
        if any(component.name in _packaged_options(m, component.kind) for m in modules):
            continue
        node: Any = OmegaConf.structured(component.schema) if component.schema else {"name": component.name}
        if component.schema is not None:
            node = OmegaConf.to_container(node)
            node["name"] = component.name
        cs.store(group=component.kind, name=component.name, node=node, provider=component.plugin)


def check_component_choices(args: Sequence[str]) -> None:
    """Fail early, with the installed options, when a component group names an unknown one.

    Sweeps (``backend=hf,vllm``) check every value.
    """
    from swarmkit.plugins import get_registry

    registry = get_registry()
    for arg in args:
        m = _GROUP_RE.match(arg)
        if not m or m.group(1) == "~" or m.group(2) not in KINDS:
            continue
        for name in m.group(3).split(","):
            registry.get(m.group(2), name.strip())


def hydra_argv(args: Sequence[str]) -> list[str]:
    """The argument list handed to Hydra: normalized overrides plus plugin search paths."""
    args = normalize_overrides(args)
    check_component_choices(args)
    paths = plugin_search_paths()
    store_schema_options(paths)
    if paths:
        args.append("hydra.searchpath=[" + ",".join(paths) + "]")
    return args


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose the config as the command line would (without running anything)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    args = hydra_argv(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=args)


def validated(cfg: DictConfig) -> DictConfig:
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    return validate_config(cfg, get_registry())


def _missing_engines(cfg: DictConfig) -> list[str]:
    """Selected components whose heavy dependency is not installed, with the extra to install."""
    from swarmkit.plugins import get_registry

    problems = []
    for kind in KINDS:
        component = get_registry().get(kind, str(cfg[kind].name))
        missing = component.missing_requirements()
        if missing:
            problems.append(f"{kind} '{component.name}' needs {', '.join(missing)}, which is not installed: "
                            f"{component.install_hint()}")
    return problems


def run_job(cfg: DictConfig) -> int:
    """Run what ``cfg.mode`` asks for; returns the exit status."""
    from swarmkit.runner import run

    return run(cfg)


def _hydra_entry(cfg: DictConfig) -> None:
    try:
        checked = validated(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    from hydra.core.hydra_config import HydraConfig

    if checked.mode == "local":
        missing = _missing_engines(checked)
        if missing:
            print("error: " + "; ".join(missing), file=sys.stderr)
            sys.exit(2)
    if checked.server.run_dir == "auto":
        checked.server.run_dir = HydraConfig.get().runtime.output_dir
    status = run_job(checked)
    if status:
        sys.exit(status)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``python -m swarmkit`` and the ``swarmkit`` script."""
    import hydra

    args = list(sys.argv[1:] if argv is None else argv)
    try:
        hargs = hydra_argv(args)
    except SwarmkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [sys.argv[0] if sys.argv else "swarmkit", *hargs]
    entry = hydra.main(config_path=f"pkg://{CONFIG_MODULE}", config_name="config", version_base="1.3")(_hydra_entry)
    entry()


__all__ = ["DEFAULT_CHOICES", "KINDS", "compose", "main", "normalize_overrides"]
