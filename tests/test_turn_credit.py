"""Per-turn credit: the maths against a naive loop, the turn_grpo algorithm, and advantages on merged samples."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from swarmkit.contract import Algorithm, CreditUnit, Turn, check_algorithm
from swarmkit.timelines import Block, Timeline
from swarmkit.timelines.merging import merge
from swarmkit.training import build_samples
from swarmkit.training.credit import sample_advantages
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.algo_rl.turn import TurnGRPO
from swarmkit_plugins.algo_rl.turn_credit import (
    discounted_returns,
    effective_rewards,
    turn_advantages,
    turn_baselines,
)

torch.set_num_threads(1)


# --------------------------------------------------------------------------- a naive implementation
def naive_advantages(turn_rewards: list[list[float]], final: list[float], groups: list[int], gamma: float,
                     baseline: str, std_normalize: bool, eps: float = 1e-6) -> list[list[float]]:
    """Loops over units and turns, straight from the definitions in docs/training.md."""
    n = len(turn_rewards)
    rets = []
    for i in range(n):
        r = list(turn_rewards[i])
        if r:
            r[-1] += final[i]
        rets.append([sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))])
    out = []
    for i in range(n):
        row = []
        for t in range(len(rets[i])):
            peers = [j for j in range(n) if groups[j] == groups[i] and len(rets[j]) > t
                     and (baseline == "mean" or j != i)]
            b = sum(rets[j][t] for j in peers) / len(peers) if peers else 0.0
            a = rets[i][t] - b
            if std_normalize:
                if baseline == "mean":
                    xs = [rets[j][t] for j in range(n) if groups[j] == groups[i] and len(rets[j]) > t]
                else:
                    xs = [x for j in range(n) if groups[j] == groups[i] for x in rets[j]]
                m = sum(xs) / len(xs)
                a /= math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs)) + eps
            row.append(a)
        out.append(row)
    return out


def _padded(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(1, max(len(r) for r in rows))
    x = torch.zeros(len(rows), T, dtype=torch.float64)
    for i, r in enumerate(rows):
        x[i, :len(r)] = torch.tensor(r, dtype=torch.float64)
    return x, torch.tensor([len(r) for r in rows])


@pytest.mark.parametrize("baseline", ["loo", "mean"])
@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("gamma", [1.0, 0.7, 0.0])
def test_turn_advantages_match_a_naive_loop(baseline, std_normalize, gamma):
    rng = random.Random(f"{baseline}{std_normalize}{gamma}")
    for _ in range(20):
        n = rng.randint(1, 9)
        rows = [[rng.choice([0.0, 0.0, 1.0, -0.5, rng.gauss(0, 1)]) for _ in range(rng.randint(1, 5))]
                for _ in range(n)]
        final = [rng.choice([0.0, 1.0, rng.gauss(0, 1)]) for _ in range(n)]
        groups = [rng.randint(0, 2) for _ in range(n)]
        x, lengths = _padded(rows)
        got = turn_advantages(x, lengths, torch.tensor(final, dtype=torch.float64), torch.tensor(groups),
                              gamma, baseline, std_normalize)
        want = naive_advantages(rows, final, groups, gamma, baseline, std_normalize)
        for i, row in enumerate(want):
            assert got[i, :len(row)].tolist() == pytest.approx(row, rel=1e-9, abs=1e-9)
            assert got[i, len(row):].abs().sum() == 0  # padding


def test_returns_are_discounted_from_each_turn_to_the_end():
    x, lengths = _padded([[1.0, 0.0, 2.0], [0.5]])
    r = effective_rewards(x, lengths, torch.tensor([1.0, -1.0], dtype=torch.float64))
    assert r.tolist() == [[1.0, 0.0, 3.0], [-0.5, 0.0, 0.0]]
    g = discounted_returns(r, lengths, 0.5)
    assert g.tolist() == [[1.0 + 0.25 * 3.0, 1.5, 3.0], [-0.5, 0.0, 0.0]]


def test_without_call_rewards_loo_is_episode_level_rloo():
    """Equal lengths, no call rewards, gamma 1: every turn gets the episode's RLOO advantage, which is
    GRPO's centred reward times n/(n-1): the per-turn estimator adds nothing when there is no turn signal."""
    rewards = [1.0, 0.0, 0.0, 0.5]
    x = torch.zeros(4, 3, dtype=torch.float64)
    adv = turn_advantages(x, torch.tensor([3] * 4), torch.tensor(rewards, dtype=torch.float64),
                          torch.zeros(4, dtype=torch.long), std_normalize=False)
    mean = sum(rewards) / 4
    for i, r in enumerate(rewards):
        assert adv[i].tolist() == pytest.approx([(r - mean) * 4 / 3] * 3)


