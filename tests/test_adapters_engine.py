"""Several LoRA adapters in one fsdp engine (model.adapters): config, isolation, per-adapter state, checkpoints."""

from __future__ import annotations

import pytest
import torch

from swarmkit.config.schema import AdapterSpec, ModelConfig, parse_adapters
from swarmkit.models import tiny_model_dir
from swarmkit_plugins.algo_rl.grpo import GRPO
from swarmkit_plugins.optim_fsdp.engine import FSDPEngine
from tests.test_optim_fsdp import make_batch

torch.set_num_threads(1)

MODEL = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
         "adapters": ["one", {"name": "two", "lr": 5e-3}]}


def engine(**model) -> FSDPEngine:
    return FSDPEngine(tiny_model_dir(), {**MODEL, **model}, {"lr": 1e-3, "token_budget": 64}, GRPO())


def lora_of(eng: FSDPEngine, name: str) -> dict[str, torch.Tensor]:
    return {t.module + k: v.clone() for t in eng.export_lora(name) for k, v in (("A", t.a), ("B", t.b))}


def base_of(eng: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in eng.policy.named_parameters() if ".lora_" not in n}


# --------------------------------------------------------------------------- config
def test_adapter_specs_parse_and_refuse_bad_names():
    specs, problems = parse_adapters(["spies", {"name": "civilians", "lr": 1e-4}])
    assert specs == [AdapterSpec("spies"), AdapterSpec("civilians", 1e-4)] and not problems
    _, problems = parse_adapters(["ok", "ok", "has space", "lora", {"name": "x", "lr": -1}, {"name": "y", "rate": 1}, 3])
    text = "\n".join(problems)
    for part in ("listed twice", "'has space'", "lr: must be a number > 0", "y.rate" if False else "rate: unknown key", "'lora' is part of peft's prefix",
                 "3"):
        assert part in text, (part, text)
    with pytest.raises(ValueError, match="lora_rank > 0"):
        ModelConfig(lora_rank=0, adapters=["spy"]).adapter_specs()
    with pytest.raises(ValueError, match="also model.name"):
        ModelConfig(name="spy", adapters=["spy"]).adapter_specs()
    assert ModelConfig().adapter_specs() == []


def test_config_refuses_what_adapters_do_not_support_yet():
    from swarmkit.config.compose import compose_checked as compose
    from swarmkit.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        compose(["model=tiny", "model.lora_rank=4", "model.adapters=[spy,civ]", "backend=sglang", "trainer.mode=async",
                 "optim=deepspeed"])
    text = str(err.value)
    for part in ("backend=sglang", "trainer.mode=async", "optim=deepspeed", "not supported with model.adapters yet",
                 "mode=local runs one task client"):
        assert part in text, (part, text)
    with pytest.raises(ConfigError, match="lora_rank > 0"):
        compose(["model=tiny", "model.adapters=[spy,civ]"])
    with pytest.raises(ConfigError, match="enable_lora=false"):
        compose(["mode=server", "model=tiny", "model.lora_rank=4", "model.adapters=[spy,civ]", "backend=vllm",
                 "backend.enable_lora=false"])
    compose(["mode=server", "model=tiny", "model.lora_rank=4", "model.adapters=[spy,civ]", "backend=vllm"])
    cfg = compose(["mode=server", "model=tiny", "model.lora_rank=4", "model.adapters=[spy,{name:civ,lr:0.01}]"])
    assert ModelConfig.of(cfg.model).adapter_specs() == [AdapterSpec("spy"), AdapterSpec("civ", 0.01)]


def test_an_adapter_may_batch_on_its_own_terms():
    """model.adapters[i].batching: keys laid over the batching group, checked by the policy they name."""
    from swarmkit.config.compose import compose_checked as compose
    from swarmkit.errors import ConfigError

    base = ["mode=server", "model=tiny", "model.lora_rank=4", "batching=c2", "batching.batch_size=4"]
    cfg = compose([*base, "model.adapters=[spy,{name:civ,batching:{batch_size:1,rollouts_per_task:2}}]"])
    specs = ModelConfig.of(cfg.model).adapter_specs()
    assert specs[0].batching == {} and specs[1].batching == {"batch_size": 1, "rollouts_per_task": 2}
    compose([*base, "model.adapters=[spy,{name:civ,batching:{name:c1}}]"])  # another policy
    with pytest.raises(ConfigError) as err:
        compose([*base, "model.adapters=[{name:spy,batching:{batch_sise:1}},{name:civ,batching:{name:c9}}]"])
    text = str(err.value)
    for part in ("model.adapters[spy].batching.batch_sise: unknown key", "model.adapters[civ].batching:", "c9"):
        assert part in text, (part, text)
    with pytest.raises(ConfigError, match=r"model.adapters\[0\].batching: expected a mapping"):
        compose([*base, "model.adapters=[{name:spy,batching:3}]"])


