"""An OpenEnv environment played as swarm episodes (``swarmkit.envs.openenv``).

``openenv-core`` 0.3.0 cannot share swarmkit's environment (it downgrades pillow below the
pin of other packages here), so it lives in a venv of its own: ``$SWARMKIT_OPENENV_PYTHON``,
else ``.venv-openenv/bin/python`` at the repository root (docs/environments.md says how to
make it); the test is skipped when neither exists, unless ``SWARMKIT_REQUIRE_ENV_VENVS=1`` (CI)
makes that a failure. This process runs a real server with the
``scripted`` backend; a child process in that venv defines an OpenEnv ``Environment`` (pydantic
Action and Observation) and plays it through the light client; rewards, the held-out split and
the observation metadata arrive in the server's episodes.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from test_envs import ROOT, env_venv_python, scripted_swarm

CHILD = """
import json, sys
from openenv.core.env_server import Action, Environment, Observation, State
from swarmkit.client import SwarmClient
from swarmkit.envs import run_env_episodes
from swarmkit.envs.openenv import OpenEnvTextEnv

GUESS = {"type": "function", "function": {"name": "guess", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}

class Guess(Action):
    n: int

class Hint(Observation):
    text: str

class GuessNumber(Environment):
    def reset(self, seed=None, episode_id=None, **kw):
        self.target = 1 + (seed or 0) % 3
        self._state = State(episode_id=episode_id, step_count=0)
        return Hint(text="Guess my number from 1 to 3.", metadata={"target": self.target})

    def step(self, action, timeout_s=None, **kw):
        self._state.step_count += 1
        if action.n == self.target:
            return Hint(text="correct", done=True, reward=1.0, metadata={"hit": True})
        return Hint(text="higher" if action.n < self.target else "lower", reward=-0.1, metadata={"hit": False})

    @property
    def state(self):
        return self._state

def make():
    return OpenEnvTextEnv(GuessNumber(), lambda a: Guess(n=int(a.tool_calls[0].arguments["n"])), tools=[GUESS])

with SwarmClient(sys.argv[1], retry_for=10) as client:
    train = run_env_episodes(client, make, [0, 1, 2], name="openenv-guess", concurrency=3)
    test = run_env_episodes(client, make, [4], name="openenv-guess", eval=True)
print(json.dumps({"train": [[r.task_id, r.rewards, r.report] for r in train],
                  "test": [[r.task_id, r.rewards, r.report] for r in test]}))
"""


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    env_venv_python("SWARMKIT_OPENENV_PYTHON", ".venv-openenv")  # no server for a test that skips
    with scripted_swarm(tmp_path_factory.mktemp("openenv")) as served:
        yield served


def test_an_openenv_environment_plays_through_the_swarm(scripted_server):
    client, cycle = scripted_server
    python = env_venv_python("SWARMKIT_OPENENV_PYTHON", ".venv-openenv")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([python, "-c", CHILD, client.url], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert {t: rw for t, rw, _ in out["train"]} == {"openenv-guess-0": [-0.1, 1.0], "openenv-guess-1": [1.0],
                                                     "openenv-guess-2": [-0.1, 1.0]}
    assert out["test"][0][1] == [1.0], out["test"]
    assert out["test"][0][2]["reward"] == 1.0 and not out["test"][0][2]["accepted"], out["test"]  # scored, not trained
    accepted = {ep.task_id: ep for ep in cycle.accepted if ep.task_id.startswith("openenv")}
    assert set(accepted) == {"openenv-guess-0", "openenv-guess-1", "openenv-guess-2"}
    ep = accepted["openenv-guess-0"]
    assert ep.reward == pytest.approx(0.9) and ep.meta["env"]["reset_info"] == {"target": 1}
    assert ep.meta["metrics"]["hit"] == 1.0 and ep.meta["task_family"] == "openenv-guess"
