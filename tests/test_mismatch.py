"""Mismatch correction, GSPO and CISPO: loop reference implementations to 1e-6 in value and gradient
(float64), the algorithm wiring and its config errors, and the engine's ``mismatch_kl`` step metric."""

from __future__ import annotations

import math

import pytest
import torch

from swarmkit.contract import LossInputs
from swarmkit.errors import ConfigError
from swarmkit.training.engine import mismatch_k3_sum
from swarmkit_plugins.algo_rl import losses as L
from swarmkit_plugins.algo_rl import mismatch as M
from swarmkit_plugins.algo_rl import objectives as O
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.algo_rl.ppo import PPO
from swarmkit_plugins.algo_rl.schema import GRPOConfig, MismatchConfig

torch.set_num_threads(1)
D = torch.float64
ATOL = 1e-6


def close(a, b, atol=ATOL):
    return torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=atol)


@pytest.fixture()
def rng():
    return torch.Generator().manual_seed(4321)


def batch(rng, B=6, T=8, spread=0.4):
    mask = (torch.rand(B, T, generator=rng) > 0.3).to(D)
    mask[0] = 0  # an empty row
    mask[1, :] = 0
    mask[1, 2] = 1  # a row of one token
    lp = -torch.rand(B, T, generator=rng, dtype=D) * 3
    engine = lp + torch.randn(B, T, generator=rng, dtype=D) * spread
    adv = torch.randn(B, T, generator=rng, dtype=D)
    return lp, engine, adv, mask


# ----------------------------------------------------------------- loop references
def ref_weights(trainer, engine, mask, level, mode, cap, floor):
    """One weight per token, one row at a time; returns (weights, changed) as nested lists."""
    W, C = [], []
    for b in range(len(mask)):
        on = [i for i, m in enumerate(mask[b]) if m]
        ds = {i: trainer[b][i] - engine[b][i] for i in on}
        total = sum(ds.values())
        row_w, row_c = [0.0] * len(mask[b]), [False] * len(mask[b])
        for i in on:
            lw = {"token": ds[i], "sequence": total, "geometric": total / len(on)}[level]
            w = math.exp(lw)
            if mode == "truncate":
                row_w[i], row_c[i] = min(w, cap), w > cap
            elif mode == "mask":
                keep = floor <= w <= cap
                row_w[i], row_c[i] = (w if keep else 0.0), not keep
            else:
                row_w[i] = w
        W.append(row_w)
        C.append(row_c)
    return W, C


def ref_agg(loss, mask, mode, c):
    rows = [(lr, mr) for lr, mr in zip(loss, mask, strict=True) if sum(mr) > 0]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(x * m for lr, mr in rows for x, m in zip(lr, mr, strict=True)) / sum(m for _, mr in rows for m in mr)
    per = [sum(x * m for x, m in zip(lr, mr, strict=True)) / (sum(mr) if mode == "seq-mean-token-mean" else c)
           for lr, mr in rows]
    return sum(per) / len(per)


def ref_objective(kind, lp, anchor, adv, mask, weights, cl, ch):
    """The per-token loss −w·term, token by token. The stop-gradients are taken at ``anchor_grad``:
    callers differentiate by perturbing ``lp`` while the sg-parts stay at the unperturbed point
    (``sg`` below), which is what the autograd versions compute."""
    out = []
    for b in range(len(lp)):
        on = [i for i, m in enumerate(mask[b]) if m]
        seq = sum(lp[b][i] - anchor[b][i] for i in on) / len(on) if on else 0.0
        row = [0.0] * len(lp[b])
        for i in on:
            a = adv[b][i]
            r = math.exp(lp[b][i] - anchor[b][i])
            if kind == "clip":
                term = min(r * a, min(max(r, 1 - cl), 1 + ch) * a)
            elif kind == "gspo":
                s = math.exp(seq)
                term = min(s * a, min(max(s, 1 - cl), 1 + ch) * a)
            else:  # cispo: the clipped weight is a constant (evaluated by the caller at the base point)
                term = min(max(r, 1 - cl), 1 + ch) * a * lp[b][i]
            row[i] = -(1.0 if weights is None else weights[b][i]) * term
        out.append(row)
    return out


