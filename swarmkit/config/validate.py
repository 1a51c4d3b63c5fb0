"""Validate a composed configuration before anything heavy is loaded.

Every problem is collected and reported at once (unknown keys, wrong types,
unknown component names with the installed choices), in one
:class:`~swarmkit.errors.ConfigError`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from swarmkit.chat_templates import resolve_chat_template
from swarmkit.config.schema import MODES, TRAINER_MODES, SwarmkitConfig
from swarmkit.errors import ConfigError, UnknownComponentError
from swarmkit.plugins.loader import get_hooks
from swarmkit.plugins.registry import KINDS, Registry


def _check_node(schema: type, node: Any, where: str, problems: list[str]) -> DictConfig | None:
    """Merge ``node`` onto the schema; record unknown keys and type errors under ``where``."""
    base = OmegaConf.structured(schema)
    if node is None:
        return base
    if not isinstance(node, DictConfig):
        problems.append(f"{where}: expected a mapping, got {type(node).__name__}")
        return None
    known = {f.name for f in dataclasses.fields(schema)}
    ok = True
    for key in node:
        if key not in known:
            problems.append(f"{where}.{key}: unknown key (known keys: {', '.join(sorted(known))})")
            ok = False
    for key in node:
        if key not in known:
            continue
        try:
            OmegaConf.merge(base, {key: node[key]})
        except OmegaConfBaseException as exc:
            msg = str(exc).splitlines()[0]
            problems.append(f"{where}.{key}: {msg}")
            ok = False
    if not ok:
        return None
    return OmegaConf.merge(base, node)


def _check_loggers(node: Any, problems: list[str]) -> list[str]:
    """``logger``: a list of registered logger names whose packages are installed."""
    if node is None:
        return ["tensorboard"]
    names = list(node) if isinstance(node, ListConfig | list | tuple) else None
    if names is None or not all(isinstance(n, str) for n in names):
        problems.append(f"logger: expected a list of logger names, e.g. logger=[tensorboard,wandb]; got {node!r}")
        return []
    known = get_hooks().loggers()
    for name in names:
        info = known.get(name)
        if info is None:
            problems.append(f"logger: unknown logger '{name}'; installed loggers: {', '.join(sorted(known)) or 'none'}")
        elif (why := info.missing()) is not None:
            problems.append(f"logger: {why}")
    return [str(n) for n in names]


def validate_config(cfg: DictConfig | dict, registry: Registry) -> DictConfig:
    """Return the typed, validated config, or raise ConfigError listing every problem.

    :param cfg: the composed config (Hydra's, or a dict sent to a server).
    :param registry: the loaded component registry (names and schemas).
    """
    if isinstance(cfg, dict):
        cfg = OmegaConf.create(cfg)
    problems: list[str] = []
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    top_known = {f.name for f in dataclasses.fields(SwarmkitConfig)}
    for key in cfg:
        if key not in top_known:
            problems.append(f"{key}: unknown key (known keys: {', '.join(sorted(top_known))})")
    result: dict[str, Any] = {}
    for f in dataclasses.fields(SwarmkitConfig):
        if f.name in KINDS:
            continue
        node = cfg.get(f.name)
        if f.name == "mode" or f.name == "seed":
            continue
        if f.name == "logger":
            result["logger"] = _check_loggers(node, problems)
            continue
        checked = _check_node(f.default_factory().__class__, node, f.name, problems)  # type: ignore[misc]
        if checked is not None:
            result[f.name] = checked
    mode = cfg.get("mode", "local")
    if mode not in MODES:
        problems.append(f"mode: '{mode}' is not one of {', '.join(MODES)}")
    seed = cfg.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        problems.append(f"seed: expected an int, got {seed!r}")
    for kind in KINDS:
        node = cfg.get(kind)
        if node is None:
            problems.append(f"{kind}: missing; choose one of {', '.join(registry.names(kind))}")
            continue
        if isinstance(node, str):
            node = OmegaConf.create({"name": node})
        name = node.get("name") if isinstance(node, DictConfig) else None
        if name is None:
            problems.append(f"{kind}.name: missing; choose one of {', '.join(registry.names(kind))}")
            continue
        try:
            component = registry.get(kind, str(name))
        except UnknownComponentError as exc:
            problems.append(str(exc))
            continue
        if component.schema is None:
            extra = [k for k in node if k != "name"]
            if extra:
                problems.append(f"{kind}.{extra[0]}: unknown key ({kind} '{name}' takes no options)")
            result[kind] = OmegaConf.create({"name": str(name)})
            continue
        checked = _check_node(component.schema, node, kind, problems)
        if checked is not None:
            result[kind] = checked
    model = result.get("model")
    if model is not None:
        try:
            resolve_chat_template(str(model.get("chat_template", "auto")), str(model.get("path", "")))
        except ValueError as exc:
            problems.append(str(exc))
    trainer = result.get("trainer")
    if trainer is not None:
        if trainer.mode not in TRAINER_MODES:
            problems.append(f"trainer.mode: '{trainer.mode}' is not one of {', '.join(TRAINER_MODES)}")
        if trainer.max_staleness < 0:
            problems.append(f"trainer.max_staleness: must be >= 0, got {trainer.max_staleness}")
    optim = result.get("optim")
    if optim is not None:
        for key in ("lr", "sft_lr"):
            value = optim.get(key)
            if value is not None and not float(value) > 0:
                problems.append(f"optim.{key}: must be > 0, got {value}")
    if problems:
        raise ConfigError(problems)
    out = OmegaConf.create({"mode": mode, "seed": seed})
    for key, value in result.items():
        out[key] = value
    return out


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain dict of a validated config (for JSON, the server API, hooks)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
