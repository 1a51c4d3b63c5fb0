"""Asynchronous training's bookkeeping: per-token policy versions through capture, merging, the
journal and samples; the staleness bound (admission arithmetic and the trainer's enforcement)."""

from __future__ import annotations

import json

import pytest

from swarmkit.contract import GenerationOutput, StreamChunk, TrainSample
from swarmkit.pool import SamplePool
from swarmkit.pool.records import EpisodeRecord
from swarmkit.swarm.staleness import admission_capacity, admits, holds_step, steps_within_bound
from swarmkit.timelines import Block, Timeline, merge, merge_timelines_reference
from swarmkit.training.samples import bound_staleness, build_samples
from swarmkit.training.trainer import build_algo


def U(text, ids):
    return Block("user", text, ids)


def H(text, ids):
    return Block("history", text, ids)


def L(text, ids, versions, lp=-0.5):
    return Block("llm", text, ids, [lp] * len(ids), versions=versions)


def partial_episode():
    """Three calls; the second answer spans a weight swap (versions 3 then 4): a partial rollout."""
    t1 = [U("q", [1]), L("a1", [10, 11], [3, 3])]
    t2 = [U("q", [1]), H("a1", [10, 11]), U("q2", [2]), L("a2", [20, 21, 22], [3, 4, 4])]
    t3 = [U("q", [1]), H("a1", [10, 11]), U("q2", [2]), H("a2", [20, 21, 22]), U("q3", [3]),
          L("a3", [30], [5])]
    return [Timeline(t, role="r") for t in (t1, t2, t3)]


# --------------------------------------------------------------------------- per-token versions
def test_generation_outputs_report_a_version_per_token():
    whole = GenerationOutput([1, 2, 3], [0.0] * 3, "x", "stop", policy_version=7)
    assert whole.versions() == [7, 7, 7]
    partial = GenerationOutput([1, 2, 3], [0.0] * 3, "x", "stop", policy_version=7, token_versions=[7, 8, 8])
    assert partial.versions() == [7, 8, 8]
    with pytest.raises(ValueError, match="2 token versions for 3 tokens"):
        GenerationOutput([1, 2, 3], [0.0] * 3, "x", "stop", token_versions=[1, 2]).versions()
    assert StreamChunk([5, 6], [0.0, 0.0], "y").versions(4) == [4, 4]
    assert StreamChunk([5, 6], [0.0, 0.0], "y", token_versions=[4, 5]).versions(4) == [4, 5]


def test_a_block_checks_its_versions_and_keeps_them_through_json():
    with pytest.raises(ValueError, match="1 versions"):
        Block("llm", "ab", [1, 2], versions=[3])
    b = L("ab", [1, 2], [3, 4])
    assert Block.from_dict(json.loads(json.dumps(b.to_dict()))) == b
    assert "versions" not in U("q", [1]).to_dict()  # prompt blocks carry none
    assert Timeline([U("q", [1]), b]).versions(default=9) == [9, 3, 4]


@pytest.mark.parametrize("method", ["fast", "reference"])
@pytest.mark.parametrize("match", ["text", "token"])
def test_merging_keeps_each_generated_token_with_its_own_version(method, match):
    result = merge(partial_episode(), match, method=method)
    assert result.survivors == [2]
    (sample,) = result.timelines
    assert sample.token_ids() == [1, 10, 11, 2, 20, 21, 22, 3, 30]
    assert sample.loss_mask() == [0, 1, 1, 0, 1, 1, 1, 0, 1]
    versions = sample.versions(default=-1)
    trained = [v for v, m in zip(versions, sample.loss_mask(), strict=True) if m]
    assert trained == [3, 3, 3, 4, 4, 5]  # never mixed up, never replaced by the episode's version


def test_merging_never_takes_versions_from_another_call():
    """Two calls answered the same text under different versions: a later history block absorbs
    the call it repeats (the longest prefix), never the other one's versions."""
    t1 = [U("q", [1]), L("a", [10], [1])]
    t2 = [U("q", [1]), L("a", [10], [2])]  # a retry of the same call under newer weights
    t3 = [U("q", [1]), H("a", [10]), U("q2", [2]), L("b", [20], [2])]
    out = merge_timelines_reference([Timeline(t) for t in (t1, t2, t3)], "token")
    absorbed = [tl for tl in out if len(tl.blocks) == 4]
    assert absorbed and absorbed[0].blocks[1].versions in ([1], [2])
    survivors = merge([Timeline(t) for t in (t1, t2, t3)], "token")
    # every surviving generated token keeps a version that some call really sampled it with
    for tl in survivors.timelines:
        for blk in tl.blocks:
            if blk.author == "llm":
                assert blk.versions is not None and set(blk.versions) <= {1, 2}


def test_versions_survive_the_journal_and_reach_the_samples(tmp_path):
    pool = SamplePool(tmp_path / "journal.sqlite")
    for i, reward in enumerate((1.0, 0.0)):
        pool.add(EpisodeRecord(episode_id=f"e{i}", task_id="t", client_id="c", reward=reward,
                               timelines=[tl.to_dict() for tl in partial_episode()], policy_version=3,
                               task_family="", meta={}))
    pool.close()
    pool = SamplePool(tmp_path / "journal.sqlite")  # a restarted server reads them back
    records = pool.take([e.episode_id for e in pool.view()])
    samples = build_samples(records, build_algo({"name": "grpo"}), "token")
    assert len(samples) == 2
    for s in samples:
        trained = [v for v, m in zip(s.token_versions(), s.loss_mask, strict=True) if m]
        assert trained == [3, 3, 3, 4, 4, 5]
    assert TrainSample.from_dict(samples[0].to_dict()).versions == samples[0].versions
    pool.close()


