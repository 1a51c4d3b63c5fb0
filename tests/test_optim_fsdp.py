"""FSDP2 engine on the tiny Qwen2: logprob maths, packing, accumulation, learning, export, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from swarmkit.models import tiny_model_dir
from swarmkit.training import TrainSample
from swarmkit.training.logprob import selected_logprobs
from swarmkit.training.packing import micro_batch_tensors, plan_micro_batches, prepare_sample
from swarmkit.training.worker import launch
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

torch.set_num_threads(1)

LORA = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]}


def make_batch(seed: int = 0, n: int = 6, old: float | None = None) -> list[TrainSample]:
    """n samples: 5 prompt tokens then generated tokens; advantages alternate +1 / -1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 10 + 3 * i
        ids = torch.randint(3, 400, (length,), generator=g).tolist()
        mask = [0] * 5 + [1] * (length - 5)
        adv = 1.0 if i % 2 == 0 else -1.0
        lp = [float("nan") if old is None else old] * length
        out.append(TrainSample(ids, mask, lp, [adv * m for m in mask], f"e{i}", f"t{i // 2}"))
    return out


@torch.no_grad()
def score(engine: FSDPEngine, samples: list[TrainSample]) -> list[torch.Tensor]:
    """Current logprobs (k,) of the trained tokens of each sample."""
    prep = [prepare_sample(s) for s in samples]
    mb = micro_batch_tensors(prep, list(range(len(prep))), engine.device)
    lp, _, _ = engine.policy(mb.input_ids, mb.position_ids, mb.select, mb.targets)
    return mb.split(lp)


def with_rollout_logprobs(engine: FSDPEngine, samples: list[TrainSample]) -> list[TrainSample]:
    """Fill old_logprobs with the engine's current policy (what the rollout would record)."""
    out = []
    for s, lp in zip(samples, score(engine, samples), strict=True):
        old = [0.0] * len(s.input_ids)
        j = 0
        for t in range(1, len(s.input_ids)):
            if s.loss_mask[t]:
                old[t] = float(lp[j])
                j += 1
        out.append(TrainSample(s.input_ids, s.loss_mask, old, s.advantages, s.episode_id, s.task_id))
    return out


ALGO_KEYS = ("loss_agg", "kl_coef")


def engine(lora: bool = False, **options) -> FSDPEngine:
    """An engine on the tiny model; ``options`` are ``optim`` keys, plus GRPO's ``loss_agg`` / ``kl_coef``."""
    cfg = {"lr": 1e-3, "token_budget": 40, **{k: v for k, v in options.items() if k not in ALGO_KEYS}}
    return FSDPEngine(tiny_model_dir(), dict(LORA) if lora else {"lora_rank": 0}, cfg,
                      GRPO(**{k: v for k, v in options.items() if k in ALGO_KEYS}))


