"""Metrics per task family (cocktail training): rewards, episodes, trained tokens and eval rewards."""

from __future__ import annotations

import pytest

from swarmkit.pool.records import EpisodeRecord
from swarmkit.swarm.families import EvalTally, step_family_metrics


def _tl(mask):
    return {"blocks": [{"author": "user", "loss_mask": [0] * 3}, {"author": "llm", "loss_mask": mask}]}


def _rec(fam, reward, mask, demo=False):
    return EpisodeRecord(episode_id="e", task_id="t", client_id="c", reward=reward, timelines=[_tl(mask)],
                         policy_version=0, task_family=fam, meta={"demonstration": True} if demo else {})


def test_each_family_gets_its_reward_episodes_and_trained_tokens():
    m = step_family_metrics([
        _rec("calc_agent", 1.0, [1, 1, 0]), _rec("calc_agent", 0.0, [1]),
        _rec("who_is_spy", {"civilian": 1.0, "spy": 0.0}, [1, 1, 1, 1]),
        _rec("calc_agent", 1.0, [1, 1], demo=True), _rec("", 0.5, [1]),
    ])
    assert m["reward_mean/calc_agent"] == 0.5 and m["episodes/calc_agent"] == 2
    assert m["tokens/calc_agent"] == 5 and m["demonstrations/calc_agent"] == 1
    assert m["reward_mean/who_is_spy"] == 0.5 and m["episodes/who_is_spy"] == 1 and m["tokens/who_is_spy"] == 4
    assert m["reward_mean/who_is_spy/civilian"] == 1.0 and m["reward_mean/who_is_spy/spy"] == 0.0
    assert "episodes/who_is_spy/civilian" not in m
    assert m["reward_mean/default"] == 0.5


def test_eval_rewards_are_tallied_between_steps():
    t = EvalTally()
    t.add("calc_agent", 1.0)
    t.add("calc_agent", 0.0)
    t.add("who_is_spy", {"civilian": 0.0, "spy": 1.0})
    m = t.take()
    assert m == pytest.approx({"eval_reward/calc_agent": 0.5, "eval_episodes/calc_agent": 2,
                               "eval_reward/who_is_spy": 0.5, "eval_episodes/who_is_spy": 1,
                               "eval_reward/who_is_spy/civilian": 0.0, "eval_reward/who_is_spy/spy": 1.0})
    assert t.take() == {}
