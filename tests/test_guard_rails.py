"""Issue 34's guard rails: policy entropy (metric and bonus), overlong responses, a warm-started
reference. The maths against direct implementations to 1e-6 (float64), then one step on the tiny
model for each option."""

from __future__ import annotations

import math

import pytest
import torch

from swarmkit.training.logprob import selected_logprobs_and_entropy

torch.set_num_threads(1)


# --------------------------------------------------------------------------- entropy: the kernel
@pytest.mark.parametrize("chunk_elements,keep", [(7 * 4, 0), (7 * 64, 0), (7 * 8, 1 << 20)],
                         ids=["slices-of-4", "one-slice", "kept-logits"])
def test_kernel_entropy_and_gradient_match_categorical(chunk_elements, keep):
    """Entropy of every row of hidden @ weight.T, sliced over the vocabulary, equals
    Categorical(logits).entropy(); so do its gradients and the joint gradient with the logprobs."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = (2 * torch.randn(41, 16, generator=g, dtype=torch.float64)).requires_grad_(True)
    t = torch.randint(0, 41, (7,), generator=g)
    lp, ent = selected_logprobs_and_entropy(h, w, t, chunk_elements=chunk_elements, keep_logits_bytes=keep)
    logits = h @ w.T
    want_ent = torch.distributions.Categorical(logits=logits).entropy()
    want_lp = torch.log_softmax(logits, -1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    ge = torch.randn(7, generator=g, dtype=torch.float64)
    go = torch.randn(7, generator=g, dtype=torch.float64)
    for got, want in (((ent * ge).sum(), (want_ent * ge).sum()),  # the entropy alone
                      ((lp * go + ent * ge).sum(), (want_lp * go + want_ent * ge).sum())):  # both outputs
        gh, gw = torch.autograd.grad(got, (h, w), retain_graph=True)
        wh, ww = torch.autograd.grad(want, (h, w), retain_graph=True)
        torch.testing.assert_close(gh, wh, rtol=0, atol=1e-6)
        torch.testing.assert_close(gw, ww, rtol=0, atol=1e-6)


def test_kernel_entropy_gradcheck_and_peaked_rows():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(23, 8, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 23, (5,), generator=g)
    assert torch.autograd.gradcheck(
        lambda a, b: selected_logprobs_and_entropy(a, b, t, chunk_elements=5 * 6), (h, w))
    # a nearly deterministic row (entropy ~ 0) and a flat one (entropy = log V)
    hh = torch.zeros(2, 8, dtype=torch.float64)
    hh[0, 0] = 60.0
    ww = torch.zeros(23, 8, dtype=torch.float64)
    ww[4, 0] = 1.0
    _, ent = selected_logprobs_and_entropy(hh, ww, torch.tensor([4, 0]), chunk_elements=2 * 6)
    want = torch.distributions.Categorical(logits=hh @ ww.T).entropy()
    torch.testing.assert_close(ent, want, rtol=0, atol=1e-6)
    assert abs(float(ent[1]) - math.log(23)) < 1e-9


def test_kernel_float32_entropy_is_close():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(6, 32, generator=g)
    w = torch.randn(300, 32, generator=g) * 0.5
    t = torch.randint(0, 300, (6,), generator=g)
    _, ent = selected_logprobs_and_entropy(h, w, t, chunk_elements=6 * 128)
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=h @ w.T).entropy(), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- overlong: the maths
def dapo_penalty(length, limit, buffer):
    """DAPO's soft overlong punishment written out: 0, then linear, then -1."""
    if length <= limit - buffer:
        return 0.0
    if length <= limit:
        return ((limit - buffer) - length) / buffer
    return -1.0


def test_length_penalty_by_hand_and_against_dapo():
    from swarmkit.training.overlong import length_penalty

    assert [length_penalty(n, 8, 4) for n in (0, 4, 5, 6, 7, 8, 9)] == pytest.approx(
        [0, 0, -0.25, -0.5, -0.75, -1, -1])
    assert [length_penalty(n, 8, 0) for n in (0, 7, 8)] == [0.0, 0.0, -1.0]  # no buffer: only a cut
    assert [length_penalty(n, 4, 10) for n in (0, 1, 2, 4)] == pytest.approx([0, -0.25, -0.5, -1])  # buffer > limit
    for limit in (1, 5, 16, 64):
        for buffer in range(1, limit + 1):
            for n in range(0, limit + 3):
                assert abs(length_penalty(n, limit, buffer) - dapo_penalty(n, limit, buffer)) < 1e-12
    with pytest.raises(ValueError):
        length_penalty(3, 0, 1)


