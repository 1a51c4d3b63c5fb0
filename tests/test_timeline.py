"""Blocks, timelines and hand-worked merge cases."""

from __future__ import annotations

import copy
import json

import pytest

from swarmkit.errors import UnknownComponentError
from swarmkit.timelines import (
    Block,
    Timeline,
    merge,
    merge_timelines,
    merge_timelines_reference,
    resolve_match,
)


def U(text, ids):
    return Block("user", text, ids)


def H(text, ids):
    return Block("history", text, ids)


def L(text, ids, lp=-0.5):
    return Block("llm", text, ids, [lp] * len(ids))


# --------------------------------------------------------------------------- Block
def test_block_defaults_and_flatten():
    b = L("ab", [1, 2])
    assert b.loss_mask == [1, 1] and b.logprobs == [-0.5, -0.5] and b.trainable
    u = Block("env", "x", (7,))
    assert u.token_ids == [7] and u.loss_mask == [0] and u.logprobs == [0.0] and not u.trainable
    t = Timeline([u, b], role="solver", meta={"episode": "e1"})
    assert t.token_ids() == [7, 1, 2]
    assert t.loss_mask() == [0, 1, 1]
    assert t.logprobs() == [0.0, -0.5, -0.5]
    assert t.num_tokens() == 3 and t.num_trainable_tokens() == 2 and len(t) == 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(author="robot", text="", token_ids=[]), "unknown block author"),
        (dict(author="llm", text="a", token_ids=[1, 2], logprobs=[0.0]), "lengths differ"),
        (dict(author="llm", text="a", token_ids=[1], loss_mask=[1, 1]), "lengths differ"),
        (dict(author="llm", text="a", token_ids=[1], loss_mask=[2]), "0 or 1"),
        (dict(author="user", text="a", token_ids=[1], loss_mask=[1]), "only 'llm'"),
        (dict(author="user", text=3, token_ids=[1]), "must be a str"),
    ],
)
def test_block_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Block(**kwargs)


def test_json_round_trip():
    t = Timeline([U("hi", [1]), Block("template", "", []), L("yo", [2, 3], -1.25)], role="r", meta={"k": [1, 2]})
    text = json.dumps(t.to_dict())
    back = Timeline.from_dict(json.loads(text))
    assert back == t
    assert back.blocks[2].logprobs == [-1.25, -1.25]
    assert Block.from_dict(json.loads(json.dumps(t.blocks[0].to_dict()))) == t.blocks[0]


# --------------------------------------------------------------------------- merge
def episode():
    """Three calls of one episode, the later ones re-render earlier completions as history."""
    t1 = [U("sys", [1]), U("q", [2]), L("a1", [10, 11], -0.1)]
    t2 = [U("sys", [1]), U("q", [2]), H("a1", [12]), U("q2", [3]), L("a2", [20], -0.2)]
    t3 = [U("sys", [1]), U("q", [2]), H("a1", [12]), U("q2", [3]), H("a2", [20]), U("q3", [4]),
          L("a3", [30], -0.3)]
    return [t1, t2, t3]


@pytest.mark.parametrize("impl", [merge_timelines, merge_timelines_reference])
def test_text_merges_and_takes_generated_tokens(impl):
    ts = episode()
    before = copy.deepcopy(ts)
    out = impl(ts, "text")
    assert ts == before  # inputs untouched
    assert len(out) == 1
    s = out[0]
    assert [b.author for b in s] == ["user", "user", "llm", "user", "llm", "user", "llm"]
    assert s[2].token_ids == [10, 11] and s[2].logprobs == [-0.1, -0.1] and s[2].loss_mask == [1, 1]
    assert s[4].token_ids == [20] and s[4].loss_mask == [1]
    assert isinstance(out[0], list)


def test_token_keeps_drifted_history_separate():
    # a1 was re-tokenized differently ([12] vs [10, 11]): t1 survives; t2 still merges into t3
    r = merge(episode(), "token")
    assert r.survivors == [0, 2]
    assert r.absorbed_into == [None, 2, None]
    assert r.timelines[1][4].author == "llm"
    assert r.timelines[1][2].author == "history"


def test_drifted_blocks_count_what_the_text_match_traded():
    from swarmkit.timelines.merging import drifted_blocks

    ts = episode()
    assert drifted_blocks(ts, merge(ts, "text")) == 1  # a1: the same text, re-tokenized as [12]
    assert drifted_blocks(ts, merge(ts, "token")) == 0  # the token match keeps it apart instead


def test_build_samples_reports_the_merge_rate():
    from swarmkit.pool.records import EpisodeRecord
    from swarmkit.training.samples import build_samples
    from swarmkit.training.trainer import build_algo

    algo = build_algo({"name": "grpo"})
    recs = [EpisodeRecord(episode_id=f"e{i}", task_id="t", reward=float(i), timelines=[Timeline(b) for b in episode()],
                          policy_version=0, meta={}, client_id="c") for i in range(2)]
    for match, absorbed, drifted in (("text", 2, 1), ("token", 1, 0)):
        stats: dict[str, int] = {}
        build_samples(recs, algo, match, stats=stats)
        assert stats == {"timelines": 6, "groups": 2, "absorbed": 2 * absorbed, "drifted_blocks": 2 * drifted}


