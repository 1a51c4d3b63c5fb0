"""The task suites: reasoning-gym and BFCL multi-turn, scored against their own reference answers, and run
through the task client against a real server on the tiny model.

Both packages are optional installs (docs/environments.md, "Task suites"): without them these tests skip,
unless ``SWARMKIT_REQUIRE_SUITES=1`` (CI sets it) makes that a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

import httpx
import pytest

from swarmkit.tasks import demonstration, make_tasks, run_task

_REQUIRED = os.environ.get("SWARMKIT_REQUIRE_SUITES") == "1"


def _need(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is None:
        if _REQUIRED:
            pytest.fail(f"{module} is not installed: {install}")
        pytest.skip(f"{module} is not installed: {install}")


@pytest.fixture
def rg():
    _need("reasoning_gym", "pip install 'swarmkit[suites]'")
    from swarmkit.tasks import rgym
    return rgym


@pytest.fixture
def bfcl():
    _need("bfcl_eval", "pip install --no-deps bfcl-eval==2026.3.23")
    from swarmkit.tasks import bfcl
    return bfcl


def _replay(script: list[dict[str, Any]], seen: list[dict[str, Any]]) -> httpx.Client:
    """An endpoint that answers each chat call with the next scripted assistant message."""
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json={"choices": [{"message": script[len(seen) - 1]}]})
    return httpx.Client(transport=httpx.MockTransport(handler))


# --------------------------------------------------------------------------- reasoning-gym
def test_reasoning_gym_scores_its_own_answers_full_and_the_splits_are_disjoint(rg):
    train = make_tasks("reasoning_gym", 256, split="train")
    held_out = make_tasks("reasoning_gym", 48, split="eval")
    assert {t.meta["dataset"] for t in train} == set(rg.DEFAULT_DATASETS)
    assert not {t.messages[1]["content"] for t in train} & {t.messages[1]["content"] for t in held_out}
    for t in train + held_out:  # the dataset's reference answer, scored by the dataset's own score_answer
        out = rg.score_rg(t, f"Thinking... <answer>{t.answer}</answer>")
        assert out.reward == 1.0 and out.metrics == {"correct": 1.0, "formatted": 1.0}
    gsm = next(t for t in held_out if t.meta["dataset"] == "gsm_symbolic")
    assert rg.score_rg(gsm, f"<answer>{int(gsm.answer) + 1}</answer>").reward == pytest.approx(0.01)
    assert rg.score_rg(gsm, gsm.answer).metrics == {"correct": 0.0, "formatted": 0.0}
    assert rg.score_rg(gsm, gsm.answer).reward == 0.0
    # the same seed gives the same items in every process; another seed, other items
    assert [t.messages for t in make_tasks("reasoning_gym", 8, split="eval")] == [t.messages for t in held_out[:8]]
    assert make_tasks("reasoning_gym", 8, seed=1, split="eval")[0].messages != held_out[0].messages


def test_reasoning_gym_options_and_demonstrations(rg):
    only = make_tasks("reasoning_gym", 6, split="train", options={"datasets": "gsm_symbolic"})
    assert {t.meta["dataset"] for t in only} == {"gsm_symbolic"}
    for t in only:
        demo = demonstration(t)
        assert demo is not None and rg.score_rg(t, demo["messages"][-1]["content"]).reward == 1.0
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        make_tasks("reasoning_gym", 1, options={"datasets": "gsm_symbolicc"})
    with pytest.raises(ValueError, match="weight"):
        make_tasks("reasoning_gym", 1, options={"datasets": "chain_sum:0"})
    with pytest.raises(ValueError, match="system_prompt"):
        make_tasks("reasoning_gym", 1, options={"system_prompt": "nope"})


# --------------------------------------------------------------------------- BFCL multi-turn
def test_bfcl_ground_truth_passes_the_benchmarks_checker_and_wrong_calls_do_not(bfcl):
    train = make_tasks("bfcl", 164, split="train")
    held_out = make_tasks("bfcl", 100, split="eval")
    assert len(held_out) == 36 and all(bfcl.eval_split(t.meta["entry"]["id"]) for t in held_out)
    ids = {t.meta["entry"]["id"] for t in train}
    assert len(ids) == 164 and not ids & {t.meta["entry"]["id"] for t in held_out}
    for t in train + held_out:  # every entry's ground truth, executed and checked by the benchmark's checker
        with bfcl._instances() as prefix:
            assert bfcl.grade_calls(t, [[list(turn)] if turn else [] for turn in t.meta["ground_truth"]],
                                    prefix) == (len(t.meta["ground_truth"]), True), t.meta["entry"]["id"]
    t = held_out[0]
    truth = t.meta["ground_truth"]
    with bfcl._instances() as prefix:
        assert bfcl.grade_calls(t, [[] for _ in truth], prefix) == (0, False)  # no call at all
        first_only = [[list(truth[0])]] + [[] for _ in truth[1:]]
        assert bfcl.grade_calls(t, first_only, prefix)[0] == 1
    # the benchmark keeps instances in its module's globals: an episode's are dropped afterwards
    space = vars(bfcl._module(bfcl._EXEC))
    assert not [k for k in space if k.startswith("swarmkit_")]


def test_bfcl_call_strings_are_safe_to_eval(bfcl):
    allowed = {"cd", "ls"}
    assert bfcl.call_string("cd", '{"folder": "doc"}', allowed) == "cd(folder='doc')"
    assert bfcl.call_string("ls", "{}", allowed) == "ls()"
    assert bfcl.call_string("cd", {"folder": "x') or __import__('os').system('true"}, allowed) == \
        "cd(folder=\"x') or __import__('os').system('true\")"
    for name, args, why in [("rm", "{}", "unknown tool"), ("cd", "[1]", "JSON object"), ("cd", "nope", "not JSON"),
                            ("cd", '{"a b": 1}', "bad argument"), ("cd", '{"x": NaN}', "JSON object"),
                            ("__import__", "{}", "unknown tool")]:
        with pytest.raises(ValueError, match=why):
            bfcl.call_string(name, args, allowed)


def test_a_bfcl_episode_that_plays_the_ground_truth_scores_full_marks(bfcl):
    task = next(t for t in make_tasks("bfcl", 36, split="eval") if len(t.meta["ground_truth"]) >= 3)
    demo = demonstration(task)
    assert demo is not None and demo["tools"] == task.meta["tools"]
    seen: list[dict[str, Any]] = []
    script = [m for m in demo["messages"] if m["role"] == "assistant"]
    with _replay(script, seen) as http:
        out = run_task(http, "http://swarm/v1", "key", task, max_tokens=64, temperature=0.0)
    assert out.reward == 1.0 and out.metrics["correct"] == 1.0 and out.metrics["turns_passed"] == 1.0
    assert out.metrics["tool_calls"] == sum(len(turn) for turn in task.meta["ground_truth"])
    # the tool results the agent saw are the simulated APIs' answers, the same as the demonstration's
    assert [m["content"] for m in seen[-1]["messages"] if m["role"] == "tool"] == \
        [m["content"] for m in demo["messages"] if m["role"] == "tool"]
    # a model that only talks passes no turn; a malformed call is answered with an error, not executed
    talk = [{"role": "assistant", "content": "Sure."}] * 20
    with _replay(talk, []) as http:
        assert run_task(http, "http://swarm/v1", "key", task, max_tokens=8, temperature=0.0).reward == 0.0
    bad = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "no_such_tool", "arguments": "{}"}}]}]
    seen = []
    with _replay(bad + talk, seen) as http:
        out = run_task(http, "http://swarm/v1", "key", task, max_tokens=8, temperature=0.0)
    assert out.reward == 0.0 and out.metrics["valid_tool_call"] == 0.0
    assert seen[1]["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": "Error: unknown tool 'no_such_tool'"}


def test_bfcl_options(bfcl):
    full = make_tasks("bfcl", 3, split="eval")
    small = make_tasks("bfcl", 3, split="eval", options={"user_turns": 1, "tools": "needed", "brief": True})
    for f, s in zip(full, small, strict=True):
        assert f.meta["entry"]["id"] == s.meta["entry"]["id"] and len(s.meta["turns"]) == 1
        names = {t["function"]["name"] for t in s.meta["tools"]}
        assert names == {bfcl._called(c) for c in s.meta["ground_truth"][0]} and len(names) < len(f.meta["tools"])
        assert "This tool belongs to" not in json.dumps(s.meta["tools"])
        assert all(t["function"]["parameters"]["type"] == "object" for t in s.meta["tools"])
    with pytest.raises(ValueError, match="multi_turn_base"):
        make_tasks("bfcl", 1, options={"category": "simple_python"})
    with pytest.raises(ValueError, match="tools"):
        make_tasks("bfcl", 1, options={"tools": "some"})


# --------------------------------------------------------------------------- a real server, the tiny model
def test_both_suites_run_through_the_task_client_against_a_real_server(rg, bfcl, serve_tiny_hf, tmp_path):
    """Eval and training episodes and demonstrations of both suites through a real server on the tiny model."""
    from swarmkit.apps.task_client import evaluate, run_episode, send_demonstrations

    small = {"user_turns": 1, "tools": "needed", "brief": True, "max_steps": 2}
    with serve_tiny_hf(tmp_path, "suites-admin-token-0123") as (_, client):
        for name, options in (("reasoning_gym", {}), ("bfcl", small)):
            tasks = make_tasks(name, 2, split="eval", options=options)
            result = evaluate(client, tasks, max_tokens=8, concurrency=2)
            assert result.n == 2 and result.failures == 0, name
            assert 0.0 <= result.mean <= 1.0 and "correct" in result.metrics
            train = make_tasks(name, 1, split="train", options=options)[0]
            ep = run_episode(client, train, max_tokens=8, temperature=1.0)
            assert ep.episode_id and 0.0 <= ep.reward <= 1.0
            # the two shortest of a few (the tiny model's context is 1024 of its byte-level tokens)
            demos = sorted(make_tasks(name, 8, split="demo", options=options),
                           key=lambda t: len(json.dumps(demonstration(t))))[:2]
            assert send_demonstrations(client, demos, group_size=1, concurrency=2) == 2, name
