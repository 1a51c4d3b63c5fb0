"""``python -m swarmkit research key=value ...``: run, resume or plan a research campaign.

Hydra-style ``key=value`` arguments (values read as YAML, so ``seeds=[0,1]``
is a list); ``--help`` lists them. See docs/research.md.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from swarmkit.errors import SwarmkitError

HELP = """\
usage: python -m swarmkit research [key=value ...]

Automated research: a leader turns a goal into stages of experiment blueprints, the stages
run as Hydra multiruns (several runs in parallel, crashed or hung runs retried), each stage
is analysed before the next is planned, and a report (markdown + plots) closes the campaign.

  study=NAME            a ready-made goal + constraints: {studies}
  goal="..."            the research question (recorded; the LLM leader reads it)
  constraints=PATH|YAML the study's constraints: a YAML file or inline YAML (docs/research.md);
                        constraints.KEY=VALUE sets one of them
  planner=offline|llm   offline: the built-in planners (threshold, grid, halving, ablation);
                        llm: an OpenAI-compatible chat endpoint plans every stage
  blueprints=PATH       run the blueprints of a YAML file as the campaign's one stage (planner=file)
  llm.url=URL           the endpoint's base URL, e.g. http://127.0.0.1:8000/v1
  llm.model=NAME        the model it serves
  llm.key=KEY           its API key (default $SWARMKIT_LLM_KEY, else $OPENAI_API_KEY; never stored)
  llm.max_attempts=2    replies in all before a malformed plan fails the campaign
  dir=PATH              the campaign folder (default runs/research/<date>)
  resume=true           continue the campaign in dir= (finished runs are not run again)
  parallel=2            runs at once (CPU); with gpus=, at most one per GPU
  gpus=auto|0,1|none    GPU indices handed to runs (CUDA_VISIBLE_DEVICES); default none
  threads_per_job=1     torch threads per run
  retries=1             runs of a crashed or killed run after its first
  timeout_s=0           a run's time limit (0: each blueprint's budget_s)
  max_stages=N          stages at most (default: the constraints' max_stages, else 3)
  report_dir=PATH       where report.md and its plots go (default DIR/report)
  plan_only=true        print the first stage's blueprints and exit
  inject_crash=S:RUN@N  kill run RUN of stage S once after N training steps (tests the retry path)

examples:
  python -m swarmkit research study=min_batch
  python -m swarmkit research study=min_batch dir=runs/research/min_batch resume=true
  python -m swarmkit research goal="..." constraints=study.yaml planner=llm llm.url=http://host:8000/v1 llm.model=M
"""

_KEYS = {"study", "goal", "constraints", "planner", "llm.url", "llm.model", "llm.key", "llm.max_attempts", "dir",
         "resume", "parallel", "gpus", "threads_per_job", "retries", "timeout_s", "max_stages", "report_dir",
         "plan_only", "inject_crash", "blueprints"}


class UsageError(SwarmkitError):
    """A bad command line (the message says which argument)."""


def parse_args(args: list[str]) -> dict[str, Any]:
    """``key=value`` arguments as a mapping (values as YAML; ``constraints.K=V`` collected apart)."""
    out: dict[str, Any] = {"constraint_overrides": {}}
    problems = []
    for arg in args:
        key, eq, raw = arg.partition("=")
        if not eq:
            if arg in ("resume", "plan_only"):
                out[arg] = True
                continue
            problems.append(f"{arg!r}: expected key=value")
            continue
        if key in ("goal", "llm.key", "llm.url", "llm.model", "dir", "report_dir", "inject_crash", "study", "gpus",
                   "blueprints"):
            value: Any = raw
        else:
            try:
                value = yaml.safe_load(raw) if raw else ""
            except yaml.YAMLError:
                value = raw
        if key.startswith("constraints."):
            out["constraint_overrides"][key[len("constraints."):]] = value
        elif key in _KEYS:
            out[key] = value
        else:
            problems.append(f"{key}: unknown argument (known: {', '.join(sorted(_KEYS))}, constraints.KEY)")
    if problems:
        raise UsageError("; ".join(problems))
    return out


def load_constraints(value: Any) -> dict[str, Any]:
    """The constraints from a YAML file path, inline YAML/JSON text, or a mapping."""
    if value in (None, ""):
        return {}
    if isinstance(value, dict):
        return value
    text = str(value)
    if not text.lstrip().startswith("{") and Path(text).is_file():
        text = Path(text).read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise UsageError(f"constraints: expected a YAML mapping or a file holding one, got {value!r}")
    return data


def detect_gpus(value: str) -> str:
    """``auto``: the GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi), as indices."""
    if value in ("", "none", "cpu"):
        return ""
    if value != "auto":
        return value
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        return ",".join(str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU"))
    return ""


def check_overrides(args: list[str]) -> list[str]:
    """The problems of one run's overrides, as the main command line would report them."""
    from swarmkit.config.compose import compose_checked
    from swarmkit.errors import ConfigError

    try:
        compose_checked(args)
    except ConfigError as exc:
        return list(exc.problems)
    except SwarmkitError as exc:
        return [str(exc)]
    return []