def test_order_and_which_absorbs_which():
    a = [U("x", [1]), L("g", [5], -1.0)]
    b = [U("x", [1]), L("g", [6], -2.0)]  # same text, other tokens
    c = [U("x", [1]), H("g", [7]), U("y", [2])]
    d = [U("z", [9])]
    r = merge([a, b, c, d], "text")
    ref = merge([a, b, c, d], "text", method="reference")
    assert r == ref
    # walk: i=3 (d) absorbs nothing; i=2 (c) absorbs b first (j=1), then a (j=0)
    assert r.survivors == [2, 3]
    assert r.absorbed_into == [2, 2, None, None]
    # block 1 took b's tokens (b was visited first); a's llm block found it already 'llm'
    assert r.timelines[0][1].token_ids == [6] and r.timelines[0][1].logprobs == [-2.0]


def test_shorter_later_timeline_does_not_absorb_longer():
    long_ = [U("x", [1]), L("g", [5])]
    short = [U("x", [1])]
    r = merge([long_, short], "text")
    assert r.survivors == [0, 1]
    # reversed order: the later long one absorbs the short earlier one
    assert merge([short, long_], "text").survivors == [1]


def test_empty_timelines_are_absorbed():
    r = merge([[], [U("x", [1])], []], "text")
    assert r.absorbed_into == [2, None, None]
    assert r == merge([[], [U("x", [1])], []], "text", method="reference")


def test_llm_into_llm_is_not_overwritten():
    a = [U("x", [1]), L("g", [5], -1.0)]
    b = [U("x", [1]), L("g", [5], -3.0)]
    out = merge_timelines([a, b], "token")
    assert len(out) == 1 and out[0][1].logprobs == [-3.0]


def test_timeline_objects_keep_role_and_meta():
    ts = [Timeline(t, role="solver", meta={"call": i}) for i, t in enumerate(episode())]
    out = merge_timelines(ts)
    assert len(out) == 1 and isinstance(out[0], Timeline)
    assert out[0].role == "solver" and out[0].meta == {"call": 2}
    assert out[0] is not ts[2] and ts[2].blocks[2].author == "history"


def test_match_by_object_and_unknown_name():
    strat = resolve_match("token")
    assert merge_timelines(episode(), strat) == merge_timelines(episode(), "token")
    with pytest.raises(UnknownComponentError):
        merge_timelines(episode(), "no-such-strategy")
    with pytest.raises(TypeError):
        merge_timelines(episode(), object())


class FlipKey:
    """A strategy whose key of a block changes when absorption turns it 'llm'."""

    stable_keys = False  # the key reads the author, which absorption changes
    key_field = None

    def key(self, block):
        return block.text if block.author != "llm" else block.text[::-1]


def test_key_changing_strategy_matches_reference():
    # t2[1] 'ab' (history) matches t1[1] 'ba' (llm, key 'ab'); once absorbed, t2[1]'s key is 'ba',
    # so t0 (whose block 1 'ab' is history) no longer matches t2 although it did before.
    t0 = [U("s", [1]), H("ab", [2])]
    t1 = [U("s", [1]), L("ba", [3])]
    t2 = [U("s", [1]), H("ab", [4]), U("q", [5])]
    r = merge([t0, t1, t2], FlipKey())
    assert r == merge([t0, t1, t2], FlipKey(), method="reference")
    assert r.absorbed_into == [None, 2, None]
    # t0 is visited before the update when it comes later: it is absorbed
    r2 = merge([t1, t0, t2], FlipKey())
    assert r2 == merge([t1, t0, t2], FlipKey(), method="reference")
    assert r2.absorbed_into == [2, 2, None]


def test_unknown_method():
    with pytest.raises(ValueError):
        merge([], "text", method="quadratic")


def test_a_call_under_constrained_decoding_is_rescored_by_the_trainer():
    """Under a grammar (response_format) vLLM reports the masked distribution's logprobs: the
    sample's generated positions get NaN, which the engine fills with the policy's own."""
    import math

    from swarmkit.pool.records import EpisodeRecord
    from swarmkit.training.samples import build_samples
    from swarmkit.training.trainer import build_algo

    plain = Timeline([U("q", [1, 2]), L("a", [3, 4], lp=-0.3)], None, {})
    forced = Timeline([U("q", [1, 5]), L("{}", [6, 7], lp=0.0)], None, {"structured": True})
    recs = [EpisodeRecord(episode_id=f"e{i}", task_id="t", reward=float(i), timelines=[plain, forced],
                          policy_version=0, meta={}, client_id="c") for i in range(2)]
    samples = build_samples(recs, build_algo({"name": "grpo"}), "token")
    by_ids = {tuple(s.input_ids): s.old_logprobs for s in samples}
    assert by_ids[(1, 2, 3, 4)][2:] == [-0.3, -0.3]
    assert all(math.isnan(v) for v in by_ids[(1, 5, 6, 7)][2:])