LEVELS_MODES = [(lv, md) for lv in M.LEVELS for md in ("truncate", "mask", "none")]


@pytest.mark.parametrize(("level", "mode"), LEVELS_MODES)
def test_importance_weights_match_a_loop(rng, level, mode):
    trainer, engine, _, mask = batch(rng)
    cap, floor = 1.3, 0.8
    w, changed = M.importance_weights(trainer, engine, mask, level, mode, cap, floor)
    ew, ec = ref_weights(trainer.tolist(), engine.tolist(), mask.tolist(), level, mode, cap, floor)
    assert close(w, ew)
    assert changed.tolist() == ec
    if mode != "none":
        assert changed.any() and not changed.all()  # the band is exercised both ways
    assert not w.requires_grad


def test_weights_never_overflow_and_are_exact_by_hand():
    # one row of 3 tokens, d = [0.5, 0.5, 200]: sequence log w = 201 (exp overflows float32)
    trainer = torch.tensor([[0.0, 0.0, 0.0]])
    engine = torch.tensor([[-0.5, -0.5, -200.0]])
    mask = torch.ones(1, 3)
    w, _ = M.importance_weights(trainer, engine, mask, "sequence", "truncate", 2.0)
    assert torch.equal(w, torch.full((1, 3), 2.0))
    w, ch = M.importance_weights(trainer, engine, mask, "sequence", "mask", 2.0)
    assert torch.equal(w, torch.zeros(1, 3)) and ch.all()
    w, _ = M.importance_weights(trainer, engine, mask, "token", "mask", 2.0, 0.5)
    assert close(w, [[math.exp(0.5), math.exp(0.5), 0.0]])
    assert torch.isfinite(M.importance_weights(trainer, engine, mask, "geometric", "none")[0]).all()


def test_mismatch_kl_matches_a_loop_and_the_engine_sum(rng):
    trainer, engine, _, mask = batch(rng)
    expect = [math.exp(t - e) - 1 - (t - e) for tr, er, mr in zip(trainer.tolist(), engine.tolist(), mask.tolist(),
                                                                   strict=True)
              for t, e, m in zip(tr, er, mr, strict=True) if m]
    assert close(M.mismatch_kl(trainer, engine, mask), sum(expect) / len(expect))
    s, n = mismatch_k3_sum(trainer, engine, mask)
    assert n == len(expect) and s == pytest.approx(sum(expect), abs=1e-9)
    assert M.mismatch_kl(trainer, trainer, mask).item() == 0.0
    assert M.mismatch_kl(trainer, engine, torch.zeros_like(mask)).item() == 0.0


