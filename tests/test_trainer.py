"""build_samples (merge, advantages on every generated span, role rewards) and the Trainer glue."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from swarmkit.timelines import Block, Timeline
from swarmkit.training import Trainer, TrainSample, build_samples
from swarmkit_plugins.algo_rl.grpo import GRPO

torch.set_num_threads(1)


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


def two_turn(answer1: str, answer2: str, role: str | None = None, base: int = 10) -> list[dict]:
    """Two LLM calls of one agent; the second re-renders the first answer as history."""
    sys_b = Block("user", "Q: add", tok("Q: add", base))
    a1 = Block("llm", answer1, tok(answer1, base + 100), [-0.5] * len(answer1))
    t1 = Timeline([sys_b, Block("template", "<a>", [3]), a1], role=role)
    hist = Block("history", answer1, tok(answer1, base + 100))
    obs = Block("env", "obs", tok("obs", base))
    a2 = Block("llm", answer2, tok(answer2, base + 100), [-0.25] * len(answer2))
    t2 = Timeline([sys_b, Block("template", "<a>", [3]), hist, obs, Block("template", "<a>", [3]), a2], role=role)
    return [t1.to_dict(), t2.to_dict()]


def test_multi_turn_merge_gives_one_sample_with_advantage_on_every_span():
    recs = [Rec("e0", "t0", 1.0, two_turn("12", "yes")), Rec("e1", "t0", 0.0, two_turn("7", "no")),
            Rec("e2", "t1", 0.5, two_turn("3", "ok")), Rec("e3", "t1", 0.5, two_turn("4", "ok"))]
    algo = GRPO()
    samples = build_samples(recs, algo, "text")
    assert len(samples) == 4  # each episode's 2 timelines merged into 1
    want = algo.episode_advantages([1.0, 0.0, 0.5, 0.5], ["t0", "t0", "t1", "t1"])
    for s, w in zip(samples, want, strict=True):
        assert isinstance(s, TrainSample) and len(s.input_ids) == len(s.loss_mask) == len(s.advantages)
        spans = []  # maximal runs of loss_mask 1
        for t, m in enumerate(s.loss_mask):
            if m and (t == 0 or not s.loss_mask[t - 1]):
                spans.append([t])
            if m:
                spans[-1].append(t)
        assert len(spans) == 2  # both generated answers are trained
        assert all(a == pytest.approx(w) for a, m in zip(s.advantages, s.loss_mask, strict=True) if m)
        assert all(a == 0.0 for a, m in zip(s.advantages, s.loss_mask, strict=True) if not m)
        # the first span carries the logprobs the model really produced in call 1
        lp = [x for x, m in zip(s.old_logprobs, s.loss_mask, strict=True) if m]
        assert set(lp) == {-0.5, -0.25}
    assert samples[0].advantages[-1] > 0 > samples[1].advantages[-1]
    assert samples[2].advantages[-1] == 0.0  # equal rewards: no signal
    # the token strategy cannot merge a re-tokenised history
    recs2 = [Rec("e0", "t0", 1.0, two_turn("12", "yes"))]
    hist_retok = recs2[0].timelines[1]["blocks"][2]
    hist_retok.update(token_ids=hist_retok["token_ids"] + [5], logprobs=None, loss_mask=None)
    assert len(build_samples(recs2, algo, "token")) == 2
    assert len(build_samples(recs2, algo, "text")) == 1


def test_role_rewards_map_to_each_roles_timelines():
    def rec(eid: str, reward: Any) -> Rec:
        return Rec(eid, "game", reward, two_turn("a", "b", role="spy", base=10)
                   + two_turn("c", "d", role="civilian", base=200))

    recs = [rec("e0", {"spy": 1.0, "civilian": 0.0}), rec("e1", {"spy": 0.0, "civilian": 1.0})]
    samples = build_samples(recs, GRPO(std_normalize=False), "text")
    by = {(s.episode_id, s.role): s for s in samples}
    assert len(samples) == 4  # per episode: one merged sample per role, roles never merge
    assert by[("e0", "spy")].reward == 1.0 and by[("e0", "civilian")].reward == 0.0
    # groups are (task, role): spy of e0 beats spy of e1, civilian of e1 beats civilian of e0
    adv = {k: max(s.advantages, key=abs) for k, s in by.items()}
    assert adv[("e0", "spy")] == pytest.approx(0.5) and adv[("e1", "spy")] == pytest.approx(-0.5)
    assert adv[("e0", "civilian")] == pytest.approx(-0.5) and adv[("e1", "civilian")] == pytest.approx(0.5)
    # a role missing from the dict falls back to the episode's mean reward
    recs.append(Rec("e2", "game", {"spy": 1.0}, two_turn("x", "y", role="judge")))
    s = [x for x in build_samples(recs, GRPO(std_normalize=False), "text") if x.episode_id == "e2"]
    assert len(s) == 1 and s[0].role == "judge" and s[0].reward == 1.0


def test_trainer_step_export_and_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    from swarmkit.models import tiny_model_dir

    recs = [Rec(f"e{i}", f"t{i // 2}", float(i % 2), two_turn("12" * (i + 1), "yes")) for i in range(4)]
    tr = Trainer({"path": "builtin:tiny", "lora_rank": 0}, {"name": "fsdp", "lr": 1e-3, "token_budget": 64},
                 {"name": "grpo"}, match="text", run_dir=tmp_path)
    m = tr.step(recs)
    for key in ("loss", "trained_tokens", "step_time_s", "reward_mean", "samples", "merge_ratio"):
        assert key in m
    assert m["reward_mean"] == pytest.approx(0.5) and m["samples"] == 4 and m["merge_ratio"] == 2.0
    assert tr.global_step == 1
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
    fresh.load_state_dict(dict(tr.export_weights()))
    path = tr.save_checkpoint(extra={"pool_step": 1})
    assert tr.latest_checkpoint() == path and path.name == "step_00000001"
    want = tr.step(recs)["loss"]
    tr2 = Trainer({"path": "builtin:tiny", "lora_rank": 0}, {"name": "fsdp", "lr": 1e-3, "token_budget": 64},
                  {"name": "grpo"}, run_dir=tmp_path)
    assert tr2.load_checkpoint() == {"pool_step": 1} and tr2.global_step == 1
    assert tr2.step(recs)["loss"] == want and tr2.global_step == 2


def test_the_auto_token_budget_is_per_device_and_cpu_steps_trim_the_heap():
    from swarmkit.training.config import resolve_token_budget
    from swarmkit.training.hostmem import release_freed_memory

    assert resolve_token_budget(0, "cpu") == 2048 and resolve_token_budget(0, "cuda") == 8192
    assert resolve_token_budget(512, "cpu") == 512
    with pytest.raises(ValueError, match="token_budget"):
        resolve_token_budget(-1, "cpu")
    assert release_freed_memory() is True  # glibc here


def test_old_step_checkpoints_are_pruned(tmp_path):
    from swarmkit.training.trainer import LATEST, prune_checkpoints

    root = tmp_path / "checkpoints"
    for step in (10, 20, 30, 40):
        (root / f"step_{step:08d}").mkdir(parents=True)
    (root / "step_00000050.tmp").mkdir()  # a save in progress is not a checkpoint
    (root / LATEST).write_text("step_00000010")  # e.g. a resume point: never deleted
    gone = prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in gone) == ["step_00000020"]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000010", "step_00000030",
                                                       "step_00000040", "step_00000050.tmp"]
    assert prune_checkpoints(root, keep=0) == []