def _call(n_generated, finish="stop", limit=None, base=10, role=None, prompt=(1, 2, 3)):
    """One recorded call: a prompt block, then ``n_generated`` generated tokens."""
    from swarmkit.timelines import Block, Timeline

    meta = {"finish_reason": finish}
    if limit is not None:
        meta["max_tokens"] = limit
    ids = [base + i for i in range(n_generated)]
    blocks = [Block("user", "q", list(prompt)), Block("llm", "a" * n_generated, ids, [-1.0] * n_generated)]
    return Timeline(blocks, role=role, meta=meta)


def _rec(eid, calls, reward, task="q"):
    from swarmkit.pool.records import EpisodeRecord

    return EpisodeRecord(episode_id=eid, task_id=task, client_id="c", reward=reward,
                         timelines=[t.to_dict() for t in calls], policy_version=0)


def test_call_and_unit_penalties():
    from swarmkit.training.overlong import call_penalty, generated_length, unit_penalty

    assert generated_length(_call(5)) == 5
    assert call_penalty(_call(7, limit=8), 4) == pytest.approx(-0.75)
    assert call_penalty(_call(8, "length", limit=8), 4) == -1.0
    assert call_penalty(_call(3, "length"), 4) == -1.0  # cut, no recorded limit
    assert call_penalty(_call(300), 4) == 0.0  # not cut, no recorded limit
    assert unit_penalty([_call(2, limit=8), _call(6, limit=8), _call(5, limit=8)], 4) == pytest.approx(-0.5)
    assert unit_penalty([], 4) == 0.0


def test_overlong_penalty_shapes_rewards_before_advantages():
    from swarmkit.training import build_samples
    from swarmkit_plugins.algo_rl.grpo import GRPO

    recs = [_rec("e0", [_call(2, limit=8)], 1.0), _rec("e1", [_call(7, limit=8)], 1.0),
            _rec("e2", [_call(8, "length", limit=8)], 1.0), _rec("e3", [_call(6, limit=8)], 1.0)]
    algo = GRPO(overlong="penalty", overlong_buffer=4)
    stats: dict = {}
    samples = build_samples(recs, algo, stats=stats)
    shaped = [1.0, 0.25, 0.0, 0.5]
    assert [s.reward for s in samples] == pytest.approx(shaped)
    want = algo.episode_advantages(shaped, ["q"] * 4)
    assert [max(s.advantages, key=abs) for s in samples] == pytest.approx(want)
    assert stats["overlong_calls"] == 1 and stats["overlong_penalty"] == pytest.approx(-2.25)
    # "none" leaves rewards alone (equal rewards: no signal) and still counts the cut call
    stats = {}
    plain = build_samples(recs, GRPO(), stats=stats)
    assert [s.reward for s in plain] == [1.0] * 4 and all(a == 0 for s in plain for a in s.advantages)
    assert stats["overlong_calls"] == 1 and "overlong_penalty" not in stats


def test_overlong_filter_leaves_the_cut_units_samples_out():
    from swarmkit.training import build_samples
    from swarmkit_plugins.algo_rl.grpo import GRPO

    recs = [_rec("e0", [_call(3, limit=8), _call(4, "length", limit=4, prompt=(1, 2, 3, 9))], 0.0),
            _rec("e1", [_call(3, limit=8)], 1.0), _rec("e2", [_call(5, limit=8)], 0.5)]
    algo = GRPO(overlong="filter")
    stats: dict = {}
    samples = build_samples(recs, algo, stats=stats)
    assert sorted(s.episode_id for s in samples) == ["e1", "e2"]
    assert stats["overlong_filtered"] == 2 and stats["overlong_calls"] == 1  # e0's two calls do not merge
    # the cut episode's reward still counts in its group's baseline
    want = algo.episode_advantages([0.0, 1.0, 0.5], ["q"] * 3)[1:]
    assert [max(s.advantages, key=abs) for s in samples] == pytest.approx(want)
    # per-role rewards: only the role whose call was cut is left out
    role_recs = [_rec(f"r{i}", [_call(3, role="spy", limit=8), _call(4, "length" if i == 0 else "stop",
                                                                      role="civ", limit=4, base=200)],
                      {"spy": float(i), "civ": float(i)}) for i in range(2)]
    kept = build_samples(role_recs, algo)
    assert sorted((s.episode_id, s.role) for s in kept) == [("r0", "spy"), ("r1", "civ"), ("r1", "spy")]


