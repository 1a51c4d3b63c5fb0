"""On-policy distillation (``algo=distill``): the maths against a direct implementation, the teacher client
(retries, clear errors) and a real swarm server as teacher of a real training step with the tiny model."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from swarmkit.contract import TrainSample
from swarmkit.errors import ConfigError
from swarmkit_plugins.algo_rl import losses
from swarmkit_plugins.algo_rl.distill import Distill, distill_advantages, reverse_kl_estimate
from swarmkit_plugins.algo_rl.teacher import TeacherClient, TeacherError

TOKEN = "distill-admin-token-" + "x" * 16


# --------------------------------------------------------------------------- maths
def test_distill_advantages_equal_a_token_by_token_implementation():
    g = torch.Generator().manual_seed(0)
    b, t = 4, 9
    rl = torch.randn(b, t, generator=g, dtype=torch.float64)
    student = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    teacher = -torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    teacher[1, 3] = math.nan  # the teacher's first token (no prefix)
    student[2, 4] = math.nan  # no recorded logprob (constrained decoding)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    for rl_coef, coef, clip in ((0.0, 1.0, 0.0), (1.0, 0.5, 0.0), (0.3, 2.0, 0.7)):
        got = distill_advantages(rl, student, teacher, mask, rl_coef, coef, clip)
        for i in range(b):
            for j in range(t):
                if not mask[i, j]:
                    want = 0.0
                else:
                    gap = float(teacher[i, j]) - float(student[i, j])
                    gap = 0.0 if not math.isfinite(gap) else gap
                    if clip > 0:
                        gap = max(-clip, min(clip, gap))
                    want = rl_coef * float(rl[i, j]) + coef * gap
                assert abs(float(got[i, j]) - want) < 1e-12
    kl = reverse_kl_estimate(student, teacher, mask)
    terms = [float(student[i, j] - teacher[i, j]) for i in range(b) for j in range(t)
             if mask[i, j] and math.isfinite(float(student[i, j] - teacher[i, j]))]
    assert abs(float(kl) - sum(terms) / len(terms)) < 1e-12


def test_the_surrogate_on_distill_advantages_has_the_gradient_of_the_reverse_kl_loss():
    """At ratio 1 (on-policy), GRPO's clipped surrogate with A = teacher − student has the gradient of the
    naive loss mean_t sg(student − teacher) · log p_student, for every loss aggregation mode."""
    g = torch.Generator().manual_seed(1)
    b, t = 3, 7
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    teacher = -torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[:, 0] = 1.0
    adv = distill_advantages(torch.zeros(b, t, dtype=torch.float64), old, teacher, mask, 0.0, 1.0)
    for agg in losses.AGG_MODES:
        lp = old.clone().requires_grad_(True)
        loss, _ = losses.policy_loss(lp, old, adv, mask, 0.2, 0.28, agg, 16.0)
        loss.backward()
        lp2 = old.clone().requires_grad_(True)
        naive = losses.aggregate_loss((lp2.detach() - teacher) * lp2, mask, agg, 16.0)
        naive.backward()
        assert torch.allclose(lp.grad, lp2.grad, atol=1e-6, rtol=0), agg


# --------------------------------------------------------------------------- configuration
def test_distill_config_problems_are_reported_together():
    with pytest.raises(ConfigError) as e:
        Distill(teacher_url="ftp://x", teacher_retries=0, rl_coef=0.0, distill_coef=0.0)
    text = str(e.value)
    assert "teacher_url" in text and "teacher_retries" in text and "distill_coef" in text


# --------------------------------------------------------------------------- the teacher client
def _sample(ids, mask, old, adv=0.5, demo=False):
    return TrainSample(input_ids=list(ids), loss_mask=list(mask), old_logprobs=list(old),
                       advantages=[adv if m else 0.0 for m in mask], demonstration=demo)


def test_teacher_client_retries_passing_failures_and_names_what_it_cannot_use():
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        import json

        body = json.loads(request.content)
        assert body["echo"] is True and body["max_tokens"] == 0 and body["logprobs"] == 0
        if len(calls) == 1:
            return httpx.Response(503, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})
        choices = [{"index": i, "text": "", "logprobs": {"token_logprobs": [None] + [-1.0] * (len(p) - 1)}}
                   for i, p in enumerate(body["prompt"])]
        return httpx.Response(200, json={"choices": choices})

    tc = TeacherClient("http://teacher/v1", retries=3, batch=2, transport=httpx.MockTransport(answer))
    got = tc.score([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    assert [len(x) for x in got] == [3, 2, 4] and math.isnan(got[0][0]) and got[2][1:] == [-1.0] * 3
    assert tc.stats["retries"] == 1 and len(calls) == 3  # one retried, then two batches

    refused = TeacherClient("http://teacher/v1", transport=httpx.MockTransport(
        lambda r: httpx.Response(400, json={"error": {"message": "'echo' is not supported"}})))
    with pytest.raises(TeacherError, match="refused to score: HTTP 400: 'echo' is not supported"):
        refused.score([[1, 2]])
    short = TeacherClient("http://teacher/v1", transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"choices": [{"index": 0, "logprobs": {"token_logprobs": [None]}}]})))
    with pytest.raises(TeacherError, match="share the student's tokenizer"):
        short.score([[1, 2]])
    down = TeacherClient("http://127.0.0.1:9/v1", retries=2, timeout_s=2)
    with pytest.raises(TeacherError, match="after 2 attempt"):
        down.score([[1, 2]])


def test_distill_relabels_trained_tokens_and_leaves_demonstrations_alone():
    def answer(request: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(request.content)
        return httpx.Response(200, json={"choices": [
            {"index": i, "logprobs": {"token_logprobs": [None] + [-0.25] * (len(p) - 1)}}
            for i, p in enumerate(body["prompt"])]})

    algo = Distill(teacher=TeacherClient("http://t/v1", transport=httpx.MockTransport(answer)), rl_coef=1.0)
    s = _sample([1, 2, 3, 4], [0, 1, 1, 0], [0.0, -1.0, -0.5, 0.0])
    demo = _sample([1, 2, 3], [0, 1, 1], [math.nan] * 3, adv=1.0, demo=True)
    m = algo.prepare_samples([s, demo])
    assert s.advantages == pytest.approx([0.0, 0.5 + 0.75, 0.5 + 0.25, 0.0])
    assert demo.advantages == [0.0, 1.0, 1.0]
    assert m["distill_reverse_kl"] == pytest.approx((-0.75 - 0.25) / 2) and m["teacher_tokens"] == 2


# --------------------------------------------------------------------------- a real teacher
@pytest.fixture(scope="module")
def teacher_server(serve_tiny_hf, tmp_path_factory):
    with serve_tiny_hf(tmp_path_factory.mktemp("teacher"), TOKEN) as served:
        yield served


def test_a_swarm_server_teaches_a_training_step_of_the_same_model_with_zero_kl(teacher_server, tmp_path):
    """The teacher serves the tiny model, the student starts from the same weights: the teacher's logprobs of
    the student's own tokens equal the student's (KL ≈ 0, advantages ≈ 0); the scoring episodes are eval
    episodes that the teacher aborted, never samples of its pool."""
    from swarmkit.pool.records import EpisodeRecord
    from swarmkit.training import Trainer

    h, client = teacher_server
    records = []
    for i in range(2):  # the student's rollouts (same weights as the teacher: the hf engine on builtin:tiny)
        with client.episode(f"t{i % 2}") as ep:
            r = httpx.post(f"{ep.base_url}/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                           json={"messages": [{"role": "user", "content": f"say hello {i}"}], "max_tokens": 6,
                                 "seed": i}, timeout=60)
            assert r.status_code == 200, r.text[:300]
            timelines = ep.timelines()
            ep.abort("collected")
        records.append(EpisodeRecord(episode_id=f"e{i}", task_id=f"t{i % 2}", client_id="c", reward=float(i),
                                     timelines=timelines, policy_version=0))
    before = client.status()["episodes"]
    tr = Trainer({"path": "builtin:tiny", "lora_rank": 0}, {"name": "fsdp", "lr": 1e-3, "token_budget": 256},
                 {"name": "distill", "teacher_url": h.url, "teacher_swarm": True, "teacher_api_key": TOKEN},
                 run_dir=tmp_path)
    try:
        m = tr.step(records)
    finally:
        tr.close()
    assert m["teacher_tokens"] > 0 and abs(m["distill_reverse_kl"]) < 1e-4, m
    assert abs(m["distill_adv_mean"]) < 1e-4
    after = client.status()["episodes"]
    assert after["eval_finished"] + after["aborted"] > before["eval_finished"] + before["aborted"]
    assert after["running"] == before["running"]
