"""Train on an unmodified coding-agent CLI: OpenAI Codex (``@openai/codex`` from npm) as a swarm episode.

Each episode copies a small repository task into a temporary folder, runs ``codex exec`` there against
the episode's endpoint (the server's Responses API, ``/v1/responses``), then runs the task's tests:
the reward is 1.0 when they pass, 0.0 otherwise. Every model call Codex makes is captured into the
episode's timelines like any client's.

Install Codex (its Linux/macOS binary comes as an npm package too, nothing else is downloaded)::

    npm install --prefix .npm-agents @openai/codex@0.171.0

Run (a server in another terminal, e.g. ``python -m swarmkit mode=server model=smollm2``)::

    python examples/coding_agent/codex_episode.py --server http://127.0.0.1:8000 --episodes 8

Codex's defaults are made to fit a swarm server (``codex_command``): a model catalog entry names
the model ``swarm`` with short instructions (``--instructions``), no reasoning summaries and the
server's context (``--context``); web search, sub-agents and goals are off (the server serves
function tools only). Codex's own first prompt is then ~2,000 tokens instead of ~19,400.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TASK = HERE / "task"
PROMPT = "The tests in test_calc.py fail. Fix the bug in calc.py so that they pass."
INSTRUCTIONS = ("You are a coding agent in a small repository. Use the exec_command tool to run shell "
                "commands that read and change files, then say what you changed.")


def find_codex() -> str | None:
    """The ``codex`` command: ``$SWARMKIT_CODEX``, the repository's ``.npm-agents`` install, or ``PATH``."""
    for candidate in (os.environ.get("SWARMKIT_CODEX"),
                      str(HERE.parents[1] / ".npm-agents" / "node_modules" / ".bin" / "codex")):
        if candidate and Path(candidate).exists():
            return candidate
    return shutil.which("codex")


def model_catalog(*, instructions: str, context: int) -> dict[str, Any]:
    """Codex's metadata for the model ``swarm`` (``model_catalog_json``): no reasoning, the server's context."""
    return {"models": [{
        "slug": "swarm", "display_name": "swarm", "description": "a swarm server's model",
        "default_reasoning_level": None, "supported_reasoning_levels": [], "shell_type": "shell_command",
        "visibility": "list", "supported_in_api": True, "priority": 0, "additional_speed_tiers": [],
        "service_tiers": [], "availability_nux": None, "upgrade": None, "base_instructions": instructions,
        "model_messages": None, "supports_reasoning_summaries": False, "default_reasoning_summary": "none",
        "support_verbosity": False, "default_verbosity": None, "apply_patch_tool_type": None,
        "web_search_tool_type": "text", "truncation_policy": {"mode": "tokens", "limit": max(256, context // 4)},
        "supports_parallel_tool_calls": False, "supports_image_detail_original": False,
        "context_window": context, "max_context_window": context, "auto_compact_token_limit": None,
        "effective_context_window_percent": 95, "experimental_supported_tools": [], "input_modalities": ["text"],
        "supports_search_tool": False}]}


def codex_command(codex: str, *, base_url: str, workdir: Path, catalog: Path, prompt: str) -> list[str]:
    """``codex exec`` against ``base_url`` (the key comes from ``$SWARM_API_KEY``), in ``workdir``."""
    provider = {"name": "swarm", "base_url": base_url, "env_key": "SWARM_API_KEY", "wire_api": "responses",
                "request_max_retries": 0, "stream_max_retries": 0}
    overrides = [f"model_providers.swarm.{k}={json.dumps(v)}" for k, v in provider.items()]
    overrides += ["model_provider=swarm", f"model_catalog_json={json.dumps(str(catalog))}",
                  "analytics.enabled=false", 'web_search="disabled"']
    cmd = [codex, "exec", "--skip-git-repo-check", "--ephemeral", "-m", "swarm", "-C", str(workdir),
           "-s", "workspace-write", "--disable", "multi_agent", "--disable", "goals"]
    for o in overrides:
        cmd += ["-c", o]
    return cmd + [prompt]


@dataclass
class Outcome:
    """One episode: its reward, whether Codex exited cleanly, and the logs of Codex and of the tests."""

    reward: float
    codex_rc: int
    codex_log: str
    test_log: str


def run_tests(workdir: Path) -> tuple[bool, str]:
    """The task's tests in ``workdir`` (pytest in this interpreter): whether they pass, and their output."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(workdir)],
                          cwd=workdir, capture_output=True, text=True, timeout=300)
    return proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def run_episode(ep: Any, codex: str, *, task: Path = TASK, prompt: str = PROMPT, instructions: str = INSTRUCTIONS,
                context: int = 8192, timeout_s: float = 600) -> Outcome:
    """Codex on a copy of ``task`` through episode ``ep`` (``ep.base_url``/``ep.api_key``), rewarded by its tests.

    The episode is not reported here: the caller reports ``outcome.reward`` (and may add metadata).
    """
    with tempfile.TemporaryDirectory(prefix="swarm-codex-") as tmp:
        root = Path(tmp)
        workdir, home = root / "repo", root / "codex-home"
        shutil.copytree(task, workdir)
        home.mkdir()
        subprocess.run(["git", "init", "-q"], cwd=workdir, check=True)  # Codex expects a repository
        catalog = root / "catalog.json"
        catalog.write_text(json.dumps(model_catalog(instructions=instructions, context=context)))
        env = dict(os.environ, CODEX_HOME=str(home), SWARM_API_KEY=ep.api_key)
        cmd = codex_command(codex, base_url=ep.base_url, workdir=workdir, catalog=catalog, prompt=prompt)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                                  stdin=subprocess.DEVNULL)
            rc, log = proc.returncode, proc.stdout[-4000:] + proc.stderr[-4000:]
        except subprocess.TimeoutExpired as e:
            rc, log = -1, f"codex ran past {timeout_s} s: {e}"
        passed, test_log = run_tests(workdir)
    return Outcome(1.0 if passed else 0.0, rc, log, test_log)


def main(argv: list[str] | None = None) -> int:
    """Run ``--episodes`` Codex episodes against a swarm server and print each reward."""
    from swarmkit.client import SwarmClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--token", default=os.environ.get("SWARMKIT_CLIENT_TOKEN"), help="the client token, if any")
    ap.add_argument("--episodes", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192, help="the served model's context (Codex budgets by it)")
    ap.add_argument("--instructions", default=INSTRUCTIONS, help="Codex's base instructions (its system prompt)")
    ap.add_argument("--eval", action="store_true", help="held-out episodes (scored, never trained on)")
    args = ap.parse_args(argv)
    codex = find_codex()
    if codex is None:
        print("codex not found: npm install --prefix .npm-agents @openai/codex@0.171.0 (or set SWARMKIT_CODEX)",
              file=sys.stderr)
        return 2
    with SwarmClient(args.server, token=args.token) as client:
        for i in range(args.episodes):
            with client.episode(task_id="codex-fix-add", eval=args.eval, meta={"task_family": "codex"}) as ep:
                out = run_episode(ep, codex, instructions=args.instructions, context=args.context)
                ep.report(out.reward, meta={"metrics": {"tests_pass": out.reward, "codex_rc": out.codex_rc}})
            print(f"episode {i}: reward {out.reward} (codex exit {out.codex_rc})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
