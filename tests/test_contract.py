"""The plugin contract is the truth: a plugin written only from ``swarmkit.contract`` trains,
and one that misses part of it fails when loaded, naming what is missing.

The minimal algorithm and engine below import nothing of swarmkit but
``swarmkit.contract`` (and ``swarmkit.hookimpl`` to register them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from swarmkit import hookimpl
from swarmkit.contract import Algorithm, LossInputs, OptimEngine, TrainSample

VOCAB = 512  # the built-in tiny tokenizer's vocabulary


# --------------------------------------------------------------------------- a third party's plugin
class MeanBaselineAlgorithm(Algorithm):
    """REINFORCE with the group mean as baseline, written from the contract alone."""

    name = "mean_baseline"

    def __init__(self, name: str = "mean_baseline"):
        self.seen_advantages: list[float] = []

    def episode_advantages(self, rewards: Sequence[float], groups: Sequence[str]) -> list[float]:
        by_group: dict[str, list[float]] = {}
        for r, g in zip(rewards, groups, strict=True):
            by_group.setdefault(g, []).append(r)
        adv = [r - sum(by_group[g]) / len(by_group[g]) for r, g in zip(rewards, groups, strict=True)]
        self.seen_advantages.extend(adv)
        return adv

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        adv = inputs.advantages if inputs.advantages.dim() == 2 else inputs.advantages[:, None]
        per_token = -inputs.logprobs * adv * inputs.mask
        loss = per_token.sum() / inputs.mask.sum().clamp(min=1)
        return loss, {"loss": float(loss.detach())}


class BigramEngine(OptimEngine):
    """A bigram model trained by SGD, written from the contract alone (it ignores the HF model)."""

    def __init__(self, model_path: str, model_cfg: dict[str, Any], optim_cfg: dict[str, Any], algo: Algorithm):
        torch.manual_seed(0)
        self.algo = algo
        self.model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=float(optim_cfg.get("lr", 0.5)))
        self.batches: list[list[TrainSample]] = []

    def logprobs(self, s: TrainSample) -> torch.Tensor:
        ids = torch.tensor(s.input_ids)
        lp = torch.log_softmax(self.model(ids[:-1]), -1).gather(1, ids[1:, None]).squeeze(1)
        return torch.cat([torch.zeros(1), lp])  # (T,) aligned with input_ids

    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        self.batches.append(list(batch))
        t = max(len(s.input_ids) for s in batch)

        def pad(rows: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([torch.cat([r, torch.zeros(t - len(r))]) for r in rows])

        lp = pad([self.logprobs(s) for s in batch])
        inputs = LossInputs(
            logprobs=lp, old_logprobs=lp.detach(),
            advantages=pad([torch.tensor(s.advantages, dtype=torch.float32) for s in batch]),
            mask=pad([torch.tensor(s.loss_mask, dtype=torch.float32) for s in batch]))
        loss, metrics = self.algo.loss(inputs)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.optimizer_steps += 1
        self.train_steps += 1
        return {**metrics, "trained_tokens": float(inputs.mask.sum())}

    def export_weights(self) -> Iterable[tuple[str, Any]]:
        return list(self.model.state_dict().items())

    def save_checkpoint(self, path: str) -> None:
        torch.save({"model": self.model.state_dict(), "steps": self.optimizer_steps}, f"{path}/bigram.pt")

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(f"{path}/bigram.pt")
        self.model.load_state_dict(state["model"])
        self.optimizer_steps = self.train_steps = int(state["steps"])


class ThirdParty:
    @hookimpl
    def register_algos(self, register):
        register("mean_baseline", f"{__name__}:MeanBaselineAlgorithm")
        register("old_style", f"{__name__}:OldStyleAlgorithm")
        register("no_token_adv", f"{__name__}:ValuesWithoutTokenAdvantages")
        register("bad_agg", f"{__name__}:BadAggregation")
        register("not_an_algorithm", f"{__name__}:NotAnAlgorithm")

    @hookimpl
    def register_optims(self, register):
        register("bigram", f"{__name__}:BigramEngine")
        register("no_export", f"{__name__}:EngineWithoutExport")

    @hookimpl
    def register_match_strategies(self, register):
        register("undeclared", f"{__name__}:UNDECLARED")


# --------------------------------------------------------------------------- plugins that miss the contract
class OldStyleAlgorithm(Algorithm):
    """Written to the old ABC (``advantages(batch)``): it used to train on all-zero advantages."""

    def __init__(self, **config: Any):
        pass

    def advantages(self, batch: Any) -> Any:
        return [1.0, -1.0]

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return inputs.logprobs.sum(), {}


class ValuesWithoutTokenAdvantages(MeanBaselineAlgorithm):
    needs_values = True


class BadAggregation(MeanBaselineAlgorithm):
    loss_agg = "sum"


class NotAnAlgorithm:
    def __init__(self, **config: Any):
        pass

    def loss(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        return inputs.logprobs.sum(), {}


class EngineWithoutExport(OptimEngine):
    def __init__(self, **kwargs: Any):
        pass

    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        return {}

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...


class UndeclaredMatch:
    def key(self, block: Any) -> Any:
        return block.text


UNDECLARED = UndeclaredMatch()


@pytest.fixture()
def third_party(monkeypatch):
    from swarmkit import plugins
    from swarmkit.plugins import loader

    monkeypatch.setattr(loader, "_state", plugins.build_state(extra_plugins=[("third-party", ThirdParty())]))
    yield
    plugins.reset()


def records(rewards: Sequence[float]) -> list[Any]:
    """One task, one episode per reward: the same prompt, a different two-token answer each."""
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.pool import EpisodeRecord
    from swarmkit.timelines import Block, Timeline

    tok = build_tiny_tokenizer()
    prompt = tok.encode("What is 2+2?")
    out = []
    for i, r in enumerate(rewards):
        answer = tok.encode(" 4" if r > 0 else " 5")
        tl = Timeline([Block("user", "What is 2+2?", prompt), Block("llm", "4" if r > 0 else "5", answer,
                                                                    logprobs=[-1.0] * len(answer))])
        out.append(EpisodeRecord(episode_id=f"e{i}", task_id="t", client_id="c", reward=r,
                                 timelines=[tl.to_dict()], policy_version=0))
    return out


# --------------------------------------------------------------------------- tests
def test_a_plugin_written_from_the_contract_alone_trains(third_party, tmp_path):
    from swarmkit.training import Trainer

    trainer = Trainer({"path": "builtin:tiny", "lora_rank": 0}, {"name": "bigram", "lr": 0.5},
                      {"name": "mean_baseline"}, run_dir=tmp_path)
    engine, algo = trainer.engine, trainer.algo
    assert isinstance(engine, BigramEngine) and isinstance(algo, MeanBaselineAlgorithm)
    batch = records([1.0, 0.0, 1.0, 0.0])
    losses = [trainer.step(batch)["loss"] for _ in range(5)]
    assert algo.seen_advantages[:4] == [0.5, -0.5, 0.5, -0.5]  # non-zero, from the contract's method
    samples = engine.batches[0]
    assert {round(a, 6) for s in samples for a, m in zip(s.advantages, s.loss_mask, strict=True) if m} == {0.5, -0.5}
    assert losses[-1] < losses[0]  # the loss moves
    rewarded = next(s for s in samples if s.advantages[-1] > 0)
    punished = next(s for s in samples if s.advantages[-1] < 0)
    with torch.no_grad():
        assert engine.logprobs(rewarded)[-1] > engine.logprobs(punished)[-1]
    assert trainer.global_step == 5
    folder = trainer.save_checkpoint()
    assert trainer.latest_checkpoint() == folder


def test_an_algorithm_written_to_the_old_abc_fails_at_load_naming_the_method(third_party):
    from swarmkit.training import build_algo

    with pytest.raises(TypeError, match=r"episode_advantages\(rewards, groups\) is not implemented"):
        build_algo({"name": "old_style"})


@pytest.mark.parametrize(("name", "message"), [
    ("no_token_adv", r"needs_values is True but token_advantages"),
    ("bad_agg", r"loss_agg must be one of"),
    ("not_an_algorithm", r"must be a class subclassing swarmkit.contract.Algorithm"),
])
def test_an_algorithm_that_misses_the_contract_fails_at_load(third_party, name, message):
    from swarmkit.training import build_algo

    with pytest.raises(TypeError, match=message):
        build_algo({"name": name})


def test_an_engine_that_misses_a_method_fails_at_load_naming_it(third_party):
    from swarmkit.plugins import load_component

    with pytest.raises(TypeError, match="optim 'no_export'.*does not implement export_weights"):
        load_component("optim", "no_export")


def test_a_match_strategy_without_its_declarations_fails_at_load(third_party):
    from swarmkit.plugins import load_component

    with pytest.raises(TypeError, match="lacks stable_keys, key_field"):
        load_component("match", "undeclared")


def test_every_built_in_component_meets_its_contract():
    from swarmkit.plugins import get_registry

    for component in get_registry():
        if component.available:
            component.load()  # checks the contract


def test_old_import_paths_still_work():
    import swarmkit.contract as contract
    import swarmkit.interfaces as interfaces
    import swarmkit.trainer as old_trainer
    import swarmkit.training as training

    assert interfaces.Algorithm is contract.Algorithm and interfaces.BatchingPolicy is contract.BatchingPolicy
    assert old_trainer.Trainer is training.Trainer and old_trainer.TrainSample is contract.TrainSample


def test_the_algorithm_resolves_its_keys_for_the_trainer_mode():
    """``trainer.mode`` reaches the algorithm through ``Algorithm.resolve_config``: grpo's and ppo's
    ``decoupled: null`` is on in async, off in sync; an explicit value and a third party's group
    (the contract's default) pass unchanged."""
    from swarmkit.training.trainer import resolve_algo_config

    assert MeanBaselineAlgorithm.resolve_config({"name": "mean_baseline"}, trainer_mode="async") == \
        {"name": "mean_baseline"}
    for name in ("grpo", "ppo"):
        assert resolve_algo_config({"name": name}, "async")["decoupled"] is True
        assert resolve_algo_config({"name": name, "decoupled": None}, "sync")["decoupled"] is False
        assert resolve_algo_config({"name": name, "decoupled": False}, "async")["decoupled"] is False
        assert resolve_algo_config({"name": name, "decoupled": True}, "sync")["decoupled"] is True


def test_the_composition_root_hands_the_trainer_mode_on(monkeypatch, tmp_path):
    """``make_trainer`` knows no algorithm's keys: it passes ``trainer.mode`` and the ``algo`` group as is."""
    from swarmkit.apps import wiring

    seen: dict[str, Any] = {}
    monkeypatch.setattr(wiring, "Trainer", lambda *args, **kwargs: seen.update(args=args, **kwargs))
    algo = {"name": "grpo", "decoupled": None}
    wiring.make_trainer({"model": {}, "optim": {"name": "fsdp"}, "algo": algo, "match": "text", "seed": 0,
                         "trainer": {"mode": "async"}}, tmp_path)
    assert seen["trainer_mode"] == "async" and seen["args"][2] == algo