def main(args: list[str]) -> int:
    """Entry point of ``python -m swarmkit research``."""
    from swarmkit.research.studies import STUDIES

    if any(a in ("--help", "-h", "help") for a in args):
        print(HELP.format(studies=", ".join(STUDIES)))
        return 0
    try:
        return _main(args)
    except SwarmkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main(args: list[str]) -> int:
    from swarmkit.research.campaign import Campaign, Settings
    from swarmkit.research.planner import parse_spec
    from swarmkit.research.studies import STUDIES

    opts = parse_args(args)
    if opts.get("inject_crash") and not re.match(r"^\d+:[^@]+@\d+$", str(opts["inject_crash"])):
        raise UsageError(f"inject_crash: expected STAGE:RUN@STEP (e.g. 1:batch_size4-max_tokens8/seed1@3), "
                         f"got {opts['inject_crash']!r}")
    folder = Path(opts.get("dir") or f"runs/research/{dt.datetime.now():%Y-%m-%d_%H-%M-%S}")
    resource: dict[str, Any] = {k: opts[k] for k in ("parallel", "retries", "timeout_s", "threads_per_job", "report_dir",
                                     "inject_crash") if k in opts}
    if "gpus" in opts:
        resource["gpus"] = detect_gpus(str(opts["gpus"]))
    if opts.get("resume"):
        campaign = Campaign.load(folder, resource)
        print(f"resuming the campaign in {folder}: {campaign.state['goal']}")
    else:
        goal, constraints = "", {}
        if opts.get("study"):
            if opts["study"] not in STUDIES:
                raise UsageError(f"study: unknown study {opts['study']!r} (known: {', '.join(STUDIES)})")
            preset = STUDIES[opts["study"]]
            goal, constraints = preset["goal"], dict(preset["constraints"])
        goal = str(opts.get("goal") or goal)
        constraints = {**constraints, **load_constraints(opts.get("constraints")), **opts["constraint_overrides"]}
        if not goal:
            raise UsageError("goal: required (goal=\"...\" or study=NAME); see --help")
        planner = str(opts.get("planner", "file" if opts.get("blueprints") else "offline"))
        if planner not in ("offline", "llm", "file"):
            raise UsageError(f"planner: expected offline, llm or file, got {planner!r}")
        if planner == "file":
            if not opts.get("blueprints"):
                raise UsageError("planner=file needs blueprints=PATH (a YAML list of blueprints)")
            from swarmkit.research.campaign import load_blueprints_file

            listed = load_blueprints_file(Path(str(opts["blueprints"])))
            constraints = {**constraints, "blueprints": [bp.to_dict() for bp in listed]}
        elif planner == "offline":
            parse_spec(constraints, goal)  # every problem of the constraints before anything runs
        max_stages = int(opts.get("max_stages") or constraints.get("max_stages") or 3)
        settings = Settings(planner=planner, max_stages=max_stages, llm_url=str(opts.get("llm.url", "")),
                            llm_model=str(opts.get("llm.model", "")), **resource)
        if opts.get("plan_only"):
            leader = _leader(settings, constraints, goal, opts)
            plan = leader.next_stage(goal, constraints, [], max_stages)
            print(f"# stage 1: {plan.rationale}" if plan else "# nothing to run")
            print(yaml.safe_dump([bp.to_dict() for bp in (plan.blueprints if plan else [])], sort_keys=False))
            return 0
        campaign = Campaign.create(folder, goal, constraints, settings)
        print(f"research campaign in {folder}: {goal}")
    leader = _leader(campaign.settings, campaign.state["constraints"], campaign.state["goal"], opts)
    campaign.run(leader, check_overrides=check_overrides, say=lambda s: print(s, flush=True))
    for line in campaign.state.get("conclusion", []):
        print(f"finding: {line}")
    return 0


def _leader(settings: Any, constraints: dict[str, Any], goal: str, opts: dict[str, Any]) -> Any:
    from swarmkit.research.leader import LLMLeader
    from swarmkit.research.planner import OfflineLeader, parse_spec

    if settings.planner == "file":
        from swarmkit.research.planner import FileLeader

        return FileLeader(constraints.get("blueprints", []))
    if settings.planner == "llm":
        key = str(opts.get("llm.key") or os.environ.get("SWARMKIT_LLM_KEY") or os.environ.get("OPENAI_API_KEY") or "")
        return LLMLeader(settings.llm_url, settings.llm_model, key, max_attempts=int(opts.get("llm.max_attempts", 2)),
                         check_overrides=check_overrides)
    return OfflineLeader(parse_spec(constraints, goal))