def test_a_turn_only_one_rollout_reached_learns_under_loo_but_not_under_the_naive_mean():
    """The length bias: rollout 0 took a 3rd turn (reward 1 there), the others stopped after 2."""
    x, lengths = _padded([[0.0, 0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    final = torch.zeros(3, dtype=torch.float64)
    groups = torch.zeros(3, dtype=torch.long)
    naive = turn_advantages(x, lengths, final, groups, baseline="mean", std_normalize=False)
    fixed = turn_advantages(x, lengths, final, groups, baseline="loo", std_normalize=False)
    assert naive[0, 2] == 0.0  # its own baseline: nothing learnt from the turn that earned the reward
    assert fixed[0, 2] == 1.0
    b, n = turn_baselines(discounted_returns(x, lengths, 1.0), lengths, groups, "loo")
    assert n[0].tolist() == [2.0, 2.0, 0.0] and b[0, 2] == 0.0


def _unit(eid: str, group: str, reward: float, turns: list[tuple[float, int]],
          expert: dict[int, list[float]] | None = None) -> CreditUnit:
    expert = expert or {}
    return CreditUnit(eid, group, reward, tuple(Turn(call=k, reward=r, tokens=n,
                                                     advantages=tuple(expert[k]) if k in expert else None)
                                                for k, (r, n) in enumerate(turns)))


def test_turn_grpo_spreads_each_turns_advantage_over_its_tokens_and_keeps_expert_advantages():
    algo = TurnGRPO(gamma=0.5, std_normalize=False)
    check_algorithm(algo)
    units = [_unit("a", "t", 0.0, [(0.0, 2), (1.0, 3)]), _unit("b", "t", 0.0, [(0.0, 1), (0.0, 2)], {1: [0.3, -0.3]})]
    out = algo.turn_advantages(units)
    assert out[0] == [[0.5, 0.5], [1.0, 1.0, 1.0]]  # returns 0.5 and 1 against b's 0 and 0
    assert out[1] == [[-0.5], [0.3, -0.3]]  # a call with the client's own advantages keeps them


def test_turn_grpo_refuses_bad_keys():
    from swarmkit.errors import ConfigError

    with pytest.raises(ConfigError, match="gamma"):
        TurnGRPO(gamma=1.5)
    with pytest.raises(ConfigError, match="baseline"):
        TurnGRPO(baseline="median")


def test_the_contract_names_a_missing_turn_advantages():
    class Half(Algorithm):
        credit = "turn"

        def loss(self, inputs):  # pragma: no cover - never called
            raise AssertionError

    with pytest.raises(TypeError, match="turn_advantages"):
        check_algorithm(Half())

    class Odd(Half):
        credit = "steps"

    with pytest.raises(TypeError, match="credit must be one of"):
        check_algorithm(Odd())


# --------------------------------------------------------------------------- on merged samples
@dataclass
class Rec:
    episode_id: str
    task_id: str
    reward: Any
    timelines: list[dict]
    policy_version: int = 0
    client_id: str = "c"
    meta: dict = field(default_factory=dict)


def tok(text: str, base: int) -> list[int]:
    return [base + (ord(c) % 50) for c in text]


def turns(answers: list[str], call_rewards: list[float | None], role: str | None = None) -> list[dict]:
    """One agent's calls: call k sees the answers of calls < k as history (so all merge into the last)."""
    sys_b = Block("user", "Q", tok("Q", 10))
    out = []
    for k, ans in enumerate(answers):
        blocks = [sys_b]
        for prev in answers[:k]:
            blocks += [Block("template", "<a>", [3]), Block("history", prev, tok(prev, 110)),
                       Block("env", "obs", tok("obs", 10))]
        blocks += [Block("template", "<a>", [3]), Block("llm", ans, tok(ans, 110), [-0.1 * (k + 1)] * len(ans))]
        meta: dict[str, Any] = {"call": k}
        if call_rewards[k] is not None:
            meta["call_reward"] = call_rewards[k]
        out.append(Timeline(blocks, role=role, meta=meta).to_dict())
    return out


def test_merged_samples_keep_each_absorbed_calls_own_advantage():
    recs = [Rec("e0", "t", 0.0, turns(["ab", "cde", "f"], [0.0, 1.0, None])),
            Rec("e1", "t", 0.0, turns(["gh", "ij", "k"], [None, 0.0, 0.0]))]
    algo = TurnGRPO(std_normalize=False)
    samples = build_samples(recs, algo, "text")
    assert len(samples) == 2  # each episode's three calls merged into one sample
    # per-turn returns (gamma 1): e0 = [1, 1, 0], e1 = [0, 0, 0]; loo baselines are the other's
    want = {"e0": [1.0, 1.0, 0.0], "e1": [-1.0, -1.0, 0.0]}
    for s in samples:
        spans: list[list[float]] = []
        for t, m in enumerate(s.loss_mask):
            if m and (t == 0 or not s.loss_mask[t - 1]):
                spans.append([])
            if m:
                spans[-1].append(s.advantages[t])
        assert [set(sp) for sp in spans] == [{w} for w in want[s.episode_id]]
        assert [len(sp) for sp in spans] == ([2, 3, 1] if s.episode_id == "e0" else [2, 2, 1])


def test_sample_advantages_follow_the_blocks_the_merge_moved():
    """The positional rule (survivor's own block, else the latest absorbed call with a generated block
    there) agrees with the merge's sharing of the generated token lists, on random episodes."""
    rng = random.Random(3)
    for _ in range(30):
        n = rng.randint(1, 6)
        answers = ["".join(rng.choice("abcxyz") for _ in range(rng.randint(1, 4))) for _ in range(n)]
        tls = [Timeline.from_dict(t) for t in turns(answers, [None] * n)]
        if rng.random() < 0.5 and n > 2:  # a call that re-rendered an earlier answer differently: no merge
            k = rng.randrange(1, n)
            blocks = tls[k].blocks
            h = next((i for i, b in enumerate(blocks) if b.author == "history"), None)
            if h is not None:
                blocks[h] = Block("history", "zz", tok("zz", 110))
        per_call = {id(t): [float(c * 10 + p) for p in range(sum(len(b) for b in t.blocks if b.author == "llm"))]
                    for c, t in enumerate(tls)}
        result = merge(tls, "text")
        rows = sample_advantages(tls, result, per_call)
        for merged, row in zip(result.timelines, rows, strict=True):
            pos = 0
            for block in merged.blocks:
                if block.author == "llm":
                    owner = next(c for c, t in enumerate(tls) for b in t.blocks
                                 if b.author == "llm" and b.token_ids is block.token_ids)
                    assert row[pos:pos + len(block)] == per_call[id(tls[owner])][:len(block)]
                else:
                    assert row[pos:pos + len(block)] == [0.0] * len(block)
                pos += len(block)


def test_an_episode_level_algorithm_keeps_one_advantage_per_episode():
    """grpo (credit 'episode') labels every generated token with the episode's advantage, whatever the
    calls' meta say; the server refuses call rewards for it (tested in test_call_rewards_api)."""
    recs = [Rec("e0", "t", 1.0, turns(["ab", "c"], [5.0, None])), Rec("e1", "t", 0.0, turns(["d", "e"], [None, None]))]
    samples = build_samples(recs, GRPO(), "text")
    want = GRPO().episode_advantages([1.0, 0.0], ["t", "t"])[0]
    assert [a for a, m in zip(samples[0].advantages, samples[0].loss_mask, strict=True) if m] == [want] * 3