# --------------------------------------------------------------------------- the tiny model
LORA = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}


def _engine(lora=False, **algo):
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    return FSDPEngine(tiny_model_dir(), dict(LORA) if lora else {"lora_rank": 0},
                      {"lr": 1e-3, "sft_lr": 2e-2, "token_budget": 64}, GRPO(**algo))


def _batch(n=4, demo=False):
    """n samples of 4 prompt tokens then generated tokens; rewards 0/1 in groups of two."""
    from swarmkit.contract import TrainSample

    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        length = 9 + 2 * i
        ids = torch.randint(3, 400, (length,), generator=g).tolist()
        mask = [0] * 4 + [1] * (length - 4)
        adv = 1.0 if demo or i % 2 == 0 else -1.0
        old = [float("nan")] * length  # the engine scores them: ratio 1
        out.append(TrainSample(ids, mask, old, [adv * m for m in mask], f"e{i}", f"t{i // 2}", demonstration=demo))
    return out


def _captured_step(engine, batch, monkeypatch):
    """Train one step; returns (metrics, the gradient it stepped with, the weights before)."""
    grads: dict[str, torch.Tensor] = {}
    step = engine._optimizer_step

    def capture():
        grads.update({n: p.grad.detach().clone() for n, p in engine.policy.named_parameters() if p.grad is not None})
        return step()

    monkeypatch.setattr(engine, "_optimizer_step", capture)
    before = {n: p.detach().clone() for n, p in engine.policy.named_parameters()}
    return engine.train_step(batch), grads, before


def test_entropy_metric_and_bonus_on_the_tiny_model(monkeypatch):
    """Every step reports the policy's mean entropy over the trained tokens; with entropy_coef the
    gradient changes by exactly entropy_coef x the gradient of minus that mean (token-mean)."""
    from transformers import AutoModelForCausalLM

    from swarmkit.models import tiny_model_dir

    batch = _batch()
    m0, g0, before = _captured_step(_engine(), batch, monkeypatch)
    m1, g1, _ = _captured_step(_engine(entropy_coef=0.5), batch, monkeypatch)
    assert "entropy_loss" in m1 and "entropy_loss" not in m0
    # the direct computation: the HF model with the engine's weights, Categorical over the logits
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    own = dict(hf.named_parameters())
    with torch.no_grad():
        for n, p in before.items():
            own[n.removeprefix("lm.")].copy_(p)
    ents = []
    for s in batch:
        logits = hf(torch.tensor([s.input_ids])).logits[0, :-1]
        trained = torch.tensor(s.loss_mask[1:]).bool()
        ents.append(torch.distributions.Categorical(logits=logits[trained]).entropy())
    mean_ent = torch.cat(ents).mean()
    assert m0["entropy"] == pytest.approx(float(mean_ent.detach()), rel=1e-5)
    assert m1["entropy"] == pytest.approx(m0["entropy"], rel=1e-6)  # same weights before the step
    (-mean_ent).backward()
    changed = 0
    for n, g in g0.items():
        bonus = own[n.removeprefix("lm.")].grad
        torch.testing.assert_close(g1[n] - g, 0.5 * bonus, rtol=1e-3, atol=1e-6)
        changed += bool((g1[n] - g).abs().max() > 1e-6)
    assert changed > 10


def test_overlong_filter_end_to_end_on_the_tiny_model(tmp_path):
    """A Trainer step with overlong=filter trains every sample but the cut one."""
    from swarmkit.training import Trainer

    recs = [_rec("e0", [_call(6, limit=8)], 1.0), _rec("e1", [_call(8, "length", limit=8, base=20)], 0.0),
            _rec("e2", [_call(5, limit=8, base=30)], 0.0, task="p"), _rec("e3", [_call(7, limit=8, base=40)], 1.0,
                                                                          task="p")]
    out = {}
    for mode in ("none", "filter"):
        tr = Trainer({"path": "builtin:tiny", "lora_rank": 0}, {"name": "fsdp", "lr": 1e-3, "token_budget": 64},
                     {"name": "grpo", "overlong": mode}, run_dir=tmp_path / mode)
        out[mode] = tr.step(recs)
    assert out["none"]["samples"] == 4 and out["none"]["trained_tokens"] == 6 + 8 + 5 + 7
    assert out["filter"]["samples"] == 3 and out["filter"]["trained_tokens"] == 6 + 5 + 7
    assert out["filter"]["overlong_filtered"] == 1 and out["none"]["overlong_calls"] == 1
    assert out["filter"]["entropy"] > 0


