"""RL maths: hand-worked values and loop reference implementations (float64, atol 1e-6)."""

from __future__ import annotations

import importlib
import math
import statistics

import pytest
import torch

from swarmkit.contract import LossInputs
from swarmkit_plugins.algo_rl import losses as L
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.algo_rl.ppo import PPO

torch.set_num_threads(1)
D = torch.float64
ATOL = 1e-6


def t(x):
    return torch.tensor(x, dtype=D)


def close(a, b, atol=ATOL):
    return torch.allclose(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), atol=atol)


# ----------------------------------------------------------------- hand-worked
def test_grpo_advantages_by_hand():
    # group 0: [1, 0] -> mean .5, centred [.5, -.5], unbiased std sqrt(.5)
    # group 1: [2, 2, 5] -> mean 3, centred [-1, -1, 2], var (1+1+4)/2 = 3
    # group 2: [3] alone -> centred 0, std 0 -> 0
    r = t([1, 0, 2, 2, 5, 3])
    g = torch.tensor([0, 0, 1, 1, 1, 2])
    assert close(L.grpo_advantages(r, g, std_normalize=False), [0.5, -0.5, -1, -1, 2, 0])
    s2, s3 = math.sqrt(0.5), math.sqrt(3)
    expect = [0.5 / s2, -0.5 / s2, -1 / s3, -1 / s3, 2 / s3, 0]
    assert close(L.grpo_advantages(r, g, std_normalize=True, eps=0.0)[:5], expect[:5])
    assert close(L.grpo_advantages(r, g, std_normalize=True, eps=1e-6)[5], 0.0)
    # all-equal group: no signal, no NaN
    assert close(L.grpo_advantages(t([1, 1, 1]), torch.tensor([4, 4, 4])), [0, 0, 0])


