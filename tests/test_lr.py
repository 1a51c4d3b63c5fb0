"""``optim.lr: auto`` (swarmkit/config/lr.py): the table, its validation, and the engine resolving it."""

from __future__ import annotations

import math

import pytest

from swarmkit.config.lr import (
    FULL_LR_ANCHORS,
    LORA_FACTOR,
    MAX_LR,
    auto_lr,
    base_param_count,
    full_weight_lr,
    lr_problem,
)
from swarmkit.training.config import EngineConfig

TINY, SMOLLM2 = 351_488, 134_515_008  # the built-in models' parameters (tied embeddings once)


def test_the_table_at_its_anchors_and_between_them():
    for params, lr in FULL_LR_ANCHORS:
        assert full_weight_lr(params) == pytest.approx(lr)
    assert full_weight_lr(1) == FULL_LR_ANCHORS[0][1] and full_weight_lr(1e13) == FULL_LR_ANCHORS[-1][1]
    # log-log interpolation: halfway in log(params) is the geometric mean of the two rates
    (n0, lr0), (n1, lr1) = FULL_LR_ANCHORS[1], FULL_LR_ANCHORS[2]
    assert full_weight_lr(math.sqrt(n0 * n1)) == pytest.approx(math.sqrt(lr0 * lr1))
    sizes = [10 ** (k / 4) for k in range(16, 52)]
    rates = [full_weight_lr(n) for n in sizes]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))  # never higher for a bigger model


def test_auto_lr_of_the_built_in_models_and_lora():
    assert auto_lr(TINY, lora=False) == 1e-2
    assert auto_lr(SMOLLM2, lora=False) == pytest.approx(3e-5, rel=0.01)
    assert auto_lr(SMOLLM2, lora=True) == pytest.approx(3e-4, rel=0.01)  # the rate tuned for LoRA on SmolLM2
    assert auto_lr(7_000_000_000, lora=False) == pytest.approx(1e-6)
    assert auto_lr(7_000_000_000, lora=True) == pytest.approx(1e-6 * LORA_FACTOR)
    assert auto_lr(TINY, lora=True) == MAX_LR  # capped
    with pytest.raises(ValueError, match="0 parameters"):
        auto_lr(0, lora=False)


def test_lr_values_are_checked():
    assert EngineConfig().lr == "auto"
    for ok in ("auto", "AUTO", 1e-3, 1, "3e-4"):
        assert lr_problem("lr", ok) is None, ok
    assert lr_problem("sft_lr", None, allow_none=True) is None
    assert lr_problem("lr", "fast") == "optim.lr: Value 'fast' is not a number > 0 or 'auto'"
    assert lr_problem("lr", -1.0) == "optim.lr: must be > 0, got -1.0"
    assert lr_problem("lr", None) is not None and lr_problem("lr", True) is not None


def test_base_param_count_leaves_adapters_and_the_value_head_out():
    class P:
        def __init__(self, n):
            self.n = n

        def numel(self):
            return self.n

    named = [("model.embed.weight", P(100)), ("model.q_proj.base_layer.weight", P(16)),
             ("model.q_proj.lora_A.default.weight", P(4)), ("model.q_proj.lora_B.default.weight", P(4)),
             ("value_head.weight", P(3))]
    assert base_param_count(named) == 116


def test_validation_takes_auto_and_refuses_a_word(tmp_path):
    from swarmkit.config.compose import compose_checked
    from swarmkit.errors import ConfigError

    assert compose_checked(["model=tiny"]).optim.lr == "auto"
    assert compose_checked(["model=tiny", "optim.lr=2e-3"]).optim.lr == 2e-3
    with pytest.raises(ConfigError, match="optim.lr: Value 'fast' is not a number > 0 or 'auto'"):
        compose_checked(["model=tiny", "optim.lr=fast"])
    with pytest.raises(ConfigError, match="optim.lr: must be > 0"):
        compose_checked(["model=tiny", "optim.lr=0"])


@pytest.mark.parametrize("lora", [False, True])
def test_the_engine_resolves_auto_from_the_loaded_model(lora):
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    model = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"]} if lora else {"lora_rank": 0}
    e = FSDPEngine(tiny_model_dir(), model, {"lr": "auto", "device": "cpu"}, GRPO())
    assert e.lr_auto and e.base_params == TINY
    assert e.cfg.lr == auto_lr(TINY, lora) and e.current_lr() == pytest.approx(e.cfg.lr)
    fixed = FSDPEngine(tiny_model_dir(), model, {"lr": 2e-3, "device": "cpu"}, GRPO())
    assert not fixed.lr_auto and fixed.current_lr() == pytest.approx(2e-3)