# --------------------------------------------------------------------------- the warm-started reference
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reference_reanchored_after_a_warm_start(lora, tmp_path):
    """reference=warm_start: after demonstration-only steps the first RL step moves the reference to
    the current weights (KL 0 there); reference=initial keeps the loaded weights (KL > 0). A
    checkpoint keeps the anchor, and a warm start pending at the save."""
    demo, rl = _batch(3, demo=True), _batch(4)
    kl = {}
    for mode in ("initial", "warm_start"):
        e = _engine(lora, kl_coef=0.1, reference=mode)
        for _ in range(2):
            assert "reference_reanchored" not in e.train_step(demo)
        if mode == "warm_start":
            e.save_checkpoint(str(tmp_path / "pending"))
        first = e.train_step(rl)
        kl[mode] = (first["kl"], e.train_step(rl)["kl"])
        assert first.get("reference_reanchored") == (1.0 if mode == "warm_start" else None)
    assert kl["warm_start"][0] < 1e-7 < 1e-4 < kl["initial"][0]
    assert kl["warm_start"][1] > 1e-9  # the policy moved on from its anchor
    # checkpoints: the pending re-anchor survives, and so does the anchor itself
    resumed = _engine(lora, kl_coef=0.1, reference="warm_start")
    resumed.load_checkpoint(str(tmp_path / "pending"))
    assert resumed.train_step(rl)["reference_reanchored"] == 1.0
    resumed.save_checkpoint(str(tmp_path / "anchored"))
    assert (tmp_path / "anchored" / "reference").is_dir() and not (tmp_path / "pending" / "reference").exists()
    again = _engine(lora, kl_coef=0.1, reference="warm_start")
    again.load_checkpoint(str(tmp_path / "anchored"))
    from swarmkit.training.packing import micro_batch_tensors, prepare_sample

    prep = [prepare_sample(s) for s in rl]
    mb = micro_batch_tensors(prep, list(range(len(prep))), resumed.device)
    with torch.no_grad():
        torch.testing.assert_close(again._reference_logprobs(mb), resumed._reference_logprobs(mb), rtol=0, atol=0)
        # loading a checkpoint saved before the anchor puts the initial reference back
        again.load_checkpoint(str(tmp_path / "pending"))
        initial = _engine(lora, kl_coef=0.1)
        torch.testing.assert_close(again._reference_logprobs(mb), initial._reference_logprobs(mb), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reference_reanchored_on_two_fsdp2_ranks(lora, tmp_path):
    """The same on a 2-rank FSDP2 group (sharded parameters, gloo): KL 0 at the first RL step after
    the warm start, and a sharded checkpoint of the anchor resumes to the same KL."""
    import json

    from swarmkit.training.worker import launch

    steps = [[s.to_dict() for s in _batch(3, demo=True)]] * 2 + [[s.to_dict() for s in _batch(4)]] * 2
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    model_cfg = dict(LORA) if lora else {"lora_rank": 0}
    optim_cfg = {"lr": 1e-3, "sft_lr": 2e-2, "token_budget": 40}
    algo_cfg = {"name": "grpo", "kl_coef": 0.1, "reference": "warm_start"}
    full = launch(2, tmp_path / "steps.json", tmp_path / "full.jsonl", "fsdp", model_cfg=model_cfg,
                  optim_cfg=optim_cfg, algo_cfg=algo_cfg, timeout=300)
    assert full[2]["reference_reanchored"] == 1.0 and full[2]["kl"] < 1e-7 < full[3]["kl"]
    launch(2, tmp_path / "steps.json", tmp_path / "first.jsonl", "fsdp", model_cfg=model_cfg, optim_cfg=optim_cfg,
           algo_cfg=algo_cfg, extra=["--steps", "3", "--save", str(tmp_path / "ck")], timeout=300)
    assert (tmp_path / "ck" / "reference").is_dir()
    rest = launch(2, tmp_path / "steps.json", tmp_path / "rest.jsonl", "fsdp", model_cfg=model_cfg,
                  optim_cfg=optim_cfg, algo_cfg=algo_cfg, extra=["--resume", str(tmp_path / "ck"), "--skip", "3"],
                  timeout=300)
    assert rest[0]["kl"] == pytest.approx(full[3]["kl"], rel=1e-4, abs=1e-9)
