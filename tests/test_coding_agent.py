"""The coding-agent recipe (``examples/coding_agent/``): the real Codex CLI against a real scripted server.

Codex (``@openai/codex`` 0.171.0, npm) runs ``codex exec`` on a copy of the task through one episode's
Responses endpoint; the script's answers fix the bug through Codex's own ``exec_command`` tool, so the
task's tests pass and the reward is 1.0; the episode's timelines hold Codex's two model calls.

Skipped only when Codex is not installed: ``npm install --prefix .npm-agents @openai/codex@0.171.0``
(``.ci/run`` runs the same line and sets ``SWARMKIT_REQUIRE_CODEX=1``, which turns the skip into a
failure; node >= 18, and the npm registry alone is reached: the Linux
binary is the optional dependency ``@openai/codex-linux-x64``, no post-install download).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from test_backend_scripted import scripted_server_process

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "coding_agent"
TOKEN = "coding-agent-admin-token-" + "x" * 16


def _recipe():
    spec = importlib.util.spec_from_file_location("codex_episode", RECIPE / "codex_episode.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclass needs its module registered
    spec.loader.exec_module(mod)
    return mod


recipe = _recipe()
CODEX = recipe.find_codex()
if CODEX is None and os.environ.get("SWARMKIT_REQUIRE_CODEX") == "1":
    raise RuntimeError("SWARMKIT_REQUIRE_CODEX=1 but Codex is not installed: "
                       "npm install --prefix .npm-agents @openai/codex@0.171.0")
pytestmark = pytest.mark.skipif(
    CODEX is None, reason="Codex not installed: npm install --prefix .npm-agents @openai/codex@0.171.0")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Codex's first prompt is ~4,100 tokens even trimmed (the tiny model's context is 1,024): the
    # scripted backend keeps the tiny tokenizer and template and is given SmolLM2's 8,192
    with scripted_server_process(tmp_path_factory.mktemp("codex"), RECIPE / "script.yaml", TOKEN,
                                 ["model.max_context=8192"]) as client:
        yield client


def test_codex_fixes_the_task_through_the_episode_and_the_tests_reward_it(server):
    with server.episode(task_id="codex-fix-add", meta={"task_family": "codex"}) as ep:
        out = recipe.run_episode(ep, CODEX, timeout_s=180)
        timelines = ep.timelines()
        ep.report(out.reward, meta={"metrics": {"tests_pass": out.reward}})
    assert out.codex_rc == 0, out.codex_log
    assert out.reward == 1.0, out.test_log + out.codex_log
    assert "Fixed: add returns a + b." in out.codex_log
    # Codex's two calls: the tool call that fixed the file, then its final message
    generated = [b["text"] for t in timelines for b in t["blocks"] if b["author"] == "llm"]
    assert len(generated) == 2, generated
    assert '"name": "exec_command"' in generated[0] and "return a + b" in generated[0]
    assert generated[1].startswith("Fixed: add returns a + b.")
    prompt = "".join(b["text"] for b in timelines[0]["blocks"] if b["author"] != "llm")
    assert recipe.INSTRUCTIONS in prompt and recipe.PROMPT in prompt  # Codex's own prompt, as the model saw it
    first_prompt_tokens = sum(len(b["token_ids"]) for b in timelines[0]["blocks"] if b["author"] != "llm")
    assert first_prompt_tokens < 8192 * 0.95, first_prompt_tokens


def test_a_task_left_broken_gets_reward_zero(tmp_path):
    broken = tmp_path / "task"
    broken.mkdir()
    for name in ("calc.py", "test_calc.py"):
        (broken / name).write_text((RECIPE / "task" / name).read_text())
    passed, log = recipe.run_tests(broken)
    assert not passed and "assert -1 == 5" in log