# --------------------------------------------------------------------------- engine
def test_a_step_trains_only_the_selected_adapter_with_its_own_optimizer():
    eng = engine()
    assert eng.adapters is not None and eng.adapters.names == ["one", "two"]
    a0, b0, base0 = lora_of(eng, "one"), lora_of(eng, "two"), base_of(eng)
    assert any(not torch.equal(a0[k], b0[k]) for k in a0 if k.endswith("A"))  # seeded apart
    eng.select_adapter("one")
    m = eng.train_step(make_batch(0))
    assert m["optimizer_steps"] == 1 and m["lr"] == pytest.approx(1e-3)
    a1, b1 = lora_of(eng, "one"), lora_of(eng, "two")
    assert any(not torch.equal(a0[k], a1[k]) for k in a0)  # a moved
    assert all(torch.equal(b0[k], b1[k]) for k in b0)  # b untouched
    assert all(torch.equal(v, base_of(eng)[k]) for k, v in base0.items())  # the base is frozen
    eng.select_adapter("two")
    m = eng.train_step(make_batch(1))
    assert m["optimizer_steps"] == 1 and m["lr"] == pytest.approx(5e-3)  # b's own counter and lr
    assert all(torch.equal(a1[k], lora_of(eng, "one")[k]) for k in a1)
    assert eng.adapter_steps() == {"one": 1, "two": 1}
    assert len(eng.adapters._state["one"]["optimizer"].state) > 0 and \
        eng.adapters._state["one"]["optimizer"] is not eng.optimizer


def test_export_weights_merges_only_the_active_adapter():
    eng = engine()
    eng.select_adapter("two")
    eng.train_step(make_batch(2))
    merged = dict(eng.export_weights())
    base = {n[len("lm.base_model.model."):].replace(".base_layer", ""): p
            for n, p in eng.policy.named_parameters() if ".lora_" not in n}
    for t in eng.export_lora("two"):
        want = base[t.module + ".weight"] + t.scale * t.b @ t.a
        got = merged[t.module + ".weight"]
        # on a GPU the export is the bf16 compute weights (docs/training.md): compare at that precision
        tol = dict(rtol=1e-5, atol=1e-6) if got.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **tol)


def test_checkpoint_keeps_each_adapter_and_its_optimizer(tmp_path):
    eng = engine()
    for name, seed in (("one", 0), ("two", 1), ("one", 2)):
        eng.select_adapter(name)
        eng.train_step(make_batch(seed))
    eng.select_adapter("two")
    eng.save_checkpoint(str(tmp_path / "ck"))
    assert (tmp_path / "ck/adapters/one/adapter/adapter_config.json").exists()
    assert (tmp_path / "ck/adapters/two/state.pt").exists()
    want = {n: lora_of(eng, n) for n in ("one", "two")}
    # one more step each, then both continue from the checkpoint: a fresh engine must match exactly
    fresh = engine()
    fresh.load_checkpoint(str(tmp_path / "ck"))
    assert fresh.adapter_steps() == {"one": 2, "two": 1}
    for n in ("one", "two"):
        assert all(torch.equal(want[n][k], v) for k, v in lora_of(fresh, n).items())
    for e in (eng, fresh):
        e.select_adapter("one")
        e.train_step(make_batch(5))
    assert all(torch.allclose(lora_of(eng, "one")[k], v, atol=1e-7) for k, v in lora_of(fresh, "one").items())


def test_an_adapter_added_to_the_config_starts_fresh_when_the_others_resume(tmp_path, caplog):
    """model.adapters grown between runs (stop, configure, restart with trainer.resume): the adapters the
    checkpoint holds come back, a new one keeps its initial LoRA (B = 0) and optimizer; one dropped is logged."""
    eng = engine()
    for name, seed in (("one", 0), ("two", 1)):
        eng.select_adapter(name)
        eng.train_step(make_batch(seed))
    eng.save_checkpoint(str(tmp_path / "ck"))
    want = lora_of(eng, "one")
    grown = FSDPEngine(tiny_model_dir(), {**MODEL, "adapters": ["one", "three"]}, {"lr": 1e-3}, GRPO())
    initial = lora_of(grown, "three")
    with caplog.at_level("INFO"):
        grown.load_checkpoint(str(tmp_path / "ck"))
    assert grown.adapter_steps() == {"one": 1, "three": 0}
    assert all(torch.equal(want[k], v) for k, v in lora_of(grown, "one").items())
    assert all(torch.equal(initial[k], v) for k, v in lora_of(grown, "three").items())
    assert all(not v.any() for k, v in lora_of(grown, "three").items() if k.endswith("B"))
    assert "three not in checkpoint" in caplog.text and "no longer lists: not loaded" in caplog.text
    grown.select_adapter("three")  # the new adapter trains, the resumed one is left as it was
    grown.train_step(make_batch(3))
    assert grown.adapter_steps() == {"one": 1, "three": 1}
    assert all(torch.equal(want[k], v) for k, v in lora_of(grown, "one").items())
    plain = FSDPEngine(tiny_model_dir(), {**MODEL, "adapters": []}, {"lr": 1e-3}, GRPO())
    plain.save_checkpoint(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="saved without model.adapters"):
        engine().load_checkpoint(str(tmp_path / "plain"))