AGG = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("kind", O.POLICY_LOSSES)
@pytest.mark.parametrize("mode", AGG)
@pytest.mark.parametrize("weighted", [False, True])
def test_policy_objectives_match_a_loop_in_value_and_gradient(rng, kind, mode, weighted):
    lp, anchor, adv, mask = batch(rng, spread=0.3)
    engine = anchor + torch.randn(anchor.shape, generator=rng, dtype=D) * 0.3
    cl, ch, c = (0.1, 0.15, 6.0)
    weights = M.importance_weights(anchor, engine, mask, "token", "truncate", 1.5)[0] if weighted else None
    x = lp.clone().requires_grad_(True)
    loss, m = O.weighted_policy_loss(x, anchor, adv, mask, weights, kind, cl, ch, mode, c)
    wl = weights.tolist() if weighted else None
    args = (anchor.tolist(), adv.tolist(), mask.tolist(), wl, cl, ch)
    assert close(loss.detach(), ref_agg(ref_objective(kind, lp.tolist(), *args), mask.tolist(), mode, c))
    assert 0 < m["clip_frac"] < 1  # the clip is exercised
    loss.backward()
    # the gradient of each token by central differences of the loop version; the stop-gradient
    # parts (GSPO's sequence ratio, CISPO's clipped weight) are held at the base point
    eps = 1e-6
    for b, i in [(1, 2), (2, 0), (2, 5), (3, 3), (4, 7), (5, 1)]:
        if not mask[b, i]:
            continue
        f = []
        for sign in (1, -1):
            pert = lp.clone()
            pert[b, i] += sign * eps
            if kind == "clip":
                f.append(ref_agg(ref_objective(kind, pert.tolist(), *args), mask.tolist(), mode, c))
                continue
            # d/d lp_i of the sg form: GSPO: −w·s·A·(1/n)... written via a per-token surrogate whose
            # ratio value is s (fixed) times exp(Δlp_i): min(s·e·A, clip(s·e)·A) where clip acts on s only
            base = ref_objective(kind, lp.tolist(), *args)
            row = list(base[b])
            a, w = adv[b, i].item(), (1.0 if wl is None else wl[b][i])
            on = [j for j in range(mask.shape[1]) if mask[b, j]]
            if kind == "gspo":
                s = math.exp(sum(lp[b, j].item() - anchor[b, j].item() for j in on) / len(on))
                e = math.exp(pert[b, i].item() - lp[b, i].item())
                clipped_active = min(max(s, 1 - cl), 1 + ch) * a < s * a
                row[i] = -w * ((min(max(s, 1 - cl), 1 + ch) * a) if clipped_active else s * e * a)
            else:
                r = math.exp(lp[b, i].item() - anchor[b, i].item())
                row[i] = -w * min(max(r, 1 - cl), 1 + ch) * a * pert[b, i].item()
            f.append(ref_agg([row if k == b else base[k] for k in range(len(base))], mask.tolist(), mode, c))
        assert abs(x.grad[b, i].item() - (f[0] - f[1]) / (2 * eps)) < 1e-6


def test_gspo_is_the_sequence_objective_with_seq_mean_aggregation(rng):
    """With one advantage per row and seq-mean-token-mean, GSPO's token form has the value and the
    gradient of the sequence objective −mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t log r)."""
    lp, anchor, _, mask = batch(rng, spread=0.05)
    adv_row = torch.randn(lp.shape[0], generator=rng, dtype=D)
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    loss, _ = O.weighted_policy_loss(a, anchor, adv_row[:, None].expand_as(mask), mask, None, "gspo", 0.02, 0.03,
                                     "seq-mean-token-mean")
    rows = mask.sum(-1) > 0
    s = torch.exp(L.masked_mean(b - anchor, mask, dim=-1))
    seq = torch.minimum(s * adv_row, torch.clamp(s, 0.98, 1.03) * adv_row)
    direct = -seq[rows].mean()
    loss.backward()
    direct.backward()
    assert close(loss.detach(), direct.detach())
    assert close(a.grad, b.grad)


def test_cispo_keeps_the_gradient_where_ppo_clips():
    # r = 2 on a token with A > 0: PPO's clipped term is active (no gradient); CISPO's weight is
    # clipped to 1.28 and the token still gets −1.28·A·∇log π
    lp = torch.tensor([[math.log(0.5)]], dtype=D, requires_grad=True)
    anchor = torch.tensor([[math.log(0.25)]], dtype=D)
    adv, mask = torch.tensor([[1.0]], dtype=D), torch.ones(1, 1, dtype=D)
    ppo, _ = O.weighted_policy_loss(lp, anchor, adv, mask, None, "clip", 0.2, 0.28)
    ppo.backward()
    assert lp.grad.item() == 0.0
    lp.grad = None
    cispo, m = O.weighted_policy_loss(lp, anchor, adv, mask, None, "cispo", 0.2, 0.28)
    cispo.backward()
    assert lp.grad.item() == pytest.approx(-1.28) and m["clip_frac"] == 1.0


