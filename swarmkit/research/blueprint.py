"""The experiment blueprint: what a leader hands to the workers for one configuration.

A stage of a campaign is a list of blueprints; each blueprint is one
configuration (``config overrides``) run once per seed. Blueprints are plain
YAML/JSON so that an LLM leader can write them; :func:`parse_blueprints`
checks every field and reports every problem at once, each naming its field
(``blueprints[1].seeds: ...``), so a malformed plan is rejected with a message
a person (or the LLM, on its retry) can act on.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from swarmkit.errors import SwarmkitError

#: the launch command of a blueprint unless it names its own (run with the research process's Python)
DEFAULT_COMMAND = ["python", "-m", "swarmkit"]
#: a blueprint's name: a folder name (stage folders hold one folder per blueprint)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: the metrics a blueprint may read: a path in summary.json, or ``train.<key>`` of metrics.jsonl
_METRIC_RE = re.compile(r"^(train\.)?[A-Za-z0-9_/.-]+$")
#: overrides the executor sets itself (a blueprint setting them would break the run layout)
_RESERVED = ("hydra.run.dir", "hydra.sweep.dir", "seed", "server.port", "mode")


class BlueprintError(SwarmkitError):
    """A blueprint or a plan that does not follow the schema (the message lists every problem)."""


@dataclass
class Blueprint:
    """One configuration of a stage, run once per seed.

    ``overrides`` are ``python -m swarmkit`` overrides (``key: value``);
    ``metric`` is what the analysis reads from each run: a dotted path in
    ``summary.json`` (``eval_after`` reads its ``mean``) or ``train.<key>`` (the
    mean of the last three training steps' ``<key>`` in ``metrics.jsonl``);
    ``budget_s`` is the time limit of one run (the watchdog kills it after);
    ``output`` is the run folders' parent, relative to the stage folder.
    """

    name: str
    objective: str
    hypothesis: str
    overrides: dict[str, Any]
    seeds: list[int] = field(default_factory=lambda: [0])
    metric: str = "eval_after"
    budget_s: float = 300.0
    command: list[str] = field(default_factory=lambda: list(DEFAULT_COMMAND))
    output: str = ""

    def __post_init__(self) -> None:
        if not self.output:
            self.output = self.name

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def override_args(self) -> list[str]:
        """The overrides as command-line arguments (``key=value``; lists as ``[a,b]``)."""
        return [f"{k}={format_value(v)}" for k, v in self.overrides.items()]


def format_value(value: Any) -> str:
    """A value as Hydra's override grammar reads it back (booleans lowercase, lists bracketed)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | tuple):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


#: field -> (required, a check returning an error text or None)
def _check_str(v: Any) -> str | None:
    return None if isinstance(v, str) and v.strip() else "expected a non-empty string"


def _check_name(v: Any) -> str | None:
    if not isinstance(v, str) or not _NAME_RE.match(v):
        return f"expected a folder name (letters, digits, '_', '.', '-'; at most 64), got {v!r}"
    return None


def _check_overrides(v: Any) -> str | None:
    if not isinstance(v, dict):
        return f"expected a mapping of config keys to values, got {type(v).__name__}"
    for key, val in v.items():
        if not isinstance(key, str) or not key or " " in key or "=" in key:
            return f"bad config key {key!r}"
        if key in _RESERVED or key.lstrip("+~") in _RESERVED:
            return f"{key!r} is set by the executor (one of {', '.join(_RESERVED)})"
        if isinstance(val, dict):
            return f"{key}: expected a scalar or a list, got a mapping"
    return None


def _check_seeds(v: Any) -> str | None:
    if not isinstance(v, list) or not v or not all(isinstance(s, int) and not isinstance(s, bool) for s in v):
        return f"expected a non-empty list of integers, got {v!r}"
    if len(set(v)) != len(v):
        return f"seeds repeat: {v!r}"
    return None


def _check_metric(v: Any) -> str | None:
    if not isinstance(v, str) or not _METRIC_RE.match(v):
        return f"expected a summary.json path (eval_after) or train.<key>, got {v!r}"
    return None


def _check_budget(v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        return f"expected a positive number of seconds, got {v!r}"
    return None


def _check_command(v: Any) -> str | None:
    if not isinstance(v, list) or not v or not all(isinstance(a, str) and a for a in v):
        return f"expected a non-empty list of strings (argv), got {v!r}"
    return None


def _check_output(v: Any) -> str | None:
    if not isinstance(v, str) or v.startswith("/") or ".." in v.split("/"):
        return f"expected a folder relative to the stage folder, got {v!r}"
    return None


_FIELDS: dict[str, tuple[bool, Any]] = {
    "name": (True, _check_name),
    "objective": (True, _check_str),
    "hypothesis": (True, _check_str),
    "overrides": (True, _check_overrides),
    "seeds": (False, _check_seeds),
    "metric": (False, _check_metric),
    "budget_s": (False, _check_budget),
    "command": (False, _check_command),
    "output": (False, _check_output),
}


def blueprint_problems(data: Any, where: str) -> list[str]:
    """Every problem of one blueprint given as a mapping, each prefixed with its field's path."""
    if not isinstance(data, dict):
        return [f"{where}: expected a mapping with the fields {', '.join(_FIELDS)}, got {type(data).__name__}"]
    problems = [f"{where}.{k}: unknown field (known: {', '.join(_FIELDS)})" for k in data if k not in _FIELDS]
    for key, (required, check) in _FIELDS.items():
        if key not in data:
            if required:
                problems.append(f"{where}.{key}: missing (required)")
            continue
        error = check(data[key])
        if error:
            problems.append(f"{where}.{key}: {error}")
    return problems


def parse_blueprints(items: Any, where: str = "blueprints") -> list[Blueprint]:
    """Typed blueprints from a list of mappings, or :class:`BlueprintError` listing every problem."""
    if not isinstance(items, list) or not items:
        raise BlueprintError(f"{where}: expected a non-empty list of blueprints, got {items!r}"[:300])
    problems: list[str] = []
    for i, item in enumerate(items):
        problems += blueprint_problems(item, f"{where}[{i}]")
    names = [item.get("name") for item in items if isinstance(item, dict)]
    dupes = sorted({str(n) for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"{where}: blueprint names repeat: {', '.join(dupes)}")
    if problems:
        raise BlueprintError(f"{len(problems)} problem(s) in the plan:\n  " + "\n  ".join(problems))
    out = []
    for item in items:
        bp = Blueprint(**item)
        bp.budget_s = float(bp.budget_s)
        out.append(bp)
    return out


#: the schema as the LLM leader's prompt shows it
SCHEMA_TEXT = """\
A blueprint is a mapping with these fields:
  name:        str, a folder name, unique in the stage (letters, digits, _ . -)
  objective:   str, what this run measures
  hypothesis:  str, what you expect and why
  overrides:   mapping of `python -m swarmkit` config keys to scalar or list values
               (e.g. {"batching.batch_size": 4, "task.max_tokens": 8}); never seed, mode,
               server.port, hydra.*
  seeds:       list of int (default [0]); one run per seed
  metric:      str (default "eval_after"): a summary.json path, or train.<key> (mean of the
               last 3 steps of metrics.jsonl)
  budget_s:    number, seconds one run may take before the watchdog kills it (default 300)
  command:     list of str (default ["python", "-m", "swarmkit"]), the launch command
  output:      str, the run folders' parent relative to the stage folder (default: name)
"""
