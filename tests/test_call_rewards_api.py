"""Per-call rewards through the report API and the SDK: validation, storage in the calls' meta, the journal."""

from __future__ import annotations

import json

import pytest

from swarmkit.client._common import call_rewards_items
from swarmkit.pool import SamplePool
from swarmkit.swarm.cycle import pool_record
from swarmkit.training import build_samples
from swarmkit_plugins.algo_rl.turn import TurnGRPO
from tests.test_server_api import assert_error


def _end(h, ep, body, key=None, what="report"):
    # NaN and Infinity as Python's json writes them (a client in another language may send them too)
    return h.tc.post(f"/api/v1/episodes/{ep['episode_id']}/{what}", content=json.dumps(body),
                     headers={"Authorization": f"Bearer {key or ep['api_key']}", "Content-Type": "application/json"})


def _generated(tl) -> int:
    return sum(len(b) for b in tl.blocks if b.author == "llm")


def test_call_rewards_and_advantages_are_stored_on_their_calls(make):
    h = make()
    ep = h.register(task_id="t")
    for _ in range(3):
        assert h.chat(ep["api_key"]).status_code == 200
    tls = h.srv.episodes.get(ep["episode_id"]).timelines
    adv = [0.25] * _generated(tls[2])
    r = _end(h, ep, {"reward": 1.0, "call_rewards": [{"turn": 1, "reward": 0.5}, {"call": 2, "advantages": adv}]})
    assert r.status_code == 200, r.text
    got = h.accepted[0].timelines
    assert "call_reward" not in got[0].meta and got[1].meta["call_reward"] == 0.5
    assert got[2].meta["call_advantages"] == adv


BAD = [
    ({"call": 7, "reward": 1.0}, "no recorded call 7"),
    ({"turn": 2, "reward": 1.0}, "no turn 2"),
    ({"call": 0, "turn": 0, "reward": 1.0}, "exactly one of 'call'"),
    ({"call": 0}, "exactly one of 'reward'"),
    ({"call": 0, "reward": 1.0, "advantages": [0.0]}, "exactly one of 'reward'"),
    ({"call": 0, "reward": float("nan")}, "finite"),
    ({"call": 0, "reward": float("inf")}, "finite"),
    ({"call": 0, "reward": "1"}, "must be a number"),
    ({"call": 0, "reward": 1e9}, "max_abs_reward"),
    ({"call": 0, "advantages": [0.0]}, "generated"),
    ({"call": -1, "reward": 1.0}, "integer >= 0"),
    ({"call": 0, "reward": 1.0, "weight": 2}, "unknown field"),
    ({"role": "spy", "turn": 0, "reward": 1.0}, "unknown role"),
    ({"call": 0, "role": "spy", "reward": 1.0}, "'role' goes with 'turn'"),
    ({"call": 0, "choice": 3, "reward": 1.0}, "no choice 3"),
]


@pytest.mark.parametrize("item,message", BAD, ids=[m for _, m in BAD])
def test_bad_call_rewards_are_refused_and_the_episode_stays_open(make, item, message):
    h = make()
    ep = h.register(task_id="t")
    h.chat(ep["api_key"])
    h.chat(ep["api_key"])
    r = _end(h, ep, {"reward": 1.0, "call_rewards": [item]})
    assert_error(r, 422, "invalid_call_reward")
    assert message in r.json()["error"]["message"] and "call_rewards[0]" in r.json()["error"]["message"]
    assert not h.accepted
    assert _end(h, ep, {"reward": 1.0}).status_code == 200  # nothing was stored by the refused report
    assert all("call_reward" not in t.meta for t in h.accepted[0].timelines)


def test_a_call_named_twice_or_a_list_that_is_not_one_is_refused(make):
    h = make()
    ep = h.register(task_id="t")
    h.chat(ep["api_key"])
    assert_error(_end(h, ep, {"reward": 1.0, "call_rewards": [{"call": 0, "reward": 1.0}, {"turn": 0, "reward": 0.0}]}),
                 422, "invalid_call_reward")
    assert_error(_end(h, ep, {"reward": 1.0, "call_rewards": {"0": 1.0}}), 422, "invalid_call_reward")


