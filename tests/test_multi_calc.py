"""The ``multi_calc`` task: its one-step calculator, its reward's order, its demonstrations, its episode loop."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from swarmkit.tasks import demonstration, make_tasks, run_task
from swarmkit.tasks.multi_calc import (
    OUTCOMES,
    STEP_CREDIT,
    TOOL_CREDIT,
    grade,
    one_step_calculator,
    outcome,
    run_tool_call,
)


def test_the_calculator_does_one_operation_per_call():
    assert one_step_calculator("347 * 86") == "29842"
    assert one_step_calculator("29,842 - 2519") == "27323"
    assert one_step_calculator("-3 * 4") == "-12"
    assert one_step_calculator("347 * 86 - 2519").startswith("error: one operation")
    assert one_step_calculator("1 + 2") == "3"
    assert one_step_calculator("42").startswith("error")
    assert one_step_calculator("__import__('os')").startswith("error")
    assert one_step_calculator("").startswith("error")
    assert run_tool_call("calculator", '{"expression": "2 * 3"}') == ("6", True)
    assert run_tool_call("calculator", "not json")[1] is False
    assert run_tool_call("search", '{"expression": "2 * 3"}')[1] is False
    assert run_tool_call("calculator", '{"expr": "2 * 3"}')[1] is False


def test_items_chain_two_or_three_steps_and_the_splits_are_disjoint():
    train = make_tasks("multi_calc", 40, split="train")
    held_out = make_tasks("multi_calc", 40, split="eval")
    assert {len(t.meta["steps"]) for t in train} == {2, 3}
    assert not {t.messages[1]["content"] for t in train} & {t.messages[1]["content"] for t in held_out}
    for t in train:
        values = t.meta["values"]
        assert str(values[-1]) == t.answer and all(v > 0 for v in values)
        # each step starts from the previous step's result: the chain cannot be one call
        for prev, step in zip(values, t.meta["steps"][1:], strict=False):
            assert step.startswith(f"{prev} ")
    two = make_tasks("multi_calc", 10, split="eval", options={"max_steps": 2})
    assert {len(t.meta["steps"]) for t in two} == {2}
    with pytest.raises(ValueError):
        make_tasks("multi_calc", 1, options={"min_steps": 4})


def test_the_reward_never_pays_doing_nothing_above_an_honest_attempt():
    task = make_tasks("multi_calc", 1, split="eval", options={"max_steps": 2})[0]
    v1, v2 = (str(v) for v in task.meta["values"])
    right = f"<answer>{task.answer}</answer>"
    wrong = "<answer>7</answer>"
    score = {
        "whole chain, right": grade(task, right, [v1, v2]).reward,
        "right, no tool": grade(task, right, []).reward,
        "whole chain, wrong answer": grade(task, wrong, [v1, v2]).reward,
        "first step only": grade(task, wrong, [v1]).reward,
        "a call off the chain": grade(task, wrong, ["12"]).reward,
        "nothing": grade(task, "", []).reward,
        "a wrong answer, no call": grade(task, wrong, []).reward,
    }
    assert score["whole chain, right"] == pytest.approx(1.0 + STEP_CREDIT + TOOL_CREDIT)
    order = list(score)[:6]
    assert all(score[a] > score[b] for a, b in zip(order, order[1:], strict=False)), score
    assert score["nothing"] == score["a wrong answer, no call"] == 0.0
    assert STEP_CREDIT + TOOL_CREDIT < 1.0  # shaping stays under the gap a right answer makes
    out = grade(task, right, [v1, v2], tool_calls=2, turns=3)
    assert out.metrics == {"correct": 1.0, "valid_tool_call": 1.0, "chain": 1.0, "tool_calls": 2.0, "turns": 3.0,
                           **{f"outcome/{k}": float(k == "right") for k in OUTCOMES}}


def test_each_episode_ends_in_exactly_one_outcome():
    """The diagnosis of docs/agents.md as metrics: every way an episode can end, named once."""
    task = make_tasks("multi_calc", 1, split="eval", options={"min_steps": 3, "max_steps": 3})[0]
    v1, v2, v3 = (str(v) for v in task.meta["values"])
    right, wrong = f"<answer>{task.answer}</answer>", "<answer>7</answer>"
    cases = {
        "right": grade(task, right, [v1, v2, v3, "99"], tool_calls=4),  # right wins over one call too many
        "overshoot": grade(task, wrong, [v1, v2, v3, "12"], tool_calls=4),
        "chain_wrong": grade(task, wrong, [v1, v2, v3], tool_calls=3),
        "stopped_early": grade(task, wrong, [v1, v2], tool_calls=2),  # one call too few
        "partial": grade(task, wrong, [v1, "12"], tool_calls=2),
        "off_chain": grade(task, wrong, ["12"], tool_calls=1),
        "malformed": grade(task, wrong, [], tool_calls=2),
        "no_call": grade(task, wrong, []),
    }
    assert list(cases) == list(OUTCOMES)
    for kind, out in cases.items():
        assert [k for k in OUTCOMES if out.metrics[f"outcome/{k}"] == 1.0] == [kind], (kind, out.metrics)
        assert sum(out.metrics[f"outcome/{k}"] for k in OUTCOMES) == 1.0
    values = [v1, v2, v3]
    assert outcome(False, values, [v1], 1) == "stopped_early"  # the first step only, then an answer
    assert outcome(False, values, [v2], 1) == outcome(False, values, [v1, "12", v2], 3) == "partial"  # off order


def _replies(demo: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in demo["messages"] if m["role"] == "assistant"]


def test_a_demonstration_is_the_chain_and_scores_the_top_of_the_scale():
    for task in make_tasks("multi_calc", 12, split="demo"):
        demo = demonstration(task)
        assert demo is not None and demo["tools"][0]["function"]["name"] == "calculator"
        calls = [m for m in _replies(demo) if m.get("tool_calls")]
        assert len(calls) == len(task.meta["steps"])
        tool_results = [m["content"] for m in demo["messages"] if m["role"] == "tool"]
        assert tool_results == [str(v) for v in task.meta["values"]]
        assert demo["messages"][-1] == {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}
        # replaying the demonstrated calls through the task's own tool and grader gives the best reward
        results = [run_tool_call("calculator", m["tool_calls"][0]["function"]["arguments"]) for m in calls]
        assert all(ok for _, ok in results)
        assert grade(task, demo["messages"][-1]["content"], [r for r, _ in results]).reward == pytest.approx(
            1.0 + STEP_CREDIT + TOOL_CREDIT)


def test_step_notes_number_each_demonstrated_call_and_the_prompt_asks_for_them():
    plain = make_tasks("multi_calc", 6, split="demo")
    noted = make_tasks("multi_calc", 6, split="demo", options={"step_notes": True})
    for a, b in zip(plain, noted, strict=True):
        assert a.meta["steps"] == b.meta["steps"] and a.messages[1] == b.messages[1]  # same problems
        assert b.messages[0]["content"].endswith("Before each call, write which step it is: Step k of n.")
        assert "Step k" not in a.messages[0]["content"]
        n = len(b.meta["steps"])
        notes = [m["content"] for m in _replies(demonstration(b)) if m.get("tool_calls")]
        assert notes == [f"Step {k} of {n}." for k in range(1, n + 1)]
        assert all(m["content"] is None for m in _replies(demonstration(a)) if m.get("tool_calls"))


def test_an_episode_runs_the_chain_through_the_chat_endpoint():
    """The client loop against a scripted endpoint that plays the demonstration, turn by turn."""
    task = make_tasks("multi_calc", 1, split="eval", options={"min_steps": 3})[0]
    script = _replies(demonstration(task))
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        assert body["tools"][0]["function"]["name"] == "calculator"
        return httpx.Response(200, json={"choices": [{"message": script[len(seen) - 1]}]})

    with httpx.Client(transport=httpx.MockTransport(handler)) as http:
        out = run_task(http, "http://swarm/v1", "key", task, max_tokens=48, temperature=0.0)
    assert len(seen) == 4  # three calls, then the answer
    assert out.metrics["correct"] == 1.0 and out.metrics["chain"] == 1.0 and out.metrics["tool_calls"] == 3.0
    assert out.reward == pytest.approx(1.0 + STEP_CREDIT + TOOL_CREDIT)
    assert [m["content"] for m in seen[-1]["messages"] if m["role"] == "tool"] == [
        str(v) for v in task.meta["values"]]
