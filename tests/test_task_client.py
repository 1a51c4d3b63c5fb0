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