def test_old_records_without_versions_fall_back_to_the_episode_version():
    tl = Timeline([U("q", [1]), Block("llm", "a", [10, 11], [-0.1, -0.1])])
    rec = EpisodeRecord(episode_id="e", task_id="t", client_id="c", reward=1.0, timelines=[tl.to_dict()],
                        policy_version=6, task_family="", meta={})
    (s,) = build_samples([rec, rec], build_algo({"name": "grpo"}), "token")[:1]
    assert s.token_versions() == [6, 6, 6]


# --------------------------------------------------------------------------- the bound
def sample(versions, mask):
    n = len(versions)
    return TrainSample(input_ids=list(range(n)), loss_mask=list(mask), old_logprobs=[0.0] * n,
                       advantages=[1.0 if m else 0.0 for m in mask], versions=list(versions))


def test_bound_staleness_measures_and_enforces_the_bound():
    a = sample([0, 2, 2, 3, 4], [0, 1, 1, 1, 1])  # a partial rollout: versions 2, 3 and 4
    b = sample([0, 1, 1], [0, 1, 1])
    stats = bound_staleness([a, b], current_version=4)  # measured only
    assert stats["staleness_max"] == 3.0 and stats["stale_tokens_dropped"] == 0.0
    assert stats["staleness_mean"] == pytest.approx((2 + 2 + 1 + 0 + 3 + 3) / 6)
    assert stats["partial_rollouts"] == 1.0  # a (versions 2, 3, 4); b has one version
    stats = bound_staleness([a, b], current_version=4, max_staleness=2)
    assert a.loss_mask == [0, 1, 1, 1, 1] and a.advantages[1:] == [1.0] * 4
    assert b.loss_mask == [0, 0, 0] and b.advantages == [0.0, 0.0, 0.0]
    assert stats["stale_tokens_dropped"] == 2.0 and stats["stale_samples"] == 1.0
    assert stats["staleness_max"] == 2.0


def test_demonstrations_have_no_staleness():
    d = sample([0, 0], [0, 1])
    d.demonstration = True
    assert bound_staleness([d], current_version=10, max_staleness=0)["stale_tokens_dropped"] == 0.0
    assert d.loss_mask == [0, 1]


@pytest.mark.parametrize(("served", "step", "training", "eta", "steps"), [
    (0, 0, False, 0, 1),   # eta 0, idle: one batch in flight, as in sync training
    (0, 0, True, 0, 0),    # eta 0, a step under way: new episodes wait for its weights
    (0, 0, False, 2, 3),
    (0, 0, True, 2, 2),
    (5, 5, True, 1, 1),
    (4, 5, False, 1, 1),   # the trainer is ahead of the engine (weights being pushed)
    (3, 5, True, 1, 0),
])
def test_admission_arithmetic(served, step, training, eta, steps):
    assert steps_within_bound(served, step, training, eta) == steps
    assert admission_capacity(served, step, training, eta, 8) == 8 * steps


def test_admitted_episodes_are_trained_within_the_bound_when_batches_go_in_order():
    """Simulate the pacing: episodes start while room is left, batches of B go oldest first, one
    step at a time; every token of every trained episode is within eta of the weights updated."""
    for eta in (0, 1, 2, 4):
        B = 4
        served = step = 0
        waiting: list[int] = []  # the start version of each episode in flight, oldest first
        worst = 0
        for _ in range(40):
            # admit as many as the bound allows with no step under way
            while len(waiting) < admission_capacity(served, step, False, eta, B):
                waiting.append(served)
            # the step starts on the oldest batch; meanwhile episodes start under the running step
            batch, waiting = waiting[:B], waiting[B:]
            while len(waiting) < admission_capacity(served, step, True, eta, B):
                waiting.append(served)
            worst = max(worst, max(step - v for v in batch))
            step += 1
            served = step
        assert worst <= eta


@pytest.mark.parametrize(("weights", "oldest", "eta", "hold"), [
    (5, None, 0, False),  # nothing running has generated yet
    (5, 5, 0, True),      # eta 0: a step would make any running token stale
    (5, 5, 1, False),
    (5, 4, 1, True),      # trained at the earliest by the step after: (5 + 1) - 4 = 2 > 1
    (5, 4, 2, False),
    (5, 2, 4, False),
])
def test_a_step_waits_for_a_straggler_it_would_push_past_the_bound(weights, oldest, eta, hold):
    assert holds_step(weights, oldest, eta) is hold


@pytest.mark.parametrize(("kw", "admitted"), [
    ({"in_flight": 7, "capacity": 8}, True),
    ({"in_flight": 8, "capacity": 8}, False),
    ({"in_flight": 4, "capacity": 8, "group_size": 4}, True),                  # a new group fits whole
    ({"in_flight": 5, "capacity": 8, "group_size": 4}, False),                 # ... or waits
    ({"in_flight": 8, "capacity": 8, "siblings": 2, "group_size": 4}, True),   # completes a group under way
    ({"in_flight": 8, "capacity": 8, "siblings": 4, "group_size": 4}, False),  # a whole new group waits
    ({"in_flight": 8, "capacity": 8, "training": False, "running": 0}, True),  # only the pool waits: no deadlock
    ({"in_flight": 8, "capacity": 0, "training": True, "running": 0}, False),
])
def test_admission_keeps_groups_whole_and_never_deadlocks(kw, admitted):
    assert admits(**kw) is admitted
