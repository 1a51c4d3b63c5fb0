"""``swarmkit.envs``: a gymnasium-style text environment played as swarm episodes.

Unit tests of how actions and observations become chat messages, and an end-to-end run:
a real server (uvicorn on 127.0.0.1) with the ``scripted`` backend plays a locally defined
guessing game through :func:`run_env_episodes`, tool calls as actions; the rewards, the
held-out split and the per-episode metadata arrive in the server's episodes unchanged.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from swarmkit.envs import Action, run_env_episodes
from swarmkit.envs.loop import ToolCall, action_of, observation_messages, opening_messages

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "envs-admin-token-" + "x" * 16
GUESS_TOOL = {"type": "function", "function": {"name": "guess", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
#: the model's side of the game: start in the middle, then follow the hint
SCRIPT = """
rules:
  - when: {contains: "higher"}
    reply: {tool_calls: [{name: guess, arguments: {n: 3}}]}
  - when: {contains: "lower"}
    reply: {tool_calls: [{name: guess, arguments: {n: 1}}]}
  - when: {contains: "from 1 to 3"}
    reply: {content: "Let me try the middle.", tool_calls: [{name: guess, arguments: {n: 2}}]}
replies: ["I give up."]
"""


class GuessEnv:
    """Guess a number from 1 to 3 with the ``guess`` tool: the hint says higher or lower; reward 1 on a hit."""

    tools = [GUESS_TOOL]
    system_prompt = "Play the game with the guess tool."

    def reset(self, *, seed=None, options=None):
        self.target = 1 + (seed or 0) % 3
        return "Guess my number from 1 to 3.", {"target": self.target}

    def step(self, action: Action):
        if not action.tool_calls:
            return "Use the guess tool.", 0.0, False, False, {"hit": False}
        n = int(action.tool_calls[0].arguments["n"])
        if n == self.target:
            return "correct", 1.0, True, False, {"hit": True, "guess": n}
        return ("higher" if n < self.target else "lower"), -0.1, False, False, {"hit": False, "guess": n}


def test_a_tool_call_reply_is_an_action_with_parsed_arguments():
    a = action_of({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "guess", "arguments": '{"n": 2}'}}]})
    assert a.text == "" and a.tool_calls == (ToolCall("c1", "guess", {"n": 2}),)


def test_observations_answer_tool_calls_or_speak_as_the_user():
    calls = Action("", (ToolCall("a", "f", {}), ToolCall("b", "g", {})))
    assert observation_messages(["1", "2"], calls) == [
        {"role": "tool", "tool_call_id": "a", "content": "1"}, {"role": "tool", "tool_call_id": "b", "content": "2"}]
    assert observation_messages("next?", Action("hi")) == [{"role": "user", "content": "next?"}]
    msg = {"role": "user", "content": "as is"}
    assert observation_messages([msg], calls) == [msg]
    with pytest.raises(TypeError, match="one text per call"):
        observation_messages("only one", calls)
    with pytest.raises(TypeError, match="reset\\(\\) observation"):
        opening_messages(42)


def env_venv_python(var: str, venv: str) -> str:
    """The python of an environment package's own venv: ``$var``, else ``{venv}/bin/python`` at the
    repository root (docs/environments.md says how to make them). Absent: the test is skipped, unless
    ``SWARMKIT_REQUIRE_ENV_VENVS=1`` (CI sets it) makes that a failure."""
    path = os.environ.get(var) or str(ROOT / venv / "bin" / "python")
    if not Path(path).exists():
        msg = f"no venv at {path} (set {var}, or make {venv}: docs/environments.md)"
        if os.environ.get("SWARMKIT_REQUIRE_ENV_VENVS") == "1":
            pytest.fail(msg + "; SWARMKIT_REQUIRE_ENV_VENVS=1 makes this a failure")
        pytest.skip(msg)
    return path


@contextlib.contextmanager
def scripted_swarm(tmp: Path, script: str = SCRIPT) -> Iterator[tuple[Any, Any]]:
    """A real server (uvicorn on 127.0.0.1) with the ``scripted`` backend playing ``script``, ROLLING;
    yields ``(SwarmClient, MemoryCycle)``: the cycle keeps the accepted training episodes."""
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry
    from swarmkit.swarm.server import MemoryCycle

    (tmp / "script.yaml").write_text(script)
    cfg = validate_config(compose(["model=tiny", "backend=scripted", f"backend.script={tmp / 'script.yaml'}",
                                   "logger=[]"]), get_registry())
    cycle = MemoryCycle()
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp / "run")}}, config=cfg, cycle=cycle)
    try:
        with SwarmClient(h.url, token=TOKEN) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=60)
            yield c, cycle
    finally:
        h.stop()


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    with scripted_swarm(tmp_path_factory.mktemp("envs")) as served:
        yield served


def test_env_episodes_report_rewards_splits_and_metadata(scripted_server):
    client, cycle = scripted_server
    train = run_env_episodes(client, GuessEnv, [0, 1, 2], name="guess", concurrency=3, meta={"split": "train"},
                             sampling={"max_tokens": 64})
    held_out = run_env_episodes(client, GuessEnv, [10, 11], name="guess", eval=True, meta={"split": "test"})
    by_seed = {r.task_id: r for r in train}
    # target 1: 2 -> lower -> 1; target 2: hit at once; target 3: 2 -> higher -> 3
    assert [by_seed[f"guess-{s}"].rewards for s in (0, 1, 2)] == [[-0.1, 1.0], [1.0], [-0.1, 1.0]]
    assert all(r.terminated and not r.truncated for r in train + held_out)
    assert [m["role"] for m in by_seed["guess-0"].messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert by_seed["guess-0"].messages[2]["content"] == "Let me try the middle."
    accepted = {ep.task_id: ep for ep in cycle.accepted}
    assert set(accepted) == {"guess-0", "guess-1", "guess-2"}, "held-out episodes are never trained on"
    for seed in (0, 1, 2):
        ep = accepted[f"guess-{seed}"]
        assert ep.reward == pytest.approx(by_seed[f"guess-{seed}"].reward) and not ep.eval
        assert ep.meta["task_family"] == "guess" and ep.meta["split"] == "train" and ep.meta["seed"] == seed
        assert ep.meta["metrics"]["hit"] == 1.0 and ep.meta["metrics"]["env_return"] == ep.reward
        assert ep.meta["env"]["reset_info"] == {"target": 1 + seed % 3}
    assert [r.reward for r in held_out] == [1.0, pytest.approx(0.9)]


def test_an_episode_cut_at_max_turns_is_truncated(scripted_server):
    client, _ = scripted_server

    class Silent(GuessEnv):
        system_prompt = None

        def reset(self, *, seed=None, options=None):
            return [{"role": "user", "content": "Say anything."}], {}

    [r] = run_env_episodes(client, Silent, [5], name="silent", max_turns=2)
    assert r.truncated and not r.terminated and r.turns == 2 and r.rewards == [0.0, 0.0]
    assert r.messages[1]["content"] == "I give up." and r.messages[2] == {"role": "user", "content": "Use the guess tool."}