# ----------------------------------------------------------------- the algorithm
def test_default_grpo_keeps_the_plain_clipped_loss(rng):
    lp, old, adv, mask = batch(rng)
    algo = GRPO(**{**vars(GRPOConfig()), "mismatch": {"mode": "none"}})
    loss, _ = algo.loss(LossInputs(lp, old, adv, mask))
    plain, _ = L.policy_loss(lp, old, adv, mask, 0.2, 0.28)
    assert close(loss, plain)


@pytest.mark.parametrize("kind", O.POLICY_LOSSES)
def test_grpo_mismatch_correction_anchors_at_the_trainer(rng, kind):
    lp, engine, adv, mask = batch(rng)
    algo = GRPO(policy_loss=kind, mismatch={"mode": "truncate", "level": "token", "cap": 1.5})
    assert not algo.needs_proximal  # one optimizer step: this forward is the pre-step policy
    x = lp.clone().requires_grad_(True)
    loss, m = algo.loss(LossInputs(x, engine, adv, mask))
    w, _ = M.importance_weights(lp, engine, mask, "token", "truncate", 1.5)
    expect, _ = O.weighted_policy_loss(lp, lp, adv, mask, w, kind, 0.2, 0.28)
    assert close(loss, expect)
    assert {"mismatch_weight_mean", "mismatch_truncated_frac"} <= m.keys()
    if kind != "cispo":  # at the anchor every ratio is 1: the gradient is −w·A·∇log π / N
        loss.backward()
        assert close(x.grad, -(w * adv * mask) / mask.sum())
    several = GRPO(mini_batches=2, mismatch=MismatchConfig(mode="mask"))
    assert several.needs_proximal
    with pytest.raises(ValueError, match="prox_logprobs"):
        several.loss(LossInputs(lp, engine, adv, mask))
    loss2, m2 = several.loss(LossInputs(lp, engine, adv, mask, prox_logprobs=lp + 0.01))
    assert "mismatch_masked_frac" in m2 and torch.isfinite(loss2)


def test_decoupled_with_raw_weights_is_the_decoupled_loss(rng):
    """The general path with no correction and decoupled=true reproduces decoupled_policy_loss."""
    lp, prox, adv, mask = batch(rng)
    behav = prox + torch.randn(prox.shape, generator=rng, dtype=D) * 0.4
    algo = GRPO(decoupled=True, policy_loss="gspo", clip_low=0.2, clip_high=0.28)
    a, _ = algo.loss(LossInputs(lp, behav, adv, mask, prox_logprobs=prox))
    raw, _ = M.importance_weights(prox, behav, mask, "token", "none")
    raw = torch.where(raw <= 5.0, raw, torch.zeros_like(raw))
    b, _ = O.weighted_policy_loss(lp, prox, adv, mask, raw, "gspo", 0.2, 0.28)
    assert close(a, b)
    clip_algo = GRPO(decoupled=True, mismatch={"mode": "truncate", "level": "token", "cap": 1e9},
                     behav_weight_cap=1.3)
    c, _ = clip_algo.loss(LossInputs(lp, behav, adv, mask, prox_logprobs=prox))
    d, _ = L.decoupled_policy_loss(lp, prox, behav, adv, mask, 0.2, 0.28, 1.3)
    assert close(c, d)


def test_ppo_takes_the_same_keys(rng):
    lp, engine, adv, mask = batch(rng)
    algo = PPO(policy_loss="cispo", clip_low=1.0, clip_high=4.0, mismatch={"mode": "mask", "level": "sequence"})
    v = torch.zeros_like(lp)
    loss, m = algo.loss(LossInputs(lp, engine, adv, mask, values=v, old_values=v, returns=v))
    assert torch.isfinite(loss) and "mismatch_masked_frac" in m


def test_bad_values_are_refused_all_at_once():
    with pytest.raises(ConfigError) as err:
        GRPO(policy_loss="gpso", mismatch={"mode": "trunc", "level": "seq", "cap": 0.5, "floor": 2})
    text = str(err.value)
    for key in ("algo.policy_loss", "algo.mismatch.mode", "algo.mismatch.level", "algo.mismatch.cap",
                "algo.mismatch.floor"):
        assert key in text
    assert "gspo" in text and "truncate" in text  # the options are listed
    with pytest.raises(TypeError, match="typo"):
        GRPO(mismatch={"typo": 1})
    with pytest.raises(ConfigError, match="clip_low"):
        GRPO(clip_low=1.0)  # only cispo may drop the lower bound
    GRPO(policy_loss="cispo", clip_low=1.0)


