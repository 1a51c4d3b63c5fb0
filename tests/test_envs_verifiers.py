"""A verifiers environment (``verifiers`` 0.4.0) played as swarm episodes (``swarmkit.envs.verifiers``).

``verifiers`` cannot share swarmkit's environment (it pins ``openai`` 2.x and ``mcp`` 2.0), so it
lives in a venv of its own: ``$SWARMKIT_VERIFIERS_PYTHON``, else ``.venv-verifiers/bin/python`` at
the repository root (docs/environments.md); the end-to-end test is skipped when neither exists,
unless ``SWARMKIT_REQUIRE_ENV_VENVS=1`` (CI) makes that a failure. This process runs a real server
with the ``scripted`` backend; a child process in that venv defines a verifiers taskset (tasks,
a ``@vf.reward`` rubric, a ``@vf.metric``) with its own harness (a streamed chat through the env's
interception server, as verifiers' own chat program does), and plays it through
:func:`run_verifiers_episodes`: the rubric's rewards, the held-out split and the metadata arrive
in the server's episodes; an episode the env failed to score is aborted. The unit tests of the
report run anywhere (verifiers is imported only when an episode runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from test_envs import ROOT, env_venv_python, scripted_swarm

from swarmkit.envs.verifiers import episode_report, task_key, task_meta

#: the taskset, written as a module the env imports by its id (a taskset module exporting a
#: Harness too makes it the taskset's default harness)
TASKSET = '''
import openai
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        if task.answer == "boom":
            raise ValueError("the rubric broke")
        return 1.0 if trace.last_reply == task.answer else 0.0

    @vf.metric
    async def reply_chars(self, task, trace) -> float:
        return float(len(trace.last_reply))


PAIRS = [(1, 1), (2, 3), (4, 4), (5, 2), (0, 0)]


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in PAIRS:
            yield SumTask(SumData(id=f"{a}+{b}", prompt=f"What is {a}+{b}?",
                                  answer="boom" if a == b == 0 else str(a + b),
                                  system_prompt="Answer with the number only."), self.config.task)


class StreamedChat(vf.Harness[vf.HarnessConfig]):
    """One streamed chat turn through the interception endpoint, in the env's process."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kw):
        system, prompt = self.resolve_prompt(data)
        llm = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
        stream = await llm.chat.completions.create(
            model=ctx.model, stream=True, stream_options={"include_usage": True},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": prompt}])
        async for _ in stream:
            pass
        await llm.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["StreamedChat", "SumTaskset"]
'''

CHILD = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[2])
import verifiers.v1 as vf
from swarmkit.client import AsyncSwarmClient
from swarmkit.envs.verifiers import run_verifiers_episodes

async def main():
    env = vf.load_environment(vf.SingleAgentEnvConfig(taskset={"id": "swarm_sums"},
                                                      agent={"runtime": {"type": "subprocess"}}))
    tasks = list(env.taskset)
    async with AsyncSwarmClient(sys.argv[1], retry_for=10) as client:
        train = await run_verifiers_episodes(client, env, tasks[:3] + tasks[4:], name="sums", repeats=2,
                                             concurrency=4, meta={"split": "train"}, sampling={"max_tokens": 8})
        test = await run_verifiers_episodes(client, env, tasks[3:4], name="sums", eval=True, meta={"split": "test"})
    row = lambda r: {"task_id": r.task_id, "reward": r.reward, "rewards": r.rewards, "metrics": r.metrics,
                     "ok": r.ok, "errors": r.errors, "report": r.report}
    print(json.dumps({"train": [row(r) for r in train], "test": [row(r) for r in test]}))

asyncio.run(main())
"""

#: the model's side: right on 1+1, 4+4 and 5+2 (held out), wrong on 2+3, anything on 0+0
SCRIPT = """
rules:
  - when: {contains: "What is 1+1?"}
    reply: "2"
  - when: {contains: "What is 2+3?"}
    reply: "6"
  - when: {contains: "What is 4+4?"}
    reply: "8"
  - when: {contains: "What is 5+2?"}
    reply: "7"
replies: ["0"]
"""


@pytest.fixture(scope="module")
def scripted_server(tmp_path_factory):
    env_venv_python("SWARMKIT_VERIFIERS_PYTHON", ".venv-verifiers")  # no server for a test that skips
    with scripted_swarm(tmp_path_factory.mktemp("verifiers"), SCRIPT) as served:
        yield served


def test_a_verifiers_environment_plays_through_the_swarm(scripted_server, tmp_path):
    client, cycle = scripted_server
    python = env_venv_python("SWARMKIT_VERIFIERS_PYTHON", ".venv-verifiers")
    (tmp_path / "swarm_sums.py").write_text(TASKSET)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([python, "-c", CHILD, client.url, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    by_task: dict[str, list[dict]] = {}
    for row in out["train"]:
        by_task.setdefault(row["task_id"], []).append(row)
    assert sorted(by_task) == ["sums-0+0", "sums-1+1", "sums-2+3", "sums-4+4"]
    assert all(len(rows) == 2 for rows in by_task.values()), "repeats=2: a GRPO group of two per task"
    assert [row["reward"] for row in by_task["sums-1+1"] + by_task["sums-4+4"]] == [1.0] * 4
    assert [row["reward"] for row in by_task["sums-2+3"]] == [0.0, 0.0]
    one = by_task["sums-1+1"][0]
    assert one["rewards"] == {"correct": 1.0} and one["ok"] and one["report"]["accepted"]
    assert one["metrics"]["reply_chars"] == 1.0 and one["metrics"]["turns"] == 1.0
    # the rubric raised: no reward was computed, so the episode is aborted, never trained on
    for row in by_task["sums-0+0"]:
        assert row["reward"] is None and not row["ok"] and row["report"]["status"] == "aborted", row
        assert any("the rubric broke" in e for e in row["errors"]), row["errors"]
    [held] = out["test"]
    assert held["task_id"] == "sums-5+2" and held["reward"] == 1.0
    assert held["report"]["reward"] == 1.0 and not held["report"]["accepted"]  # scored, not trained on
    accepted = [ep for ep in cycle.accepted if ep.task_id.startswith("sums")]
    assert sorted(ep.task_id for ep in accepted) == ["sums-1+1"] * 2 + ["sums-2+3"] * 2 + ["sums-4+4"] * 2
    ep = next(ep for ep in accepted if ep.task_id == "sums-2+3")
    assert ep.reward == 0.0 and not ep.eval and ep.meta["task_family"] == "sums" and ep.meta["split"] == "train"
    assert ep.meta["task"]["id"] == "2+3" and ep.meta["task"]["idx"] == 1 and len(ep.meta["task"]["key"]) == 64
    assert ep.meta["metrics"]["correct"] == 0.0 and ep.meta["metrics"]["vf_reward"] == 0.0
    [trace] = ep.meta["verifiers"]["traces"]
    assert trace["rewards"] == {"correct": {"score": 0.0, "weight": 1.0}}
    assert trace["stop_condition"] == "agent_completed" and ep.meta["verifiers"]["env"] == "swarm_sums"
    # the episode's timeline holds the model's streamed answer
    assert ep.timelines and ep.timelines[0].blocks[-1].text.startswith("6")


# ------------------------------------------------------------------ the report, without verifiers
def _trace(rewards, metrics=None, ok=True, name="agent"):
    return SimpleNamespace(rewards=rewards, metrics=metrics or {}, ok=ok, errors=[], info={"k": "v"},
                           stop_condition="agent_completed", num_turns=2, is_truncated=False,
                           agent=SimpleNamespace(name=name),
                           reward=sum(r.score * r.weight for r in rewards.values() if r is not None))


def _reward(score, weight=1.0):
    return SimpleNamespace(score=score, weight=weight)


def test_the_report_is_the_rubric_reward_with_metrics_and_details():
    ep = SimpleNamespace(ok=True, errors=[], env=SimpleNamespace(id="math"),
                         traces=[_trace({"exact": _reward(1.0, 0.5), "fmt": _reward(0.0)}, {"chars": 3, "bad": None})])
    reward, meta = episode_report(ep)
    assert reward == 0.5
    assert meta["metrics"] == {"exact": 1.0, "fmt": 0.0, "chars": 3.0, "vf_reward": 0.5, "ok": 1.0, "turns": 2.0,
                               "truncated": 0.0}
    assert meta["verifiers"]["traces"][0]["rewards"]["exact"] == {"score": 1.0, "weight": 0.5}
    assert meta["verifiers"]["env"] == "math" and meta["verifiers"]["errors"] == []
    two = SimpleNamespace(ok=True, errors=[], env=None, traces=[_trace({"r": _reward(1.0)}, name="a"),
                                                                 _trace({"r": _reward(0.0)}, name="b")])
    assert episode_report(two)[0] == 0.5  # several agents' traces: their mean
    assert episode_report(two)[1]["metrics"]["turns"] == 4.0


def test_an_unscored_episode_has_no_report():
    assert episode_report(SimpleNamespace(ok=False, errors=[], env=None, traces=[])) is None
    failed = SimpleNamespace(ok=False, errors=[], env=None, traces=[_trace({"exact": None}, ok=False)])
    assert episode_report(failed) is None
    no_rubric = SimpleNamespace(ok=True, errors=[], env=None, traces=[_trace({})])
    assert episode_report(no_rubric)[0] == 0.0


def test_task_ids_and_metadata():
    data = SimpleNamespace(id=None, idx=3, name="third")
    task = SimpleNamespace(data=data, key="f" * 64)
    assert task_key(task) == "3" and task_meta(task) == {"idx": 3, "name": "third", "key": "f" * 64}
    assert task_key(SimpleNamespace(data=SimpleNamespace(id="gsm-7", idx=3), key="k")) == "gsm-7"
    assert task_key(SimpleNamespace(data=SimpleNamespace(id=None, idx=None), key="a" * 64)) == "a" * 16


def test_the_adapter_imports_without_verifiers_and_refuses_a_sync_client():
    import asyncio

    from swarmkit.client import SwarmClient
    from swarmkit.envs.verifiers import run_verifiers_episode

    assert "verifiers" not in sys.modules
    with pytest.raises(TypeError, match="AsyncSwarmClient"):
        asyncio.run(run_verifiers_episode(SwarmClient("http://127.0.0.1:9"), None, None, task_id="t"))