def test_turns_count_per_role_and_roles_must_be_named(make):
    h = make()
    ep = h.register(task_id="g", roles=["wolf", "seer"])
    h.chat(ep["keys"]["wolf"])
    h.chat(ep["keys"]["seer"])
    h.chat(ep["keys"]["seer"])
    reward = {"wolf": 1.0, "seer": 0.0}
    r = _end(h, ep, {"reward": reward, "call_rewards": [{"turn": 0, "reward": 1.0}]})
    assert_error(r, 422, "invalid_call_reward")
    assert "name the 'role'" in r.json()["error"]["message"]
    r = _end(h, ep, {"reward": reward, "call_rewards": [{"role": "seer", "turn": 1, "reward": -1.0}]})
    assert r.status_code == 200, r.text
    tls = h.accepted[0].timelines
    assert [t.meta.get("call_reward") for t in tls] == [None, None, -1.0]  # the seer's 2nd call is call 2


def test_an_episode_credit_algorithm_refuses_call_rewards_on_a_training_server(make, monkeypatch):
    h = make()
    ep = h.register(task_id="t")
    h.chat(ep["api_key"])
    monkeypatch.setattr(h.srv, "cycle", object())  # a server that trains (not the in-memory stand-in)
    r = _end(h, ep, {"reward": 1.0, "call_rewards": [{"call": 0, "reward": 1.0}]})
    assert_error(r, 422, "unsupported_field")
    assert "algo=turn_grpo" in r.json()["error"]["message"] and "algo=grpo" in r.json()["error"]["message"]
    h.srv.config.algo = {"name": "turn_grpo"}
    h.srv.check_call_rewards(h.srv.episodes.get(ep["episode_id"]))  # per-turn credit: accepted


def test_the_sdk_turns_turn_rewards_into_call_reward_items():
    items = call_rewards_items([None, 1.0, 0.0], [{"call": 5, "advantages": [0.1]}])
    assert items == [{"turn": 1, "reward": 1.0}, {"turn": 2, "reward": 0.0}, {"call": 5, "advantages": [0.1]}]
    assert call_rewards_items({"spy": [0.5]}, None) == [{"role": "spy", "turn": 0, "reward": 0.5}]
    with pytest.raises(TypeError):
        call_rewards_items(1.0, None)  # type: ignore[arg-type]


def test_call_rewards_survive_the_journal_across_a_restart_and_reach_the_advantages(make, tmp_path):
    h = make()
    eps = [h.register(task_id="t") for _ in range(2)]
    for ep, r in zip(eps, (1.0, 0.0), strict=True):
        h.chat(ep["api_key"])
        h.chat(ep["api_key"], messages=[{"role": "user", "content": "again"}])
        assert _end(h, ep, {"reward": 0.0, "call_rewards": [{"turn": 0, "reward": r}]}).status_code == 200
    path = tmp_path / "j.sqlite"
    pool = SamplePool(path)
    for ep in h.accepted:
        pool.add(pool_record(ep))
    pool.close()
    pool = SamplePool(path)  # a fresh process would open the same file
    records = pool.untrained()
    pool.close()
    assert [t["meta"].get("call_reward") for r in records for t in r.timelines] == [1.0, None, 0.0, None]
    samples = build_samples(records, TurnGRPO(std_normalize=False), "text")
    by_episode: dict[str, set[float]] = {}
    for s in samples:
        by_episode.setdefault(s.episode_id, set()).update(
            a for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)
    first, second = (by_episode[e["episode_id"]] for e in eps)
    assert 1.0 in first and -1.0 in second  # call 0's reward, against the other rollout's call 0
    assert 0.0 in first and 0.0 in second   # call 1 (no reward of its own, nothing after it)
