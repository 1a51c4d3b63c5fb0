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
from swarmkit.config.lr import lr_problem
from swarmkit.config.schema import (
    COLLAPSE_ACTIONS,
    LAUNCHERS,
    MODES,
    PLACEMENT_STRATEGIES,
    REPLICA_KEYS,
    TRAINER_MODES,
    ModelConfig,
    ReplicaConfig,
    SwarmkitConfig,
)
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


def _check_replicas(replica: DictConfig, backend: DictConfig | None, problems: list[str]) -> None:
    """``backend.replicas`` >= 1; devices, when listed, one per replica and only for a backend with ``device``."""
    n = int(replica.replicas)
    if n < 1:
        problems.append(f"backend.replicas: must be >= 1, got {n}")
    devices = list(replica.replica_devices)
    if devices and len(devices) != n:
        problems.append(f"backend.replica_devices: {len(devices)} device(s) listed for backend.replicas={n}")
    if devices and backend is not None and "device" not in backend:
        problems.append(f"backend.replica_devices: backend '{backend.get('name')}' has no 'device' option "
                        "to place replicas with")
    if not float(replica.replica_sync_timeout_s) > 0:
        problems.append(f"backend.replica_sync_timeout_s: must be > 0, got {replica.replica_sync_timeout_s}")


def _check_ray(ray: DictConfig, problems: list[str]) -> None:
    """``ray``: counts and resources in range, one override set per server, a known placement strategy."""
    if int(ray.servers) < 1:
        problems.append(f"ray.servers: must be >= 1, got {ray.servers}")
    if int(ray.clients) < 0:
        problems.append(f"ray.clients: must be >= 0, got {ray.clients}")
    if len(ray.server_overrides) not in (0, int(ray.servers)):
        problems.append(f"ray.server_overrides: {len(ray.server_overrides)} override set(s) for "
                        f"ray.servers={ray.servers} (give one per server, or none)")
    for key in ("server_cpus", "client_cpus"):  # a Ray bundle needs some resource
        if not float(ray[key]) > 0:
            problems.append(f"ray.{key}: must be > 0, got {ray[key]}")
    for key in ("server_gpus", "rank_cpus", "rank_gpus"):
        if float(ray[key]) < 0:
            problems.append(f"ray.{key}: must be >= 0, got {ray[key]}")
    if ray.placement_strategy not in PLACEMENT_STRATEGIES:
        problems.append(f"ray.placement_strategy: '{ray.placement_strategy}' is not one of "
                        f"{', '.join(PLACEMENT_STRATEGIES)}")


#: what several adapters on one server run on in this first version (docs/multi_model.md, "Limits")
ADAPTER_BACKENDS = ("hf", "vllm")
ADAPTER_OPTIMS = ("fsdp",)


def _check_adapters(result: dict[str, Any], registry: Registry, problems: list[str]) -> None:
    """``model.adapters``: the names, each adapter's ``batching`` keys (laid over the ``batching`` group and
    checked by its policy's schema), and the combinations this version refuses (each with why)."""
    model = result.get("model")
    if model is None:
        return
    try:
        specs = ModelConfig.of(model).adapter_specs()
    except ValueError as exc:
        problems.append(str(exc))
        return
    if not specs:
        return
    shared = result.get("batching")
    for spec in specs:
        if spec.batching and shared is not None:
            adapter_batching(OmegaConf.to_container(shared, resolve=True), spec, registry, problems)  # type: ignore[arg-type]
    later = "not supported with model.adapters yet (docs/multi_model.md, \"Limits\")"
    backend = result.get("backend")
    if backend is not None and str(backend.name) not in ADAPTER_BACKENDS:
        problems.append(f"backend={backend.name}: serving several adapters is {later}; use backend=hf or vllm")
    if backend is not None and str(backend.name) == "vllm" and backend.get("enable_lora") is False:
        problems.append("backend.enable_lora=false: vllm serves model.adapters as run-time LoRA adapters; "
                        "leave it unset")
    if backend is not None and "replicas" in backend and int(backend["replicas"]) > 1:
        problems.append(f"backend.replicas={backend.replicas}: inference replicas are {later}")
    optim = result.get("optim")
    if optim is not None:
        if str(optim.name) not in ADAPTER_OPTIMS:
            problems.append(f"optim={optim.name}: training several adapters is {later}; use optim=fsdp")
        for key in ("nprocs", "nnodes"):  # the fsdp schema's launch keys (another engine is refused above)
            if key in optim and int(optim[key]) > 1:
                problems.append(f"optim.{key}={optim[key]}: a training group of several processes is {later}")
    if str(result.get("_mode", "")) == "local":
        problems.append("mode=local runs one task client for one model; with model.adapters run mode=server and a "
                        "client per adapter (python -m swarmkit.apps.task_client --adapter NAME, docs/multi_model.md)")
    trainer = result.get("trainer")
    if trainer is not None and str(trainer.mode) != "sync":
        problems.append(f"trainer.mode={trainer.mode}: asynchronous training is {later}; use trainer.mode=sync")


