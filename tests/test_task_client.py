"""The built-in client's loops survive an agent's own errors: counted, never fatal."""

from __future__ import annotations

import itertools

from swarmkit.apps.task_client import EpisodeLoop, evaluate
from swarmkit.tasks import make_tasks


class Flaky(EpisodeLoop):
    def __init__(self, **kw):
        super().__init__(make_tasks("calc_agent", 4), rollouts_per_task=1, concurrency=1, max_episodes=3, **kw)
        self.calls = itertools.count()

    def run_one(self, task, http):
        if next(self.calls) < 2:
            raise TypeError("calculator() got an unexpected keyword argument 'name'")  # an agent framework's error
        return task.task_id


def test_an_agent_error_is_counted_and_the_loop_keeps_sampling():
    loop = Flaky()
    loop.run()
    assert (loop.failures, loop.finished) == (2, 3)
    assert "TypeError" in loop.last_error


def test_a_failed_eval_episode_scores_zero_and_is_counted():
    class Broken:  # a client whose episodes cannot even be registered
        def episode(self, *a, **k):
            raise RuntimeError("boom")

    result = evaluate(Broken(), make_tasks("calc_agent", 3), max_tokens=8, concurrency=2)
    assert (result.n, result.failures, result.mean) == (3, 3, 0.0)
    assert "3 failed" in str(result)


def test_the_loop_stops_quietly_when_the_server_finished_training(caplog):
    from swarmkit.client import SwarmAPIError

    class Finished(EpisodeLoop):
        def __init__(self):
            super().__init__(make_tasks("calc_agent", 4), rollouts_per_task=1, concurrency=1, max_episodes=50)
            self.calls = itertools.count()

        def run_one(self, task, http):
            if next(self.calls) >= 2:
                raise SwarmAPIError(409, "training finished: trainer.total_steps=2 reached", "training_finished")
            return task.task_id

    loop = Finished()
    loop.run()  # returns: the step limit ends sampling
    assert (loop.finished, loop.failures) == (2, 0)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_built_in_client_reports_the_tasks_metrics_to_the_server(serve_tiny_hf, tmp_path):
    """The main job's episodes carry their task's numbers (``valid_tool_call``, ``outcome/<kind>``, ...) as
    ``meta["metrics"]``, which become the server's per-step ``task/<name>`` signals (the collapse alarm's
    ``validity_metric``): before, the built-in tasks computed them and kept them on the client."""
    from swarmkit.apps.task_client import run_episode
    from swarmkit.swarm.collapse import task_metrics

    task = make_tasks("multi_calc", 1, split="eval", options={"max_steps": 2})[0]
    with serve_tiny_hf(tmp_path / "run", "metrics-admin-token") as (handle, client):
        result = run_episode(client, task, max_tokens=8, temperature=1.0)
        record = handle.swarm.cycle.pool.get(result.episode_id)
    assert record.meta["metrics"] == result.metrics
    signals = task_metrics([record])
    assert signals["task/valid_tool_call"] == result.metrics["valid_tool_call"]
    assert sum(v for k, v in signals.items() if k.startswith("task/outcome/")) == 1.0


def test_outcomes_are_counted_commonest_first():
    from swarmkit.apps.task_client import EvalResult, count_outcomes

    metrics = [{"outcome/overshoot": 1.0, "outcome/right": 0.0, "correct": 0.0},
               {"outcome/right": 1.0, "outcome/overshoot": 0.0}, {"outcome/overshoot": 1.0}, {"correct": 1.0}]
    assert count_outcomes(metrics) == {"overshoot": 2, "right": 1}
    assert list(count_outcomes([{"outcome/b": 1.0}, {"outcome/a": 1.0}])) == ["a", "b"]  # ties by name
    assert str(EvalResult(0.5, 0.1, 3, outcomes={"overshoot": 2, "right": 1})).endswith("; ended: overshoot 2, right 1")
    assert "ended" not in str(EvalResult(0.5, 0.1, 3))


def test_an_evaluation_says_how_each_held_out_episode_ended(serve_tiny_hf, tmp_path):
    """multi_calc's eval names each episode's ending (``outcome/<kind>``), so an evaluation after a warm start
    tells an overshooting policy from one that never finishes the chain, in the console and summary.json."""
    tasks = make_tasks("multi_calc", 3, split="eval", options={"max_steps": 2})
    with serve_tiny_hf(tmp_path / "run", "outcomes-admin-token") as (_, client):
        result = evaluate(client, tasks, max_tokens=8, concurrency=2)
    assert sum(result.outcomes.values()) == result.n == 3
    assert "; ended: " in str(result)
    assert result.groups and sum(n for _, _, n in result.groups.values()) == 3  # "2 steps", "3 steps" of the items
    assert set(result.groups) <= {"2 steps", "3 steps"} and "; 2 steps: " in str(result)


def test_held_out_reward_per_group():
    """An uneven mix hides a weak group: 13 two-step problems right and 3 three-step ones wrong read 0.81."""
    from swarmkit.apps.task_client import EvalResult, group_means

    groups = group_means(["2 steps"] * 13 + ["3 steps"] * 3 + [None], [1.0] * 13 + [0.0] * 3 + [0.5])
    assert groups == {"2 steps": (1.0, 0.0, 13), "3 steps": (0.0, 0.0, 3)}
    text = str(EvalResult(0.81, 0.2, 16, groups=groups))
    assert "; 2 steps: 1.000 ± 0.000 (n=13); 3 steps: 0.000 ± 0.000 (n=3)" in text


def test_demonstrations_reach_the_server_in_order_whatever_each_request_takes():
    """The warm start is the same run after run only if the pool receives the demonstrations in the same
    order (the batching policy takes the oldest complete groups): by default they go one after another."""
    import random
    import threading
    import time

    from swarmkit.apps.task_client import send_demonstrations

    class Recording:  # the SDK's episode surface, each report taking a random while
        def __init__(self):
            self.reports, self.lock = [], threading.Lock()

        def episode(self, *, task_id, meta, adapter=None):
            rec = self

            class Ep:
                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    return False

                def demonstrate(self, messages, tools=None):
                    pass

                def report(self, reward):
                    time.sleep(random.uniform(0, 0.01))
                    with rec.lock:
                        rec.reports.append((task_id, meta["demo_of"]))
                    return {"accepted": True}
            return Ep()

    tasks = make_tasks("calc_agent", 16, split="demo")
    client = Recording()
    assert send_demonstrations(client, tasks, group_size=4) == 16
    assert client.reports == [(f"demo-{k // 4}", t.task_id) for k, t in enumerate(tasks)]