@pytest.mark.parametrize("compute_copy", [False, True])
def test_an_adapter_added_at_run_time_is_the_one_listed_from_the_start(compute_copy, monkeypatch, tmp_path):
    """AdapterBank.add (POST /api/v1/admin/adapters): the new adapter is initialised as if model.adapters had
    listed it last, trains with its own optimizer and lr from step 0, leaves the others and the active one as
    they were, and is checkpointed with them. ``compute_copy``: the bf16 compute copy a GPU engine keeps
    (forced on the CPU), whose new tensors must feed their gradients to the fp32 masters."""
    if compute_copy:
        monkeypatch.setattr(FSDPEngine, "_wants_compute_copy", lambda self: True)
    optim = {"lr": 1e-3, "token_budget": 64, "dtype": "bf16" if compute_copy else "fp32"}
    eng = FSDPEngine(tiny_model_dir(), MODEL, optim, GRPO())
    eng.select_adapter("two")
    eng.train_step(make_batch(0))
    before = {n: lora_of(eng, n) for n in ("one", "two")}
    rng = torch.get_rng_state()
    eng.add_adapter(AdapterSpec("three", 2e-3))
    assert torch.equal(rng, torch.get_rng_state())  # the process's random stream is left alone
    assert eng.adapters is not None and eng.adapters.names == ["one", "two", "three"]
    assert eng.adapters.active == "two" and eng.adapter_steps() == {"one": 0, "two": 1, "three": 0}
    listed = FSDPEngine(tiny_model_dir(), {**MODEL, "adapters": [*MODEL["adapters"], "three"]}, optim, GRPO())
    assert all(torch.equal(v, lora_of(listed, "three")[k]) for k, v in lora_of(eng, "three").items())
    eng.select_adapter("three")
    m = eng.train_step(make_batch(1))
    assert m["optimizer_steps"] == 1 and m["lr"] == pytest.approx(2e-3)
    assert any(not torch.equal(v, lora_of(listed, "three")[k]) for k, v in lora_of(eng, "three").items())
    for n in ("one", "two"):
        assert all(torch.equal(before[n][k], v) for k, v in lora_of(eng, n).items())
    if compute_copy:  # the compute copy holds the masters' new values after the step
        assert eng._compute is not None
        masters = dict(eng.policy.named_parameters())
        for name, p in eng._compute.named_parameters():
            if ".three." in name:
                torch.testing.assert_close(p.float(), masters[name].float(), rtol=1e-2, atol=1e-3)
    eng.save_checkpoint(str(tmp_path / "ck"))
    listed.load_checkpoint(str(tmp_path / "ck"))  # a restart that lists it resumes it
    assert listed.adapter_steps() == {"one": 0, "two": 1, "three": 1}
    with pytest.raises(ValueError, match="exists already"):
        eng.add_adapter(AdapterSpec("one"))
    eng.remove_adapter("three")  # the undo of a failed add
    assert eng.adapters.names == ["one", "two"] and eng.adapters.active in ("one", "two")
    assert "three" not in eng.policy.lm.peft_config


def test_one_adapter_trains_bit_for_bit_as_the_plain_lora_model():
    """model.adapters=[x] and a plain LoRA model of the same seed start from the same LoRA tensors and take
    the same steps: the adapters' code path adds nothing of its own to what N = 1 learns (docs/multi_model.md)."""
    plain, one = engine(adapters=[]), engine(adapters=["solo"])
    assert one.adapters is not None and plain.adapters is None

    def loras(eng: FSDPEngine, name: str) -> dict[str, torch.Tensor]:
        return {n.replace(f".{name}.", "."): p.detach().clone() for n, p in eng.policy.named_parameters()
                if ".lora_" in n}

    def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
        return a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())

    start = loras(plain, "default")
    assert len(start) == 8 and same(start, loras(one, "solo"))
    for seed in range(3):
        mp, ma = plain.train_step(make_batch(seed)), one.train_step(make_batch(seed))
        assert [mp[k] for k in ("loss", "grad_norm", "lr")] == [ma[k] for k in ("loss", "grad_norm", "lr")]
    after = loras(plain, "default")
    assert not same(after, start)  # it trained
    assert same(after, loras(one, "solo"))
