"""Composing a run's configuration: Hydra over the packaged ``conf/`` plus plugins' options.

The command line (:mod:`swarmkit.apps.cli`) and the controller API
(``POST /api/v1/admin/configure``) compose through here, so both accept the
same overrides and report every problem at once (:func:`compose_checked`,
:func:`config_from_request`). Component groups are appended with their
defaults, so both ``+backend=vllm`` (the design card's form) and
``backend=vllm`` select an option.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf

from swarmkit.config.schema import ModelConfig, SubprocessLauncherConfig, SwarmkitConfig, TaskConfig
from swarmkit.config.validate import validate_config
from swarmkit.errors import ConfigError, UnknownComponentError
from swarmkit.plugins import get_hooks, get_registry
from swarmkit.plugins.registry import KINDS

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
#: the packaged primary config and its groups (the top-level ``conf/`` folder, installed as ``swarmkit.conf``)
CONFIG_MODULE = "swarmkit.conf"
_GROUP_RE = re.compile(r"^(~|\+\+|\+)?(" + "|".join(DEFAULT_CHOICES) + r")=(.*)$")
#: free-form mappings: a key under them may be new, so ``k=v`` there is sent as ``++k=v`` (add or set)
FREE_FORM_PREFIXES = ("task.options.", "batching.cocktail.")


def normalize_overrides(args: Sequence[str]) -> list[str]:
    """Rewrite group selections to appends and add the defaults not chosen.

    ``backend=vllm`` and ``+backend=vllm`` both become ``+backend=vllm``;
    every group not chosen gets ``+group=<default>``; a key under a free-form
    mapping (``task.options.agent=...``) becomes ``++`` (Hydra would ask for
    ``+``). Other arguments (Hydra flags, ``key=value`` overrides) pass through.
    """
    out: list[str] = []
    chosen: set[str] = set()
    for arg in args:
        m = _GROUP_RE.match(arg)
        if m and m.group(1) != "~":
            out.append(f"+{m.group(2)}={m.group(3)}")
            chosen.add(m.group(2))
        elif arg.startswith(FREE_FORM_PREFIXES) and "=" in arg:
            out.append("++" + arg)
        else:
            out.append(arg)
    for group, default in DEFAULT_CHOICES.items():
        if group not in chosen:
            out.append(f"+{group}={default}")
    return out


def _packaged_options(module: str, group: str) -> set[str]:
    """The YAML options ``module`` ships for ``group`` (file names without ``.yaml``)."""
    try:
        folder = resources.files(module) / group
        return {p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml")}
    except (ModuleNotFoundError, FileNotFoundError, NotADirectoryError, TypeError):
        return set()


def plugin_search_paths() -> list[str]:
    return get_hooks().config_search_paths()


#: the core's own groups with YAML options, and the schema their options extend
CORE_GROUPS: dict[str, type] = {"model": ModelConfig, "task": TaskConfig}


def _defaults_node(schema: type, name: str | None = None) -> dict[str, Any]:
    node: dict[str, Any] = OmegaConf.to_container(OmegaConf.structured(schema))  # type: ignore[assignment]
    if name is not None:
        node["name"] = name
    return node


def defaults_option(kind: str, name: str) -> str:
    """The stored option holding the schema defaults that a packaged YAML option extends."""
    return "defaults" if kind in CORE_GROUPS else f"{name}_defaults"


def store_schema_options(search_paths: Sequence[str]) -> None:
    """Put every schema's defaults where Hydra finds them, so no YAML repeats a default.

    - ``swarmkit_base``: the defaults of the core groups ``server``, ``trainer``
      and ``ray`` (and ``mode``, ``launcher``, ``seed``, ``logger``), which ``conf/config.yaml`` extends.
    - ``model/defaults``, ``task/defaults`` and ``<kind>/<name>_defaults`` for a
      component that ships a YAML option: the schema defaults that the YAML
      extends (``defaults: [fsdp_defaults, _self_]``), so it sets only what differs.
    - ``<kind>/<name>``: a registered component without a YAML option gets one
      made of its schema defaults.
    - ``hydra/launcher/swarmkit_subprocess``: the multirun launcher's settings
      (:class:`~swarmkit.config.schema.SubprocessLauncherConfig`), which
      ``conf/config.yaml`` selects; the launcher class itself is registered by
      the command line (:mod:`swarmkit.apps.cli`), which runs it.
    """
    from hydra.core.config_store import ConfigStore

    modules = [CONFIG_MODULE] + [p[len("pkg://") :].replace("/", ".") for p in search_paths if p.startswith("pkg://")]
    cs = ConfigStore.instance()
    cs.store(group="hydra/launcher", name="swarmkit_subprocess", node=SubprocessLauncherConfig, provider="swarmkit")
    base = _defaults_node(SwarmkitConfig)
    cs.store(name="swarmkit_base", node={k: base[k] for k in ("mode", "launcher", "seed", "server", "trainer", "ray",
                                                             "logger")})
    for group, schema in CORE_GROUPS.items():
        cs.store(group=group, name=defaults_option(group, ""), node=_defaults_node(schema))
    for component in get_registry():
        node = _defaults_node(component.schema, component.name) if component.schema else {"name": component.name}
        if any(component.name in _packaged_options(m, component.kind) for m in modules):
            cs.store(group=component.kind, name=defaults_option(component.kind, component.name), node=node,
                     provider=component.plugin)
        else:
            cs.store(group=component.kind, name=component.name, node=node, provider=component.plugin)


def check_component_choices(args: Sequence[str]) -> None:
    """Fail early, with the installed options, when a component group names an unknown one.

    Sweeps (``backend=hf,vllm``) check every value.
    """
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


def compose(overrides: Sequence[str] = (), *, sweeps: Sequence[str] = ()) -> DictConfig:
    """Compose the config as the command line would (without running anything).

    :param sweeps: group selections of a sweep (``model=tiny,smollm2``), checked too (each value an option).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    args = hydra_argv(overrides)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
        check_group_options([*args, *sweeps], GlobalHydra.instance().config_loader().get_group_options)
        try:
            return hydra_compose(config_name="config", overrides=args)
        except (HydraException, OmegaConfBaseException) as exc:  # what no check above foresaw: one clean line
            options = getattr(exc, "options", None)  # Hydra's MissingConfigException lists the group's options
            raise ConfigError([_first_line(exc) + (f"; options: {', '.join(options)}" if options else "")]) from None


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def check_group_options(args: Sequence[str], group_options: Any) -> None:
    """Fail, with the options there are, when ``model=`` or ``task=`` (the core's YAML groups) names an
    unknown one, in the one form :func:`check_component_choices` uses for component groups; a sweep
    (``model=tiny,smollm2``) checks every value.

    :param group_options: ``(group, overrides=...) -> option names`` (Hydra's config loader's
        ``get_group_options``: the packaged options, a plugin's search path, the config store).
    """
    for arg in args:
        m = _GROUP_RE.match(arg)
        if not m or m.group(1) == "~" or m.group(2) not in CORE_GROUPS:
            continue
        group = m.group(2)
        options = [o for o in group_options(group, overrides=list(args)) if o != "defaults"]
        for name in (n.strip() for n in m.group(3).split(",")):
            if name not in options and name != "defaults":
                extra = " (or model.path=/a/local/hf/model/folder)" if group == "model" else ""
                raise UnknownComponentError(f"unknown {group} '{name}'; {group} options: "
                                            f"{', '.join(sorted(options))}{extra}")


