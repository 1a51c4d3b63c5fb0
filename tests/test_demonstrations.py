"""Supervised warm start: demonstrated conversations are recorded with their assistant turns
trained, become samples with advantage 1 and engine-scored old logprobs, and the engine's
update on them is the gradient of the token NLL."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf

from swarmkit.pool.records import EpisodeRecord
from swarmkit.tasks import make_tasks
from swarmkit.tasks.calc_agent import demonstration
from swarmkit.timelines import Timeline
from swarmkit.training.samples import build_samples
from swarmkit.training.trainer import build_algo


def _config(train_cfg, template="builtin:smollm2_tools"):
    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.model.chat_template = template
    return cfg


def _demo(h, ep, demo):
    return h.tc.post(f"/api/v1/episodes/{ep['episode_id']}/demonstration", json=demo,
                     headers={"Authorization": f"Bearer {ep['api_key']}"})


def test_a_demonstration_trains_exactly_the_assistant_turns(make, train_cfg):
    h = make(config=_config(train_cfg))
    task = make_tasks("calc_agent", 1, split="eval")[0]
    demo = demonstration(task)
    ep = h.register(task_id=task.task_id)
    r = _demo(h, ep, demo)
    assert r.status_code == 201, r.text
    tl = Timeline.from_dict(h.tc.get(f"/api/v1/episodes/{ep['episode_id']}/timelines",
                                     headers={"Authorization": f"Bearer {ep['api_key']}"}).json()["timelines"][0])
    assert tl.meta["demonstration"] is True
    renderer = h.srv.renderer
    whole = renderer.render_text(demo["messages"], demo["tools"], add_generation_prompt=False)
    assert "".join(b.text for b in tl.blocks) == whole
    assert tl.token_ids() == renderer.encode(whole)
    trained = "".join(b.text for b in tl.blocks if b.author == "llm")
    call = json.dumps({"name": "calculator", "arguments": {"expression": task.meta["expression"]}})
    assert trained == f"<tool_call>\n{call}\n</tool_call><|im_end|><answer>{task.answer}</answer><|im_end|>"
    assert r.json()["trained_tokens"] == sum(tl.loss_mask())
    assert h.report(ep, 1.0).json()["accepted"]
    (accepted,) = h.accepted
    assert accepted.meta.get("demonstration") is True


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "x"}]},
     "messages[0].content[0].type"),
])
def test_a_bad_demonstration_is_a_400(make, train_cfg, body, param):
    h = make(config=_config(train_cfg))
    r = _demo(h, h.register(), body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_demonstration_needs_the_episode_key(make, train_cfg):
    h = make(config=_config(train_cfg))
    a, b = h.register(), h.register()
    demo = demonstration(make_tasks("calc_agent", 1)[0])
    r = h.tc.post(f"/api/v1/episodes/{a['episode_id']}/demonstration", json=demo,
                  headers={"Authorization": f"Bearer {b['api_key']}"})
    assert r.status_code in (403, 404)


def _record(timelines, reward=1.0, demo=False, task="t"):
    return EpisodeRecord(episode_id=f"e{id(timelines)}", task_id=task, client_id="c", reward=reward,
                         timelines=[t.to_dict() for t in timelines], policy_version=0,
                         meta={"demonstration": True} if demo else {})


def _timeline(ids, mask, demo):
    from swarmkit.timelines import Block

    blocks = [Block("user", "p", ids[:2], [0.0, 0.0], [0, 0]),
              Block("llm", "a", ids[2:], [-1.0] * (len(ids) - 2), mask)]
    return Timeline(blocks=blocks, meta={"demonstration": True} if demo else {})


def test_demonstration_samples_get_advantage_one_and_engine_scored_logprobs():
    algo = build_algo({"name": "grpo"})
    demo = _record([_timeline([1, 2, 3, 4], [1, 1], True)], demo=True)
    rl = [_record([_timeline([1, 2, 5, 6], [1, 1], False)], reward=r, task="q") for r in (0.0, 1.0)]
    samples = build_samples([demo, *rl], algo)
    demos = [s for s in samples if s.demonstration]
    assert len(demos) == 1 and len(samples) == 3
    assert demos[0].advantages == [0.0, 0.0, 1.0, 1.0]
    assert all(math.isnan(v) for v in demos[0].old_logprobs)
    assert sorted(s.advantages[-1] for s in samples if not s.demonstration) == pytest.approx([-0.7071, 0.7071], abs=1e-3)


def test_demonstrations_are_refused_by_an_algorithm_with_a_value_head():
    with pytest.raises(ValueError, match="value head"):
        build_samples([_record([_timeline([1, 2, 3, 4], [1, 1], True)], demo=True)], build_algo({"name": "ppo"}))


def test_the_engine_gradient_on_demonstrations_is_the_nll_gradient(monkeypatch):
    """The gradient the engine steps with on a demonstration equals the gradient of the mean token NLL,
    and the step reports that NLL (``sft_nll``)."""
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    torch.manual_seed(0)
    engine = FSDPEngine(tiny_model_dir(), {"lora_rank": 0}, {"lr": 1e-3, "token_budget": 64}, GRPO())
    ids = [1, 5, 9, 13, 17, 21, 25, 29]
    tl = _timeline(ids, [1] * (len(ids) - 2), True)
    (sample,) = build_samples([_record([tl], demo=True)], GRPO())
    grads = {}
    step = engine._optimizer_step

    def capture():
        grads.update({n: p.grad.detach().clone() for n, p in engine.policy.named_parameters() if p.grad is not None})
        return step()

    monkeypatch.setattr(engine, "_optimizer_step", capture)
    reference = {n: p.detach().clone() for n, p in engine.policy.named_parameters()}
    out = engine.train_step([sample])
    # the same model, plain NLL of the trained tokens (positions 2.. predicted from 1..)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    own = dict(ref.named_parameters())
    with torch.no_grad():
        for n, p in reference.items():
            key = next(k for k in own if n.endswith(k))
            own[key].copy_(p)
    x = torch.tensor([ids])
    lp = torch.log_softmax(ref(x).logits[0, :-1].float(), -1).gather(-1, x[0, 1:, None])[:, 0]
    nll = -lp[1:].mean()
    nll.backward()
    assert out["sft_nll"] == pytest.approx(float(nll), rel=1e-4)  # the supervised loss is reported as such
    compared = 0
    for n, g in grads.items():
        key = next(k for k in own if n.endswith(k))
        torch.testing.assert_close(g, own[key].grad, rtol=1e-4, atol=1e-6)
        compared += 1
    assert compared > 10


def test_a_demonstration_batch_steps_with_sft_lr_and_a_sampled_one_with_lr(monkeypatch):
    """``optim.sft_lr`` is the learning rate of the warm start's steps; RL steps keep ``optim.lr``."""
    from swarmkit.models import tiny_model_dir
    from swarmkit_plugins.algo_rl.grpo import GRPO
    from swarmkit_plugins.optim_fsdp.engine import FSDPEngine

    engine = FSDPEngine(tiny_model_dir(), {"lora_rank": 0},
                        {"lr": 1e-4, "sft_lr": 2e-3, "warmup_steps": 2, "token_budget": 64}, GRPO())
    seen: list[float] = []
    step = engine._optimizer_step

    def capture():
        seen.append(engine.optimizer.param_groups[0]["lr"])
        return step()

    monkeypatch.setattr(engine, "_optimizer_step", capture)
    ids = [1, 5, 9, 13, 17, 21]
    (demo,) = build_samples([_record([_timeline(ids, [1] * 4, True)], demo=True)], GRPO())
    sampled = build_samples([_record([_timeline(ids, [1] * 4, False)], reward=r, task="q") for r in (0.0, 1.0)], GRPO())
    for batch in ([demo], [demo], sampled, [demo], [demo, *sampled]):
        engine.train_step(batch)
    # warm-up over 2 steps (×0.5, then ×1) applies in both phases; a mixed batch trains at lr
    assert seen == pytest.approx([1e-3, 2e-3, 1e-4, 2e-3, 1e-4])


def test_sft_lr_must_be_positive():
    from swarmkit.config.compose import compose_checked
    from swarmkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"optim.sft_lr: must be > 0"):
        compose_checked(["optim.sft_lr=0"])
