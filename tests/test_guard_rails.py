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