def adapter_batching(shared: dict[str, Any], spec: Any, registry: Registry,
                     problems: list[str] | None = None) -> dict[str, Any] | None:
    """The batching config of adapter ``spec`` (an ``AdapterSpec``): its ``batching`` keys over ``shared``
    (the ``batching`` group's), checked by the schema of the policy it names. Problems go to ``problems``
    (then None is returned); without a list they raise :class:`ConfigError`."""
    found: list[str] = []
    merged = {**shared, **spec.batching}
    where = f"model.adapters[{spec.name}].batching"
    try:
        component = registry.get("batching", str(merged.get("name")))
    except UnknownComponentError as exc:
        found.append(f"{where}: {exc}")
        component = None
    checked = None
    if component is not None and component.schema is not None:
        checked = _check_node(component.schema, OmegaConf.create({k: v for k, v in merged.items() if k != "name"}),
                              where, found)
        if checked is not None and callable(getattr(component.schema, "problems", None)):
            found.extend(f"{where}: {p}" for p in component.schema(**OmegaConf.to_container(checked)).problems())
    if problems is not None:
        problems.extend(found)
    elif found:
        raise ConfigError(found)
    if found or checked is None:
        return None
    return {"name": merged["name"], **OmegaConf.to_container(checked, resolve=True)}  # type: ignore[dict-item]


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
        if f.name in ("mode", "seed", "launcher"):
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
    launcher = cfg.get("launcher", "local")
    if launcher not in LAUNCHERS:
        problems.append(f"launcher: '{launcher}' is not one of {', '.join(LAUNCHERS)}")
    if result.get("ray") is not None:
        _check_ray(result["ray"], problems)
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
        replica_node = None
        if kind == "backend" and any(k in node for k in REPLICA_KEYS):
            replica_node = OmegaConf.create({k: node[k] for k in REPLICA_KEYS if k in node})
            node = OmegaConf.create({k: node[k] for k in node if k not in REPLICA_KEYS})
        if kind == "optim" and "lr" in node and (why := lr_problem("lr", node.get("lr"))):
            problems.append(why)  # a number > 0 or "auto", whatever the engine's schema (checked also when
            node = OmegaConf.create({k: node[k] for k in node if k != "lr"})  # another key is wrong)
        checked = _check_node(component.schema, node, kind, problems)
        if checked is not None and callable(getattr(component.schema, "problems", None)):
            # the schema checks its keys as a whole (EngineConfig: the multi-node launch keys)
            problems.extend(component.schema(**OmegaConf.to_container(checked, resolve=True)).problems())
        if replica_node is not None:
            replica = _check_node(ReplicaConfig, replica_node, kind, problems)
            if replica is not None:
                _check_replicas(replica, checked, problems)
                if checked is not None:  # a plain node: the plugin's schema does not know the core's keys
                    checked = OmegaConf.create({**OmegaConf.to_container(checked), **OmegaConf.to_container(replica)})
        if checked is not None:
            result[kind] = checked
    model = result.get("model")
    if model is not None:
        try:
            resolve_chat_template(str(model.chat_template), str(model.path))
        except ValueError as exc:
            problems.append(str(exc))
    _check_adapters({**result, "_mode": cfg.get("mode", "local")}, registry, problems)
    trainer = result.get("trainer")
    if trainer is not None:
        if trainer.mode not in TRAINER_MODES:
            problems.append(f"trainer.mode: '{trainer.mode}' is not one of {', '.join(TRAINER_MODES)}")
        if trainer.max_staleness < 0:
            problems.append(f"trainer.max_staleness: must be >= 0, got {trainer.max_staleness}")
        collapse = trainer.collapse
        if collapse.action not in COLLAPSE_ACTIONS:
            problems.append(f"trainer.collapse.action: '{collapse.action}' is not one of {', '.join(COLLAPSE_ACTIONS)}")
        if collapse.patience < 1:
            problems.append(f"trainer.collapse.patience: must be >= 1, got {collapse.patience}")
        if not 0 < collapse.lr_factor <= 1:
            problems.append(f"trainer.collapse.lr_factor: must be in (0, 1], got {collapse.lr_factor}")
        if not 0 <= collapse.entropy_warm_factor <= 1:
            problems.append("trainer.collapse.entropy_warm_factor: must be in [0, 1], got "
                            f"{collapse.entropy_warm_factor}")
    optim = result.get("optim")
    if optim is not None:
        sft = optim.get("sft_lr")
        if sft is not None and not float(sft) > 0:
            problems.append(f"optim.sft_lr: must be > 0, got {sft}")
    if problems:
        raise ConfigError(problems)
    out = OmegaConf.create({"mode": mode, "launcher": launcher, "seed": seed})
    for key, value in result.items():
        out[key] = value
    return out


def to_dict(cfg: DictConfig) -> dict[str, Any]:
    """Plain dict of a validated config (for JSON, the server API, hooks)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