def test_aggregate_by_hand():
    loss = t([[1, 2, 3], [4, 0, 0], [9, 9, 9]])
    mask = t([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row empty: ignored
    assert close(L.aggregate_loss(loss, mask, "token-mean"), 7 / 3)  # (1+2+4)/3
    assert close(L.aggregate_loss(loss, mask, "seq-mean-token-mean"), 2.75)  # (3/2 + 4/1)/2
    # (3/2 + 4/2) / 2 rows
    assert close(L.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 2.0), 1.75)
    assert close(L.aggregate_loss(loss, torch.zeros_like(mask), "token-mean"), 0.0)
    with pytest.raises(ValueError):
        L.aggregate_loss(loss, mask, "nope")


def test_policy_loss_by_hand():
    # ratios 1.5, .9, .5; A = 1, 1, -1; clip range [0.8, 1.28]
    # surr = 1.5, .9, -.5; clipped = 1.28, .9, -.8; min = 1.28, .9, -.8
    # loss = -(1.28 + .9 - .8)/3 = -0.46; clipped active on tokens 0 and 2
    lp = torch.log(t([[1.5, 0.9, 0.5, 7.0]]))
    old = torch.zeros_like(lp)
    adv = t([[1, 1, -1, 5]])
    mask = t([[1, 1, 1, 0]])
    loss, m = L.policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert close(loss, -0.46)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["ratio_mean"] == pytest.approx(2.9 / 3)
    kl = sum(r - 1 - math.log(r) for r in (1.5, 0.9, 0.5)) / 3
    assert m["approx_kl"] == pytest.approx(kl)


def test_kl_and_value_by_hand():
    # d = log(.25) - log(.5) = -log 2: k3 = .5 + log 2 - 1, k1 = log 2, k2 = (log 2)^2/2
    lp, ref, mask = torch.log(t([[0.5]])), torch.log(t([[0.25]])), t([[1.0]])
    ln2 = math.log(2)
    assert close(L.kl_penalty(lp, ref, mask, "k3")[0], 0.5 + ln2 - 1)
    assert close(L.kl_penalty(lp, ref, mask, "k1")[0], ln2)
    assert close(L.kl_penalty(lp, ref, mask, "k2")[0], ln2**2 / 2)
    # token 0: v=1, old=.5, R=2 -> v_clip=.7, errors 1 and 1.69 -> .5*1.69 = .845 (clipped)
    # token 1: v=.6, old=.5, R=.55 -> inside the clip: .5*.05^2 = .00125
    loss, m = L.value_loss(t([[1.0, 0.6]]), t([[0.5, 0.5]]), t([[2.0, 0.55]]), t([[1, 1]]), 0.2)
    assert close(loss, (0.845 + 0.00125) / 2)
    assert m["vf_clip_frac"] == pytest.approx(0.5)


def test_gae_by_hand():
    # mask [0,1,0,1]: steps are tokens 1 and 3 (token 2 is environment text)
    # t=3: delta = 1 - .8 = .2 -> A=.2, R=1.0
    # t=1: delta = 0 + .9*.8 - .5 = .22 -> A = .22 + .9*.5*.2 = .31, R = .81
    rewards = t([[0, 0, 0, 1]])
    values = t([[9, 0.5, 9, 0.8]])
    mask = t([[0, 1, 0, 1]])
    adv, ret = L.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    assert close(adv, [[0, 0.31, 0, 0.2]])
    assert close(ret, [[0, 0.81, 0, 1.0]])


# ----------------------------------------------------------------- loop references
def ref_grpo(rewards, groups, std_normalize, eps):
    by = {}
    for r, g in zip(rewards, groups, strict=True):
        by.setdefault(g, []).append(r)
    out = []
    for r, g in zip(rewards, groups, strict=True):
        xs = by[g]
        a = r - sum(xs) / len(xs)
        if std_normalize:
            a /= (statistics.stdev(xs) if len(xs) > 1 else 0.0) + eps
        out.append(a)
    return out


def ref_agg(loss, mask, mode, c):
    rows = [(lr, mr) for lr, mr in zip(loss, mask, strict=True) if sum(mr) > 0]
    if not rows:
        return 0.0
    if mode == "token-mean":
        return sum(x * m for lr, mr in rows for x, m in zip(lr, mr, strict=True)) / sum(
            m for _, mr in rows for m in mr)
    per = []
    for lr, mr in rows:
        s = sum(x * m for x, m in zip(lr, mr, strict=True))
        per.append(s / sum(mr) if mode == "seq-mean-token-mean" else s / c)
    return sum(per) / len(per)


def ref_gae(rewards, values, mask, gamma, lam):
    adv = [[0.0] * len(r) for r in rewards]
    ret = [[0.0] * len(r) for r in rewards]
    for b in range(len(rewards)):
        steps = [i for i, m in enumerate(mask[b]) if m]
        a_next = 0.0
        for k in range(len(steps) - 1, -1, -1):
            i = steps[k]
            v_next = values[b][steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = rewards[b][i] + gamma * v_next - values[b][i]
            a_next = delta + gamma * lam * a_next
            adv[b][i] = a_next
            ret[b][i] = a_next + values[b][i]
    return adv, ret


@pytest.fixture()
def rng():
    return torch.Generator().manual_seed(1234)


def rand_batch(rng, B=5, T=9):
    mask = (torch.rand(B, T, generator=rng) > 0.35).to(D)
    mask[0] = 0  # an empty row
    lp = -torch.rand(B, T, generator=rng, dtype=D) * 3
    old = lp + torch.randn(B, T, generator=rng, dtype=D) * 0.3
    adv = torch.randn(B, T, generator=rng, dtype=D)
    return lp, old, adv, mask


def test_grpo_advantages_random(rng):
    for std_norm in (True, False):
        g = torch.randint(0, 6, (40,), generator=rng)
        r = torch.randn(40, generator=rng, dtype=D)
        got = L.grpo_advantages(r, g, std_norm, 1e-6)
        assert close(got, ref_grpo(r.tolist(), g.tolist(), std_norm, 1e-6))


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_policy_loss_random(rng, mode):
    lp, old, adv, mask = rand_batch(rng)
    cl, ch, c = 0.2, 0.28, 7.0
    loss, m = L.policy_loss(lp, old, adv, mask, cl, ch, mode, c)
    mat, clipped, n = [], 0, 0
    for b in range(lp.shape[0]):
        row = []
        for i in range(lp.shape[1]):
            r = math.exp(lp[b, i].item() - old[b, i].item())
            a = adv[b, i].item()
            s1, s2 = r * a, min(max(r, 1 - cl), 1 + ch) * a
            row.append(-min(s1, s2))
            if mask[b, i]:
                n += 1
                clipped += s2 < s1
        mat.append(row)
    assert close(loss, ref_agg(mat, mask.tolist(), mode, c))
    assert m["clip_frac"] == pytest.approx(clipped / n)


@pytest.mark.parametrize("kind", L.KL_KINDS)
def test_kl_random(rng, kind):
    lp, ref, _, mask = rand_batch(rng)
    mat = []
    for b in range(lp.shape[0]):
        row = []
        for i in range(lp.shape[1]):
            d = ref[b, i].item() - lp[b, i].item()
            row.append({"k1": -d, "k2": d * d / 2, "k3": math.exp(d) - d - 1}[kind])
        mat.append(row)
    loss, _ = L.kl_penalty(lp, ref, mask, kind, "seq-mean-token-mean")
    assert close(loss, ref_agg(mat, mask.tolist(), "seq-mean-token-mean", 1.0))


@pytest.mark.parametrize("mode", L.AGG_MODES)
def test_entropy_bonus_random(rng, mode):
    """The entropy term is minus the entropy aggregated like the loss; its gradient is minus the
    aggregation's weights; GRPO and PPO subtract entropy_coef times it."""
    _, _, _, mask = rand_batch(rng)
    ent = (torch.rand(mask.shape, generator=rng, dtype=D) * 4).requires_grad_(True)
    ent_masked_garbage = torch.where(mask.bool(), ent, torch.full_like(ent, float("nan")))
    loss, m = L.entropy_loss(ent_masked_garbage, mask, mode, 7.0)
    want = -ref_agg(ent.tolist(), mask.tolist(), mode, 7.0)
    assert close(loss, want) and m["entropy_loss"] == pytest.approx(want, abs=ATOL)
    (grad,) = torch.autograd.grad(loss, ent)
    rows = mask.sum(-1) > 0
    if mode == "token-mean":
        w = mask / mask.sum()
    elif mode == "seq-mean-token-mean":
        w = mask / mask.sum(-1, keepdim=True).clamp(min=1) / rows.sum()
    else:
        w = mask / 7.0 / rows.sum()
    assert close(grad, -w)
    lp, old, adv, _ = rand_batch(rng)
    for cls in (GRPO, PPO):
        algo = cls(entropy_coef=0.05, loss_agg=mode, loss_norm_constant=7.0)
        extra = {}
        if cls is PPO:
            extra = {"values": adv, "old_values": adv, "returns": adv}
        with pytest.raises(ValueError, match="entropy"):
            algo.loss(LossInputs(lp, old, adv, mask, **extra))
        got, metrics = algo.loss(LossInputs(lp, old, adv, mask, entropy=ent.detach(), **extra))
        base, _ = cls(loss_agg=mode, loss_norm_constant=7.0).loss(LossInputs(lp, old, adv, mask, **extra))
        assert close(got, base + 0.05 * want) and "entropy_loss" in metrics
        # no bonus: the entropy is ignored (the engine always hands it over)
        same, _ = cls(loss_agg=mode, loss_norm_constant=7.0).loss(
            LossInputs(lp, old, adv, mask, entropy=ent.detach(), **extra))
        assert close(same, base)


def test_gae_random(rng):
    _, _, _, mask = rand_batch(rng, B=6, T=12)
    rewards = torch.randn(6, 12, generator=rng, dtype=D)
    values = torch.randn(6, 12, generator=rng, dtype=D)
    adv, ret = L.gae(rewards, values, mask, 0.97, 0.9)
    ra, rr = ref_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.9)
    assert close(adv, ra) and close(ret, rr)


def test_value_loss_random(rng):
    _, _, _, mask = rand_batch(rng)
    v, old, R = (torch.randn(5, 9, generator=rng, dtype=D) for _ in range(3))
    loss, _ = L.value_loss(v, old, R, mask, 0.3, "token-mean")
    mat = [[0.5 * max((v[b, i] - R[b, i]).item() ** 2,
                      (old[b, i] + min(max((v[b, i] - old[b, i]).item(), -0.3), 0.3)
                       - R[b, i]).item() ** 2) for i in range(9)] for b in range(5)]
    assert close(loss, ref_agg(mat, mask.tolist(), "token-mean", 1.0))
    unclipped, _ = L.value_loss(v, old, R, mask, None)
    mat2 = [[0.5 * (v[b, i] - R[b, i]).item() ** 2 for i in range(9)] for b in range(5)]
    assert close(unclipped, ref_agg(mat2, mask.tolist(), "token-mean", 1.0))


def test_masked_garbage_gives_finite_gradient():
    lp = torch.tensor([[-1.0, -300.0]], dtype=torch.float32, requires_grad=True)
    old = torch.tensor([[-1.1, 0.0]])  # huge ratio at the masked-out position
    mask = torch.tensor([[1.0, 0.0]])
    loss, _ = L.policy_loss(lp, old, torch.tensor([[1.0, -1.0]]), mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0


# ----------------------------------------------------------------- algorithm wrappers
def test_registered_targets_import():
    for target in ("swarmkit_plugins.algo_rl.grpo:GRPO", "swarmkit_plugins.algo_rl.ppo:PPO"):
        mod, cls = target.split(":")
        assert issubclass(getattr(importlib.import_module(mod), cls), (GRPO, PPO))


def test_grpo_wrapper(rng):
    from swarmkit_plugins.algo_rl.schema import GRPOConfig

    algo = GRPO(**vars(GRPOConfig()))
    assert (algo.ppo_epochs, algo.mini_batches, algo.needs_reference, algo.needs_values) == (
        1, 1, False, False)
    adv = algo.episode_advantages([1.0, 0.0, 2.0, 2.0, 5.0], ["a", "a", "b", "b", "b"])
    assert adv == pytest.approx([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5),
                                 -1 / math.sqrt(3), -1 / math.sqrt(3), 2 / math.sqrt(3)], abs=1e-5)
    assert algo.episode_advantages([1.0], ["x"]) == [0.0]
    lp, old, _, mask = rand_batch(rng)
    per_seq = torch.randn(5, generator=rng, dtype=D)
    a, _ = algo.loss(LossInputs(lp, old, per_seq, mask))
    b, _ = algo.loss(LossInputs(lp, old, per_seq[:, None].expand_as(mask), mask))
    assert close(a, b)
    kl_algo = GRPO(kl_coef=0.1)
    assert kl_algo.needs_reference
    with pytest.raises(ValueError):
        kl_algo.loss(LossInputs(lp, old, per_seq, mask))
    ref = lp + 0.1
    loss, m = kl_algo.loss(LossInputs(lp, old, per_seq, mask, ref_logprobs=ref))
    pg, _ = L.policy_loss(lp, old, per_seq[:, None].expand_as(mask), mask, 0.2, 0.28)
    kl, _ = L.kl_penalty(lp, ref, mask)
    assert close(loss, pg + 0.1 * kl) and "kl" in m


def test_ppo_wrapper(rng):
    from swarmkit_plugins.algo_rl.schema import PPOConfig

    algo = PPO(**{**vars(PPOConfig()), "normalize_advantages": False, "gamma": 0.9})
    assert algo.needs_values and not algo.needs_reference
    mask = t([[0, 1, 1, 0], [1, 1, 1, 1]])
    values = t([[0, 0.5, 0.2, 0], [0.1, 0.2, 0.3, 0.4]])
    adv, ret = algo.token_advantages(t([1.0, -1.0]), values, mask)
    token_r = t([[0, 0, 1, 0], [0, 0, 0, -1]])  # reward on the last generated token
    ea, er = L.gae(token_r, values, mask, 0.9, 0.95)
    assert close(adv, ea) and close(ret, er)
    white = PPO(normalize_advantages=True).token_advantages(t([1.0, -1.0]), values, mask)[0]
    assert close(L.masked_mean(white, mask), 0.0)
    lp = torch.log(t([[0.5, 0.4, 0.3, 0.2], [0.5, 0.6, 0.7, 0.8]]))
    new_v = values + 0.05
    loss, m = algo.loss(LossInputs(lp, lp.detach() + 0.01, adv, mask, values=new_v, old_values=values, returns=ret))
    pg, _ = L.policy_loss(lp, lp + 0.01, adv, mask, 0.2, 0.2)
    vl, _ = L.value_loss(new_v, values, ret, mask, 0.2)
    assert close(loss, pg + 0.5 * vl) and "vf_loss" in m


def test_bad_config_rejected():
    with pytest.raises(ValueError):
        GRPO(loss_agg="sum")
    with pytest.raises(ValueError):
        PPO(clip_low=1.5)
    with pytest.raises(ValueError, match="kl_kind"):
        GRPO(kl_kind="k9")
    with pytest.raises(TypeError, match="no_such_key"):
        GRPO(no_such_key=1)  # the schema is the only source of keys and defaults
    for bad, key in (({"entropy_coef": -0.1}, "entropy_coef"), ({"reference": "base"}, "reference"),
                     ({"overlong": "drop"}, "overlong"), ({"overlong_buffer": -1}, "overlong_buffer"),
                     ({"overlong_buffer": 1.5}, "overlong_buffer")):
        for cls in (GRPO, PPO):
            with pytest.raises(ValueError, match=key):
                cls(**bad)


# ----------------------------------------------------------------- decoupled PPO (asynchronous training)
def ref_decoupled(lp, prox, behav, adv, mask, cl, ch, cap):
    """The per-token decoupled loss, one token at a time: -w * min(r*A, clip(r)*A), w = prox/behav
    (0 when above the cap), r = new/prox."""
    mat, capped = [], 0
    for b in range(len(lp)):
        row = []
        for i in range(len(lp[b])):
            if not mask[b][i]:
                row.append(0.0)
                continue
            w = math.exp(prox[b][i] - behav[b][i])
            if cap is not None and cap > 0 and w > cap:
                w, capped = 0.0, capped + 1
            r = math.exp(lp[b][i] - prox[b][i])
            a = adv[b][i]
            row.append(-w * min(r * a, min(max(r, 1 - cl), 1 + ch) * a))
        mat.append(row)
    return mat, capped


@pytest.mark.parametrize("mode", L.AGG_MODES)
@pytest.mark.parametrize("cap", [None, 1.3])
def test_decoupled_loss_matches_a_direct_implementation(rng, mode, cap):
    lp, prox, adv, mask = rand_batch(rng)
    behav = prox + torch.randn(prox.shape, generator=rng, dtype=D) * 0.4  # several versions old
    lp = lp.clone().requires_grad_(True)
    cl, ch, c = 0.2, 0.28, 7.0
    loss, m = L.decoupled_policy_loss(lp, prox, behav, adv, mask, cl, ch, cap, mode, c)
    mat, capped = ref_decoupled(lp.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(),
                                cl, ch, cap)
    assert close(loss.detach(), ref_agg(mat, mask.tolist(), mode, c))
    assert m["behav_capped_frac"] == pytest.approx(capped / mask.sum().item())
    if cap is not None:
        assert capped > 0  # the cap is exercised
    # the gradient agrees with the direct implementation's, by central differences, to 1e-6
    loss.backward()
    eps = 1e-6
    for b, i in [(1, 0), (2, 3), (3, 5), (4, 8)]:
        if not mask[b, i]:
            continue
        hi, lo = lp.detach().clone(), lp.detach().clone()
        hi[b, i] += eps
        lo[b, i] -= eps
        f = [ref_agg(ref_decoupled(x.tolist(), prox.tolist(), behav.tolist(), adv.tolist(), mask.tolist(),
                                   cl, ch, cap)[0], mask.tolist(), mode, c) for x in (hi, lo)]
        assert abs(lp.grad[b, i].item() - (f[0] - f[1]) / (2 * eps)) < 1e-6


def test_decoupled_loss_on_policy_is_the_clipped_surrogate(rng):
    """With the behaviour policy equal to the proximal one (sync training), the decoupled loss
    and its gradient are the plain clipped surrogate's."""
    lp, old, adv, mask = rand_batch(rng)
    a = lp.clone().requires_grad_(True)
    b = lp.clone().requires_grad_(True)
    la, _ = L.policy_loss(a, old, adv, mask, 0.2, 0.28)
    lb, m = L.decoupled_policy_loss(b, old, old, adv, mask, 0.2, 0.28, 5.0)
    la.backward()
    lb.backward()
    assert close(la.detach(), lb.detach())
    assert close(a.grad, b.grad)
    assert m["behav_weight_mean"] == pytest.approx(1.0)
    assert m["behav_kl"] == pytest.approx(0.0, abs=1e-12)


def test_grpo_decoupled_uses_the_proximal_logprobs():
    mask = t([[1.0, 1.0]])
    lp, prox, behav = t([[-1.0, -2.0]]), t([[-1.0, -2.0]]), t([[-1.5, -2.0]])
    adv = t([1.0])
    plain = GRPO()
    dec = GRPO(decoupled=True, behav_weight_cap=0)
    assert dec.needs_proximal and not plain.needs_proximal
    with pytest.raises(ValueError, match="prox_logprobs"):
        dec.loss(LossInputs(logprobs=lp, old_logprobs=behav, advantages=adv, mask=mask))
    loss, m = dec.loss(LossInputs(logprobs=lp, old_logprobs=behav, advantages=adv, mask=mask, prox_logprobs=prox))
    # r = 1 on both tokens; w = e^0.5 on the first, 1 on the second: loss = -(e^0.5 + 1) / 2
    assert loss.item() == pytest.approx(-(math.exp(0.5) + 1) / 2)
    assert m["behav_weight_mean"] == pytest.approx((math.exp(0.5) + 1) / 2)
    # the plain loss clips the ratio to the stale rollout policy instead: r = e^0.5 > 1.28 is clipped
    loss_plain, _ = plain.loss(LossInputs(logprobs=lp, old_logprobs=behav, advantages=adv, mask=mask))
    assert loss_plain.item() == pytest.approx(-(1.28 + 1) / 2)