# --------------------------------------------------------------------------- maths
def test_selected_logprobs_match_log_softmax_and_gradients():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 37, (9,), generator=g)
    got = selected_logprobs(h, w, t, chunk_elements=37 * 4)  # chunks of 4 rows
    want = torch.log_softmax(h @ w.T, -1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    go = torch.randn(9, generator=g, dtype=torch.float64)
    gh, gw = torch.autograd.grad(got, (h, w), go)
    wh, ww = torch.autograd.grad(want, (h, w), go)
    torch.testing.assert_close(gh, wh, rtol=0, atol=1e-12)
    torch.testing.assert_close(gw, ww, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda a, b: selected_logprobs(a, b, t, chunk_elements=80), (h, w))


def test_kept_logits_give_the_same_values_and_gradients():
    """keep_logits_bytes large enough: backward reuses forward's logits; same numbers as recomputing."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(11, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(53, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 53, (11,), generator=g)
    go = torch.randn(11, generator=g, dtype=torch.float64)
    res = {}
    for keep in (0, 1 << 20):
        lp = selected_logprobs(h, w, t, chunk_elements=11 * 8, keep_logits_bytes=keep)
        res[keep] = (lp.detach(), *torch.autograd.grad(lp, (h, w), go))
    for a, b in zip(res[0], res[1 << 20], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b: selected_logprobs(a, b, t, chunk_elements=80, keep_logits_bytes=1 << 20), (h, w))


def _compiled_vs_eager(backend: str) -> None:
    batch = make_batch(old=-6.0)
    curves = {}
    for mode in ("false", "true"):
        e = engine(compile=mode, compile_backend=backend)
        assert e.compiled_layers == (len(e.policy.decoder_layers()) if mode == "true" else 0)
        curves[mode] = [e.train_step(batch)["loss"] for _ in range(3)]
        if mode == "true":  # names, checkpoints and export are unchanged by compiling
            assert all("_orig_mod" not in k for k in e.policy.state_dict())
    assert curves["true"] == pytest.approx(curves["false"], rel=1e-4, abs=1e-6)


def test_compiled_layers_train_like_eager():
    """optim.compile=true wraps each decoder layer's forward (aot_eager here: no C++ build in the fast suite)."""
    _compiled_vs_eager("aot_eager")


@pytest.mark.slow
def test_inductor_compiled_layers_train_like_eager():
    """The real inductor backend (C++ kernels on CPU, Triton on CUDA) gives the same curve."""
    _compiled_vs_eager("inductor")


def test_a_failing_compile_falls_back_to_eager():
    """A backend that cannot compile (no Triton, no C++ compiler): one warning, then eager, same curve."""
    from torch._dynamo import register_backend

    @register_backend(name="swarmkit_test_broken")
    def broken(gm, example_inputs):  # noqa: ARG001
        raise RuntimeError("no compiler here")

    batch = make_batch(old=-6.0)
    plain = engine()
    want = [plain.train_step(batch)["loss"] for _ in range(2)]
    e = engine(compile="true", compile_backend="swarmkit_test_broken")
    with pytest.warns(UserWarning, match="running eager"):
        got = [e.train_step(batch)["loss"] for _ in range(2)]
    assert got == pytest.approx(want, rel=1e-6)
    assert "no compiler here" in e.policy.compile_failed[0]


def test_compile_option_is_checked():
    with pytest.raises(ValueError, match="optim.compile"):
        engine(compile="sometimes")


def test_packed_row_equals_separate_forwards():
    e = engine()
    samples = make_batch()
    packed = score(e, samples)
    with torch.no_grad():
        for s, lp in zip(samples, packed, strict=True):
            logits = e.policy.causal_lm(torch.tensor([s.input_ids])).logits[0]
            ref = torch.log_softmax(logits.float(), -1)
            want = torch.tensor([ref[p, s.input_ids[p + 1]] for p in range(len(s.input_ids) - 1)
                                 if s.loss_mask[p + 1]])
            torch.testing.assert_close(lp, want, rtol=0, atol=1e-5)


def test_plan_packs_within_budget_and_balances_ranks():
    lengths = [30, 5, 12, 40, 7, 9, 100, 3]
    plan = plan_micro_batches(lengths, token_budget=40, world=2)
    assert len(plan.per_rank[0]) == len(plan.per_rank[1])
    seen = sorted(i for rank in plan.per_rank for b in rank for i in b)
    assert seen == list(range(len(lengths)))
    for rank in plan.per_rank:
        for b in rank:
            assert sum(lengths[i] for i in b) <= 40 or len(b) == 1


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_equals_one_big_batch(agg):
    """Micro-batches of 16 tokens vs one micro-batch: same losses and updates."""
    curves = {}
    for budget in (16, 10_000):
        e = engine(token_budget=budget, loss_agg=agg)
        batch = make_batch(old=-6.0)
        losses = [e.train_step(batch)["loss"] for _ in range(3)]
        curves[budget] = (losses, torch.cat([p.detach().flatten() for p in e.policy.parameters()]))
    (l1, p1), (l2, p2) = curves[16], curves[10_000]
    assert l1 == pytest.approx(l2, rel=1e-5, abs=1e-7)
    assert (p1 - p2).abs().max() < 1e-4


# --------------------------------------------------------------------------- learning
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_steps_reduce_loss_and_move_logprobs(lora):
    e = engine(lora=lora, lr=1e-2 if lora else 1e-3)
    batch = with_rollout_logprobs(e, make_batch())
    before = score(e, batch)
    losses = [e.train_step(batch)["loss"] for _ in range(4)]
    after = score(e, batch)
    assert losses[-1] < losses[0]
    pos = [(a - b).mean() for a, b, s in zip(after, before, batch, strict=True) if max(s.advantages) > 0]
    neg = [(a - b).mean() for a, b, s in zip(after, before, batch, strict=True) if min(s.advantages) < 0]
    assert all(d > 0 for d in pos) and all(d < 0 for d in neg)
    assert e.optimizer_steps == 4


def test_missing_rollout_logprobs_are_recomputed_and_kl_reference_runs():
    for lora in (False, True):
        e = engine(lora=lora, kl_coef=0.1)
        m = e.train_step(make_batch())  # NaN old logprobs: filled by a pre-pass
        assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert "kl" in " ".join(m) and all(v == v for v in m.values())


def test_ppo_value_head_trains():
    from swarmkit_plugins.algo_rl.ppo import PPO

    e = FSDPEngine(tiny_model_dir(), {"lora_rank": 0}, {"lr": 1e-3, "token_budget": 64}, PPO())
    batch = make_batch()
    for i, s in enumerate(batch):
        s.reward = float(i % 2)
    m1 = e.train_step(batch)
    m2 = e.train_step(batch)
    assert "vf_loss" in m1 and m2["vf_loss"] < m1["vf_loss"]


# --------------------------------------------------------------------------- export
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_export_weights_load_into_fresh_hf_model(lora, tmp_path):
    from transformers import AutoModelForCausalLM

    e = engine(lora=lora, lr=1e-2)
    e.train_step(with_rollout_logprobs(e, make_batch()))
    weights = dict(e.export_weights())
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    assert set(weights) == set(fresh.state_dict())
    fresh.load_state_dict(weights, strict=True)
    ids = torch.tensor([make_batch()[3].input_ids])
    with torch.no_grad():
        want = e.policy.lm(ids).logits
        got = fresh(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    if lora:  # the adapter folder loads with peft and gives the same logits
        from peft import PeftModel

        e.export_adapter(tmp_path / "adapter")
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
        with torch.no_grad():
            torch.testing.assert_close(peft_model(ids).logits, want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_checkpoint_resume_equals_uninterrupted(lora, tmp_path):
    batches = [make_batch(seed=s, old=-6.0) for s in range(4)]
    opts = {"lr": 1e-3, "warmup_steps": 3}
    ref = engine(lora=lora, **opts)
    want = [ref.train_step(b)["loss"] for b in batches]
    first = engine(lora=lora, **opts)
    got = [first.train_step(b)["loss"] for b in batches[:2]]
    first.save_checkpoint(str(tmp_path / "ck"))
    torch.manual_seed(1234)  # a fresh process would start from other RNG state
    resumed = engine(lora=lora, **opts)
    resumed.load_checkpoint(str(tmp_path / "ck"))
    assert resumed.optimizer_steps == 2 and resumed.current_lr() == pytest.approx(first.current_lr())
    got += [resumed.train_step(b)["loss"] for b in batches[2:]]
    assert got == want  # bitwise: same weights, optimizer state, schedule
    for a, b in zip(ref.policy.parameters(), resumed.policy.parameters(), strict=True):
        assert torch.equal(a, b)
    # the HF part of the checkpoint loads with transformers / peft
    from transformers import AutoModelForCausalLM

    if lora:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir())
        PeftModel.from_pretrained(base, str(tmp_path / "ck" / "adapter"))
    else:
        m = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ck" / "model"))
        torch.testing.assert_close(m.model.norm.weight, first.policy.causal_lm.model.norm.weight)


# --------------------------------------------------------------------------- multi-process
def _write_steps(path: Path, n_steps: int = 3) -> None:
    path.write_text(json.dumps([[s.to_dict() for s in make_batch(seed=k, old=-6.0)] for k in range(n_steps)]))


def run_worker(tmp: Path, nproc: int, engine_name: str, model_cfg: dict, optim_cfg: dict,
               tag: str, extra: list[str] | None = None) -> list[dict]:
    """Run the torchrun worker on 3 fixed steps; returns rank 0's metrics per step."""
    steps = tmp / "steps.json"
    if not steps.exists():
        _write_steps(steps)
    return launch(nproc, steps, tmp / f"metrics_{tag}_{nproc}.jsonl", engine_name, model_cfg=model_cfg,
                  optim_cfg=optim_cfg, extra=extra, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fsdp2_two_processes_match_one(lora, tmp_path):
    model_cfg = dict(LORA) if lora else {"lora_rank": 0}
    optim_cfg = {"lr": 1e-2 if lora else 1e-3, "token_budget": 40}
    one = run_worker(tmp_path, 1, "fsdp", model_cfg, optim_cfg, "fsdp")
    two = run_worker(tmp_path, 2, "fsdp", model_cfg, optim_cfg, "fsdp")
    # the in-process (no torch.distributed) engine gives the same curve too
    e = FSDPEngine(tiny_model_dir(), model_cfg, optim_cfg, GRPO())
    plain = [e.train_step(make_batch(seed=k, old=-6.0))["loss"] for k in range(3)]
    assert [m["world"] for m in two] == [2, 2, 2]
    for a, b, c in zip(one, two, plain, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["loss"] == pytest.approx(c, rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_fsdp2_sharded_checkpoint_resumes_on_other_world_size(tmp_path):
    """Save after 1 step on 2 ranks; resume on 2 ranks and on 1 rank: the curve goes on unchanged."""
    optim_cfg = {"lr": 1e-3, "token_budget": 40, "warmup_steps": 2}
    full = run_worker(tmp_path, 2, "fsdp", {"lora_rank": 0}, optim_cfg, "full")
    ck = tmp_path / "ck"
    first = run_worker(tmp_path, 2, "fsdp", {"lora_rank": 0}, optim_cfg, "first", ["--steps", "1", "--save", str(ck)])
    for nproc in (2, 1):
        rest = run_worker(tmp_path, nproc, "fsdp", {"lora_rank": 0}, optim_cfg, f"rest{nproc}",
                          ["--resume", str(ck), "--skip", "1"])
        got = [m["loss"] for m in first + rest]
        assert got == pytest.approx([m["loss"] for m in full], rel=1e-5, abs=1e-7)
        assert [m["optimizer_steps"] for m in rest] == [2.0, 3.0]


def test_a_world_of_one_trains_as_one_process(tmp_path):
    """An in-process vLLM engine forms a process group of one for its worker; the trainer beside it must not
    shard over it (on an H100 that cost the bf16 compute copy and the compiled layers: 4.5x the step time).
    In such a world the engine trains as a plain process, with the plain engine's curve."""
    import torch.distributed as dist

    from swarmkit.training.lm import dist_info

    optim_cfg = {"lr": 1e-3, "token_budget": 40}
    plain = FSDPEngine(tiny_model_dir(), {"lora_rank": 0}, optim_cfg, GRPO())
    want = [plain.train_step(make_batch(seed=k, old=-6.0))["loss"] for k in range(2)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert dist_info() == (True, 0, 1)
        engine = FSDPEngine(tiny_model_dir(), {"lora_rank": 0}, optim_cfg, GRPO())
        assert not engine.distributed
        got = [engine.train_step(make_batch(seed=k, old=-6.0))["loss"] for k in range(2)]
    finally:
        dist.destroy_process_group()
    assert got == pytest.approx(want, rel=1e-6, abs=1e-8)
    assert not any(type(m).__name__.startswith("FSDP") for m in engine.policy.modules())