def validated(cfg: DictConfig) -> DictConfig:
    """The typed config, or :class:`ConfigError` listing every problem."""
    return validate_config(cfg, get_registry())


def missing_engines(cfg: DictConfig) -> list[str]:
    """Selected components whose heavy dependency is not installed, with the extra to install."""
    problems = []
    for kind in KINDS:
        component = get_registry().get(kind, str(cfg[kind].name))
        missing = component.missing_requirements()
        if missing:
            problems.append(f"{kind} '{component.name}' needs {', '.join(missing)}, which is not installed: "
                            f"{component.install_hint()}")
    return problems


# --------------------------------------------------------------------------- every problem at once
def _split(overrides: Sequence[str]) -> tuple[list[str], list[Any]]:
    """Group selections (composed by Hydra) and key overrides (applied after, then validated)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    selections: list[str] = []
    keys: list[Any] = []
    for arg in overrides:
        m = _GROUP_RE.match(arg)
        if m:  # a sweep over options is checked by check_component_choices; compose its first
            selections.append(f"{m.group(1) or ''}{m.group(2)}={m.group(3).split(',')[0].strip()}")
            continue
        if arg.startswith(("hydra.", "-")):
            continue  # Hydra's own settings and flags
        if arg.lstrip("+~").startswith("hydra/"):  # Hydra's own groups: composed, so a typo there is caught too
            selections.append(arg)
            continue
        try:
            parsed = OverridesParser.create().parse_overrides([arg])
        except Exception as exc:  # noqa: BLE001 - Hydra's grammar errors
            raise ConfigError([f"{arg}: not a valid override: {exc}"]) from None
        keys.extend(parsed)
    return selections, keys


def compose_checked(overrides: Sequence[str] = ()) -> DictConfig:
    """The validated config of command-line style ``overrides``, every problem reported at once.

    Group selections are composed by Hydra; ``key=value`` overrides are applied
    afterwards (a sweep ``a=1,2`` is checked value by value) and the result is
    validated against the schemas, so a misspelt key is reported with the known
    keys instead of Hydra's first "Could not override" error.

    :raises ConfigError: every problem (unknown keys, wrong types, unknown components).
    """
    selections, keys = _split(overrides)
    base = compose(selections, sweeps=[o for o in overrides if _GROUP_RE.match(o) and "," in o])
    base = OmegaConf.create(OmegaConf.to_container(base, resolve=False))
    base.pop("hydra", None)
    sweeps = [o for o in keys if o.is_sweep_override()]
    rounds = max([len(list(o.sweep_iterator())) for o in sweeps] or [1])
    problems: list[str] = []
    result: DictConfig | None = None
    for r in range(rounds):
        cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=False))
        OmegaConf.set_struct(cfg, False)
        for o in keys:
            if o.is_delete():
                OmegaConf.update(cfg, o.key_or_group, None, merge=False)
                continue
            if o.is_sweep_override():
                values = list(o.sweep_iterator())
                value = values[min(r, len(values) - 1)]
            else:
                value = o.value()
            OmegaConf.update(cfg, o.key_or_group, value, merge=True, force_add=True)
        try:
            checked = validate_config(cfg, get_registry())
        except ConfigError as exc:
            problems.extend(p for p in exc.problems if p not in problems)
            continue
        result = result or checked
    if problems or result is None:
        raise ConfigError(problems)
    return result


#: what ``mode=server`` cannot apply from its command line, and where it belongs instead
NOT_FOR_A_SERVER = {
    "task": "a server runs no tasks: give the task to its clients (mode=client task=..., or the main job)",
    "launcher": "the main job's launcher (mode=local): a server is one process",
    "ray": "the main job's Ray settings (mode=local launcher=ray): a server is one process",
}
#: the first key of the overrides a server applies to itself whether configured or not (its process settings)
SERVER_PROCESS_GROUPS = ("mode", "server", "hydra")


def override_group(arg: str) -> str | None:
    """The top-level key or group an override sets (``optim`` of ``+optim.lr=1``, ``hydra`` of
    ``hydra/launcher=x``); None for a flag (``--multirun``)."""
    if arg.startswith("-"):
        return None
    key = arg.lstrip("~+").split("=", 1)[0]
    return re.split(r"[./]", key, maxsplit=1)[0] or None


def server_training_overrides(args: Sequence[str]) -> list[str]:
    """The training overrides of a ``mode=server`` command line: what such a server configures itself
    from (and then starts), as the admin API's configure would; none = a bare server, configured over the
    admin API. ``server.*``, ``mode`` and Hydra's own settings are not training overrides.

    :raises ConfigError: the overrides a server cannot apply (the task client's and the main job's
        settings), each with where it belongs.
    """
    problems = [f"{arg}: {NOT_FOR_A_SERVER[g]}" for arg in args
                if (g := override_group(arg)) in NOT_FOR_A_SERVER]
    if problems:
        problems[-1] += (" (mode=server applies model, backend, optim, algo, match, batching, trainer, seed, "
                         "logger and server.* overrides)")
        raise ConfigError(problems)
    return [arg for arg in args if (g := override_group(arg)) is not None and g not in SERVER_PROCESS_GROUPS]

#: ``server`` keys that always stay those of the running process
PROCESS_KEYS = ("host", "port", "run_dir", "admin_token")


def request_form(body: dict[str, Any]) -> str:
    """Which form a configure request uses (``config``, ``overrides`` or ``yaml``).

    :raises ValueError: ``(message, field)`` args: not exactly one form, or a form of the wrong type.
    """
    given = [k for k in ("config", "overrides", "yaml") if body.get(k) is not None]
    if len(given) != 1:
        raise ValueError("send exactly one of 'config' (an object), 'overrides' (a list of strings) or "
                         "'yaml' (text)", "config")
    form = given[0]
    if form == "overrides" and not (isinstance(body[form], list) and all(isinstance(o, str) for o in body[form])):
        raise ValueError("'overrides' must be a list of strings like \"model.path=builtin:tiny\"", "overrides")
    if form == "yaml" and not isinstance(body[form], str):
        raise ValueError("'yaml' must be the text of a YAML document", "yaml")
    return form


def config_from_request(body: dict[str, Any], server_cfg: dict[str, Any]) -> DictConfig:
    """The validated training config a controller's configure request describes (blocking: runs Hydra).

    ``body`` holds exactly one of ``config`` (a mapping, laid over the packaged
    defaults; a group given by name selects that option first), ``overrides``
    (command-line style, checked like the command line) or ``yaml`` (text, like
    ``config``). ``server.host/port/run_dir/admin_token`` stay those of
    ``server_cfg``. A key not given has its schema default, as on the command line
    (``trainer.total_steps``: :class:`~swarmkit.config.schema.TrainerConfig`'s; 0 trains until stopped).

    :raises ConfigError: every problem of the config, or what is wrong with the request.
    """
    given = request_form(body)
    if given == "overrides":
        overrides = [*body["overrides"], "mode=server",
                     *(f"server.{k}={override_value(server_cfg[k])}" for k in PROCESS_KEYS if k in server_cfg)]
        return compose_checked(overrides)
    if given == "yaml":
        user = OmegaConf.to_container(OmegaConf.create(body["yaml"]), resolve=False)
    else:
        user = body["config"]
    if not isinstance(user, dict):
        raise ConfigError(["the config must be a mapping"])
    user = dict(user)
    user.pop("hydra", None)
    selects = []
    for kind in (*KINDS, "model", "task"):
        node = user.get(kind)
        if isinstance(node, str):
            selects.append(f"{kind}={node}")
            user.pop(kind)
        elif isinstance(node, dict) and kind in KINDS and node.get("name"):
            selects.append(f"{kind}={node['name']}")
    base = OmegaConf.create(OmegaConf.to_container(compose(selects), resolve=False))
    base.pop("hydra", None)
    cfg = OmegaConf.merge(base, OmegaConf.create(user))
    cfg.mode = "server"
    if "server" in cfg:
        for key in PROCESS_KEYS:
            if key in server_cfg:
                cfg.server[key] = server_cfg[key]
    return validate_config(cfg, get_registry())


def override_value(value: Any) -> str:
    """A value as a Hydra override value (``null`` for None, quoted strings)."""
    if value is None:
        return "null"
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)