def test_the_mismatch_group_composes_from_the_command_line(tmp_path):
    from swarmkit.config.compose import compose_checked
    from swarmkit.training.trainer import build_algo, resolve_algo_config

    cfg = compose_checked(["model=tiny", "task=token_rule", f"server.run_dir={tmp_path}", "algo.policy_loss=gspo",
                           "algo.mismatch.mode=mask", "algo.mismatch.level=token", "algo.mismatch.cap=3"])
    algo = build_algo(resolve_algo_config(cfg.algo, "sync"))
    assert (algo.policy_loss, algo.mismatch.mode, algo.mismatch.level, algo.mismatch.cap) == ("gspo", "mask",
                                                                                              "token", 3.0)


# ----------------------------------------------------------------- the engine's step metric (tiny model)
def _engine(**algo):
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    return FSDPEngine(tiny_model_dir(), {"lora_rank": 0}, {"lr": 1e-3, "token_budget": 64}, GRPO(**algo))


def _trainer_logprobs(batch):
    """The initial tiny model's logprob of every trained token, straight from transformers."""
    from transformers import AutoModelForCausalLM

    from swarmkit.models import tiny_model_dir

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    out = []
    with torch.no_grad():
        for s in batch:
            logits = hf(torch.tensor([s.input_ids])).logits[0, :-1].log_softmax(-1)
            out.append(logits.gather(1, torch.tensor(s.input_ids[1:])[:, None])[:, 0].tolist())
    return out


@pytest.mark.parametrize("algo", [{}, {"mini_batches": 2, "mismatch": {"mode": "mask", "level": "geometric"}},
                                  {"policy_loss": "cispo", "mismatch": {"mode": "truncate", "level": "token"}}])
def test_every_step_reports_mismatch_kl_over_the_recorded_tokens(algo):
    """``mismatch_kl`` is the k3 KL(engine ‖ trainer) over trained tokens the rollout recorded a
    logprob for: engine logprobs offset by a known δ from the trainer's give mean(e^−δ − 1 + δ);
    tokens without one (the demonstration-like sample 0) or sampled by other weights are left out."""
    from swarmkit.contract import TrainSample

    g = torch.Generator().manual_seed(3)
    shapes = [(4, 5), (3, 6), (5, 4), (2, 7)]  # (prompt, generated) tokens
    batch = []
    for i, (p, n) in enumerate(shapes):
        ids = torch.randint(3, 400, (p + n,), generator=g).tolist()
        mask = [0] * p + [1] * n
        batch.append(TrainSample(ids, mask, [None] * (p + n), [(1.0 if i % 2 else -1.0) * m for m in mask],
                                 f"e{i}", f"t{i // 2}"))
    lps = _trainer_logprobs(batch)
    deltas = {1: 0.3, 2: -0.2, 3: 0.05}
    batch[3].versions = [0] * 4 + [1] * 2 + [0] * 5  # two tokens of another policy version: lag, not mismatch
    expect = []
    for i, s in enumerate(batch):
        if i not in deltas:
            continue  # no recorded logprobs
        old = [None] * len(s.input_ids)
        for pos in range(1, len(s.input_ids)):
            if s.loss_mask[pos]:
                old[pos] = lps[i][pos - 1] + deltas[i] * (5 if s.token_versions()[pos] else 1)
                if not s.token_versions()[pos]:
                    expect.append(math.expm1(-deltas[i]) + deltas[i])
        s.old_logprobs = old
    metrics = _engine(**algo).train_step(batch)
    assert metrics["mismatch_kl"] == pytest.approx(sum(expect) / len(expect), rel=1e-4)