def test_adapters_without_an_lr_get_the_lora_auto_rate(monkeypatch):
    """``model.adapters`` under ``optim.lr: auto``: an adapter without ``lr`` (or with ``lr: auto``) trains
    at the LoRA rate of the base's size, one with a number at that number. MAX_LR is raised so that the
    tiny model's LoRA rate (10x) differs from its full-weight one."""
    import swarmkit.config.lr as lr_mod
    from swarmkit.config.compose import compose_checked
    from swarmkit.config.schema import AdapterSpec, ModelConfig
    from swarmkit.errors import ConfigError
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    cfg = compose_checked(["mode=server", "model=tiny", "model.lora_rank=4",
                           "model.adapters=[one,{name:two,lr:5e-3},{name:three,lr:auto}]"])
    assert cfg.optim.lr == "auto"
    specs = ModelConfig.of(cfg.model).adapter_specs()
    assert specs == [AdapterSpec("one"), AdapterSpec("two", 5e-3), AdapterSpec("three", "auto")]
    with pytest.raises(ConfigError, match=r"model.adapters\[0\].lr: must be a number > 0 or 'auto'"):
        compose_checked(["mode=server", "model=tiny", "model.lora_rank=4", "model.adapters=[{name:a,lr:fast}]"])

    monkeypatch.setattr(lr_mod, "MAX_LR", 1.0)
    lora = auto_lr(TINY, lora=True)
    assert lora == pytest.approx(LORA_FACTOR * auto_lr(TINY, lora=False))
    model = {"lora_rank": 4, "lora_alpha": 8, "lora_target_modules": ["q_proj", "v_proj"],
             "adapters": ["one", {"name": "two", "lr": 5e-3}, {"name": "three", "lr": "auto"}]}
    e = FSDPEngine(tiny_model_dir(), model, {"lr": "auto", "device": "cpu"}, GRPO())
    assert e.lr_auto and e.base_params == TINY  # the adapters' tensors are not counted
    rates = {}
    for name in ("one", "two", "three"):
        e.select_adapter(name)
        rates[name] = e.current_lr()
    assert rates == {"one": pytest.approx(lora), "two": pytest.approx(5e-3), "three": pytest.approx(lora)}
    fixed = FSDPEngine(tiny_model_dir(), model, {"lr": 2e-3, "device": "cpu"}, GRPO())  # a number: the default
    fixed.select_adapter("one")
    assert fixed.current_lr() == pytest.approx(2e-3)
    fixed.select_adapter("three")
    assert fixed.current_lr() == pytest.approx(lora)  # lr: auto asks for the auto rate whatever optim.lr is


def test_docs_show_the_table_of_the_code():
    """docs/training.md ("Learning rate") shows FULL_LR_ANCHORS, LORA_FACTOR and MAX_LR: the code is the
    one source; this keeps the page true to it."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    section = text[text.index("### Learning rate (`optim.lr`, default `auto`)"):]
    section = section[:section.index("\n**Micro-batches")]
    lines = section.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| base parameters"))
    table = lines[head + 2:]
    table = table[:next(i for i, line in enumerate(table) if not line.startswith("|"))]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table]
    unit = {"M": 1e6, "B": 1e9}
    assert len(rows) == len(FULL_LR_ANCHORS), rows
    number = re.compile(r"\d+(?:\.\d+)?(?:e-?\d+)?")
    for (size, full, lora, _), (params, lr) in zip(rows, FULL_LR_ANCHORS, strict=True):
        m = re.search(r"(\d+(?:\.\d+)?)([MB])", size)
        assert m and float(m.group(1)) * unit[m.group(2)] == pytest.approx(params, rel=0.01), (size, params)
        assert float(number.search(full).group()) == pytest.approx(lr), (size, full)
        assert float(number.search(lora).group()) == pytest.approx(auto_lr(int(params), lora=True)), (size, lora)
    assert f"LoRA (× {LORA_FACTOR:g})" in section and f"never above {MAX_LR:.0e}".replace("e-0", "e-") in section
    m = re.search(r"\(1\.5B: (\S+) full, (\S+) LoRA\)", section)
    assert m, "the interpolation example"
    assert float(m.group(1)) == pytest.approx(auto_lr(1_500_000_000, lora=False), rel=0.01)
    assert float(m.group(2)) == pytest.approx(auto_lr(1_500_000_000, lora=True), rel=0.01)
