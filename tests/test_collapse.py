"""The collapse alarm (issue 34): the signal maths as pure functions, the alarm's counting, and a real
server (tiny model, real trainer) driven to collapse: the alarm fires, pauses training, or rolls back
to the checkpoint before its window with a lower learning rate and trains on."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
from omegaconf import OmegaConf

from swarmkit.apps.serve import start_server_thread
from swarmkit.client import SwarmClient
from swarmkit.config.schema import CollapseConfig, TrainerConfig
from swarmkit.pool.records import EpisodeRecord
from swarmkit.swarm.collapse import (
    ENTROPY,
    FLAT,
    GROUPS,
    IDENTICAL,
    SAMPLED_NLL,
    WARM_ENTROPY,
    CollapseAlarm,
    collapse_signals,
    entropy_floor,
    group_signals,
    is_flat,
    rollout_key,
    sampled_nll,
    task_metrics,
)

TOKEN = "collapse-test-token"


def _tl(generated, logprobs=None, role=None, prompt=(1, 2, 3)):
    blocks = [{"author": "user", "text": "q", "token_ids": list(prompt), "logprobs": [0.0] * len(prompt),
               "loss_mask": [0] * len(prompt)}]
    for ids in generated:
        lps = logprobs if logprobs is not None else [-0.5] * len(ids)
        blocks.append({"author": "llm", "text": "a", "token_ids": list(ids), "logprobs": list(lps),
                       "loss_mask": [1] * len(ids)})
    return {"blocks": blocks, "role": role, "meta": {}}


def _rec(eid, task, reward, timelines, **meta):
    return EpisodeRecord(episode_id=eid, task_id=task, client_id="c", reward=reward, timelines=timelines,
                         policy_version=0, meta=meta)


# ---------------------------------------------------------------------- the signal maths
def test_rollout_key_compares_generated_tokens_only():
    a = _rec("a", "t", 0.0, [_tl([[5, 6]], prompt=(1, 2))])
    b = _rec("b", "t", 0.0, [_tl([[5, 6]], prompt=(9, 9, 9))])  # another prompt, same answer
    c = _rec("c", "t", 0.0, [_tl([[5, 7]])])
    assert rollout_key(a) == rollout_key(b) != rollout_key(c)
    # the role and the turn structure count: one two-token turn is not two one-token turns
    assert rollout_key(_rec("d", "t", 0.0, [_tl([[5], [6]])])) != rollout_key(a)
    assert rollout_key(_rec("e", "t", 0.0, [_tl([[5, 6]], role="spy")])) != rollout_key(a)


def test_group_shares_against_a_direct_count():
    same = [[4, 4]]
    records = [
        # task a: identical rollouts, flat rewards
        _rec("a1", "a", 1.0, [_tl(same)]), _rec("a2", "a", 1.0, [_tl(same)]), _rec("a3", "a", 1.0, [_tl(same)]),
        # task b: different rollouts, flat rewards
        _rec("b1", "b", 0.0, [_tl([[1]])]), _rec("b2", "b", 0.0, [_tl([[2]])]),
        # task c: identical rollouts, rewards differ (a noisy reward)
        _rec("c1", "c", 0.0, [_tl(same)]), _rec("c2", "c", 1.0, [_tl(same)]),
        # task d: different rollouts, rewards differ
        _rec("d1", "d", 0.0, [_tl([[1]])]), _rec("d2", "d", 0.5, [_tl([[2]])]),
        # task e: one rollout only (not counted); a demonstration (never counted)
        _rec("e1", "e", 0.0, [_tl(same)]),
        _rec("a4", "a", 0.0, [_tl([[8]])], demonstration=True),
    ]
    out = group_signals(records)
    assert out == {IDENTICAL: 2 / 4, FLAT: 2 / 4, GROUPS: 4.0}
    assert group_signals(records[-2:]) == {}  # no group of two rollouts: nothing measured


def test_flat_groups_per_role():
    assert is_flat([1.0, 1.0, 1.0 + 1e-12])
    assert not is_flat([1.0, 1.0, 0.9])
    # a zero-sum game: the mean over roles is constant, but each role's reward varies: not flat
    assert not is_flat([{"spy": 1.0, "civ": -1.0}, {"spy": -1.0, "civ": 1.0}])
    assert is_flat([{"spy": 1.0, "civ": -1.0}, {"spy": 1.0, "civ": -1.0}])


def test_sampled_nll_is_the_mean_negative_logprob_of_generated_tokens():
    records = [_rec("a", "t", 0.0, [_tl([[1, 2]], logprobs=[-0.1, -0.3]), _tl([[3]], logprobs=[-2.0])]),
               _rec("b", "t", 0.0, [_tl([[4, 5]], logprobs=[math.nan, -1.0])]),  # NaN: not recorded
               _rec("c", "t", 0.0, [_tl([[6]], logprobs=[-9.0])], demonstration=True)]
    records[0].timelines[0]["blocks"][1]["loss_mask"] = [1, 0]  # a masked generated token is not counted
    expected = (0.1 + 2.0 + 1.0) / 3
    assert sampled_nll(records) == pytest.approx(expected, abs=1e-12)
    assert sampled_nll([records[2]]) is None


def test_task_metrics_average_what_clients_report():
    records = [_rec("a", "t", 0.0, [], metrics={"valid_tool_call": 1.0, "turns": 3}),
               _rec("b", "t", 0.0, [], metrics={"valid_tool_call": False}),
               _rec("c", "t", 0.0, [], metrics={"valid_tool_call": "yes", "bad": math.inf}),  # ignored
               _rec("d", "t", 0.0, []),
               _rec("e", "t", 0.0, [], metrics={"valid_tool_call": 1.0}, demonstration=True)]
    assert task_metrics(records) == {"task/turns": 3.0, "task/valid_tool_call": 0.5}


def test_collapse_signals_take_the_trainers_entropy_when_it_reports_one():
    records = [_rec("a", "t", 0.0, [_tl([[1]], logprobs=[-0.2])]), _rec("b", "t", 0.0, [_tl([[1]], logprobs=[-0.4])])]
    out = collapse_signals(records, {})
    assert out[SAMPLED_NLL] == pytest.approx(0.3) and out[ENTROPY] == pytest.approx(0.3)
    assert collapse_signals(records, {"entropy": 1.25})[ENTROPY] == 1.25
    assert collapse_signals(records, {"entropy": math.nan})[ENTROPY] == pytest.approx(0.3)
    assert out[IDENTICAL] == 1.0 and out[FLAT] == 1.0


def test_a_step_of_demonstrations_only_reports_the_warm_entropy_not_the_policys():
    demos = [_rec("d1", "t", 0.0, [_tl([[1, 2]])], demonstration=True),
             _rec("d2", "t", 0.0, [_tl([[1, 2]])], demonstration=True)]
    out = collapse_signals(demos, {"entropy": 0.04})
    assert out == {WARM_ENTROPY: 0.04}  # no groups, no sampled tokens: supervised learning, not sampling
    mixed = [*demos, _rec("s", "t", 0.5, [_tl([[3]], logprobs=[-0.2])])]
    assert collapse_signals(mixed, {"entropy": 0.04})[ENTROPY] == 0.04 and WARM_ENTROPY not in collapse_signals(
        mixed, {"entropy": 0.04})


def test_the_entropy_floor_after_a_warm_start_is_a_share_of_where_it_ended():
    assert entropy_floor(0.05, 0.5, None) == 0.05  # no warm start
    assert entropy_floor(0.05, 0.5, 0.036) == pytest.approx(0.018)
    assert entropy_floor(0.05, 0.5, 1.2) == 0.05  # a warm start that left a wide policy: the floor stays
    assert entropy_floor(0.05, 0.0, 0.036) == 0.05  # the factor off
    assert entropy_floor(0.05, 0.5, math.nan) == 0.05


def test_a_warm_started_run_at_its_own_entropy_is_not_a_collapse_but_a_fall_below_it_is():
    """calc_agent seed 3 (benchmarks/results/learning_robustness_calc_cpu5.json): 8 demonstration steps end
    at 0.034 nats per token, then 6 RL steps at 0.032-0.054 that ended with every held-out item right. The
    absolute floor 0.05 fired on them; the floor 0.5 x 0.034 does not, and still fires on a real fall."""
    cfg = CollapseConfig(patience=3)
    warm = [1.12, 0.95, 0.62, 0.29, 0.17, 0.107, 0.059, 0.034]
    rl = [0.035, 0.043, 0.047, 0.032, 0.035, 0.054]

    def run(alarm, rl_entropies):
        for step, e in enumerate(warm, 1):
            assert alarm.observe(step, {WARM_ENTROPY: e}) is None  # the warm start itself never fires
        return [alarm.observe(len(warm) + i, {ENTROPY: e, FLAT: 0.0, IDENTICAL: 0.0})
                for i, e in enumerate(rl_entropies, 1)]

    alarm = CollapseAlarm(cfg)
    assert run(alarm, rl) == [None] * 6
    assert alarm.warm_entropy == 0.034 and alarm.limits[ENTROPY] == (pytest.approx(0.017), "below")
    # the same numbers under the old absolute rule (factor 0) fire on the third RL step
    old = run(CollapseAlarm(CollapseConfig(patience=3, entropy_warm_factor=0.0)), rl)
    assert [a is not None for a in old] == [False, False, True, False, False, False]
    # a fall to near-deterministic sampling after the warm start still fires, and says which floor
    fell = run(CollapseAlarm(cfg), [0.03, 0.01, 0.004, 0.002, 0.002, 0.001])
    fired = [a for a in fell if a is not None]
    assert len(fired) == 1 and fired[0].step == len(warm) + 4
    assert "entropy_warm_factor 0.5 x the warm start's 0.034" in fired[0].message


def test_a_resumed_run_keeps_the_floor_its_warm_start_lowered(tmp_path):
    """The cycle's checkpoint extra carries the warm start's entropy; a resume from it restores the floor."""
    from swarmkit.swarm.cycle import TrainingCycle

    class Trainer:
        global_step, lr_factor = 12, 1.0
        saved: dict = {}

        def load_checkpoint(self):
            return self.saved

    cycle = TrainingCycle(tmp_path, trainer_factory=lambda cfg, run_dir: Trainer())
    cycle.trainer = Trainer()
    cycle.alarm.observe(4, {WARM_ENTROPY: 0.04})
    Trainer.saved = cycle._checkpoint_extra()
    assert Trainer.saved["warm_entropy"] == 0.04

    resumed = TrainingCycle(tmp_path, trainer_factory=lambda cfg, run_dir: Trainer())
    resumed.trainer = Trainer()
    assert resumed.alarm_status()["entropy_floor"] == 0.05
    resumed._resume()
    status = resumed.alarm_status()
    assert status["warm_entropy"] == 0.04 and status["entropy_floor"] == pytest.approx(0.02)
    Trainer.saved = {"rollbacks": 0}  # a checkpoint from before this key, or of a run with no warm start
    resumed._resume()
    assert resumed.alarm_status()["entropy_floor"] == 0.05
    cycle.pool.close()
    resumed.pool.close()


def test_trainer_config_takes_the_collapse_group_as_a_dict():
    cfg = TrainerConfig(**{"collapse": {"action": "pause", "patience": 2}})
    assert isinstance(cfg.collapse, CollapseConfig) and cfg.collapse.patience == 2 and cfg.collapse.lr_factor == 0.5
    with pytest.raises(TypeError):
        TrainerConfig(collapse={"nope": 1})


# ---------------------------------------------------------------------- the alarm
def test_the_alarm_fires_after_patience_steps_in_a_row_once_per_run():
    alarm = CollapseAlarm(CollapseConfig(patience=3, validity_metric="valid", validity_min=0.5))
    ok = {IDENTICAL: 0.1, FLAT: 0.2, ENTROPY: 1.0, "task/valid": 0.9}
    bad = {**ok, FLAT: 1.0}
    assert alarm.observe(1, ok) is None
    assert alarm.observe(2, bad) is None and alarm.observe(3, bad) is None
    assert alarm.observe(4, ok) is None  # the run is broken: count again
    assert [alarm.observe(s, bad) for s in (5, 6)] == [None, None]
    fired = alarm.observe(7, {IDENTICAL: 0.1, ENTROPY: 1.0})  # flat not measured at step 7: its run stands
    assert fired is None
    fired = alarm.observe(8, bad)
    assert fired is not None and fired.step == 8 and fired.window_start == 5
    assert [c.signal for c in fired.crossings] == [FLAT] and "flat_groups 1.000 > 0.95 for 3 steps" in fired.message
    assert alarm.active is fired
    assert alarm.observe(9, bad) is None and alarm.active is fired  # once per run; still raised
    assert alarm.observe(10, ok) is None and alarm.active is None  # cleared
    # below-thresholds: entropy and the validity metric
    low = {**ok, ENTROPY: 0.01, "task/valid": 0.2}
    assert alarm.observe(11, low) is None and alarm.observe(12, low) is None
    fired = alarm.observe(13, low)
    assert fired is not None and {c.signal for c in fired.crossings} == {ENTROPY, "task/valid"}
    assert alarm.fired == 2
    alarm.reset()
    assert alarm.active is None and alarm.runs == {}


def test_a_disabled_alarm_never_fires():
    alarm = CollapseAlarm(CollapseConfig(enabled=False, patience=1))
    assert alarm.observe(1, {FLAT: 1.0, IDENTICAL: 1.0, ENTROPY: 0.0}) is None


# ---------------------------------------------------------------------- end to end (tiny model, real trainer)
def _serve(train_cfg, run_dir, **collapse):
    cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
    cfg.backend.device = "cpu"
    cfg.logger = []
    cfg.model.lora_rank = 0
    cfg.batching.batch_size, cfg.batching.rollouts_per_task = 2, 2
    cfg.trainer.total_steps = 0
    cfg.trainer.checkpoint_every = 1
    cfg.trainer.keep_checkpoints = 2
    for key, value in collapse.items():
        cfg.trainer.collapse[key] = value
    return start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                           "run_dir": str(run_dir)}}, config=cfg)


def _one_step(c: SwarmClient, step_no: int, flat: bool) -> None:
    """One batch: 2 tasks x 2 rollouts of a 3-token answer; rewards vary unless ``flat``."""
    for task in range(2):
        for k in range(2):
            with c.episode(f"s{step_no}-t{task}") as ep:
                r = httpx.post(ep.base_url + "/chat/completions", headers={"Authorization": f"Bearer {ep.api_key}"},
                               json={"model": "m", "messages": [{"role": "user", "content": f"hi {task}"}],
                                     "max_tokens": 3, "temperature": 1.0}, timeout=60)
                assert r.status_code == 200, r.text
                ep.report(0.5 if flat else float(k), meta={"metrics": {"valid": 1.0}})


def _wait(pred, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        out = pred()
        if out:
            return out
        time.sleep(0.1)
    raise AssertionError("timed out")


def _rows(run_dir, kind="train"):
    return [r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == kind]


@pytest.mark.parametrize("action", ["pause", "rollback"])
def test_a_collapsing_run_raises_the_alarm_and_pauses_or_rolls_back(train_cfg, tmp_path, action):
    """Two healthy steps (rewards vary), then every group flat (a constant reward: GRPO has no signal);
    with patience 2 the alarm fires on the second flat step (steps 3-4). pause: no further step trains
    until the controller resumes; rollback: the server goes back to step 1's checkpoint (step 3's
    episodes were sampled by step 2's weights: suspect too), halves the learning rate, and trains on."""
    h = _serve(train_cfg, tmp_path, patience=2, action=action)
    try:
        with SwarmClient(h.url, token=TOKEN, retry_for=30) as c:
            c.start()
            c.wait_for_state("ROLLING", timeout=120)
            for step_no, flat in ((1, False), (2, False), (3, True), (4, True)):
                _one_step(c, step_no, flat)
                if step_no < 4:
                    _wait(lambda n=step_no: len(_rows(tmp_path)) >= n)
            alarm = _wait(lambda: (a := c.status()["pool"]["alarm"]).get("message")
                          and a["last"]["taken"] != "pending" and a)  # a rollback takes a moment
            rows = _rows(tmp_path)
            assert [r["collapse/flat_groups"] for r in rows[:4]] == [0.0, 0.0, 1.0, 1.0]
            assert all(r["task/valid"] == 1.0 and r["collapse/entropy"] > 0 for r in rows[:4])
            assert rows[3]["collapse/alarm"] == 1.0 and rows[2]["collapse/alarm"] == 0.0
            assert alarm["last"]["step"] == 4 and alarm["last"]["window_start"] == 3
            assert "collapse/flat_groups 1.000 > 0.95 for 2 steps" in alarm["message"]
            assert alarm["last"]["taken"] == action
            lr_before = rows[3]["lr"]
            text = _metrics_text(h.url)
            if action == "pause":
                assert alarm["active"] and alarm["paused"] and "resume_training" in alarm["paused"]
                assert "swarmkit_collapse_alarm 1.0" in text and "swarmkit_training_paused 1.0" in text
                _one_step(c, 5, False)  # episodes are still accepted ...
                time.sleep(1.0)
                st = c.status()
                assert st["global_step"] == 4 and st["pool"]["episodes"] == 4  # ... but nothing trains
                assert httpx.post(h.url + "/api/v1/admin/resume_training",
                                  headers={"Authorization": f"Bearer {TOKEN}"}).json()["resumed"] is True
                _wait(lambda: c.status()["global_step"] == 5)
                assert c.status()["pool"]["alarm"]["paused"] is None
            else:
                assert alarm["rollbacks"] == 1 and alarm["last"]["rolled_back_to"] == 1
                assert alarm["last"]["lr_factor"] == 0.5 and alarm["last"]["retired_episodes"] == 12
                st = c.status()
                assert st["global_step"] == 1 and st["policy_version"] == 1 and not st["pool"]["alarm"]["paused"]
                assert "swarmkit_collapse_rollbacks_total 1.0" in text
                ckpts = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
                assert ckpts[-1] == "step_00000001"
                _one_step(c, 5, False)  # training goes on from step 1, at half the learning rate
                _wait(lambda: c.status()["global_step"] == 2)
                again = _rows(tmp_path)[-1]
                assert again["step"] == 2 and again["lr"] == pytest.approx(lr_before * 0.5)
                assert again["collapse/alarm"] == 0.0
            assert _rows(tmp_path, "alarm")[0]["taken"] == action
    finally:
        h.stop()


def _metrics_text(url: str) -> str:
    return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text


def test_a_flat_groups_alarm_says_that_nothing_is_learned():
    """A newcomer's first alarm is a reward that never varies (the tiny model on arithmetic): the message
    says what that means and what to do, not only the signal's name."""
    alarm = CollapseAlarm(CollapseConfig(patience=2))
    signals = {FLAT: 1.0, IDENTICAL: 0.0, GROUPS: 4.0, ENTROPY: 6.0}
    assert alarm.observe(1, signals) is None
    fired = alarm.observe(2, signals)
    assert fired is not None and "GRPO has no signal and nothing is learned" in fired.message
    assert "partial credit" in fired.message


def test_flat_groups_of_identical_rollouts_are_explained_as_the_collapse():
    alarm = CollapseAlarm(CollapseConfig(patience=1))
    fired = alarm.observe(1, {FLAT: 1.0, IDENTICAL: 1.0, GROUPS: 4.0, ENTROPY: 0.0})
    assert fired is not None and "the policy collapsed" in fired.message and "low entropy" in fired.message
    assert "partial credit" not in fired.message


# ---------------------------------------------------------------------- a real collapse (the main job)
@pytest.mark.slow
def test_a_run_at_ten_times_the_learning_rate_collapses_raises_the_alarm_and_rolls_back(tmp_path):
    """token_rule on the tiny model at ``optim.lr=0.1``, 10x its auto rate: within a few steps every
    group samples one answer (entropy below 0.05 nats per token; on some runs the groups' rewards go
    flat first: the path depends on the order episodes reach the server). The alarm fires within 3 steps
    of that onset; the run goes back to a checkpoint older than the weights that sampled the alarm's
    window, at a tenth of the rate, and trains on from there. A second alarm (``max_rollbacks=1``)
    pauses training, which ends the main job: it never hangs. About a minute on 2 cores."""
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "swarmkit", "model=tiny", "task=token_rule", "task.max_tokens=8", "task.eval_size=4",
         "batching.batch_size=4", "batching.rollouts_per_task=8", "optim.lr=0.1", "seed=1",
         "trainer.total_steps=24", "trainer.checkpoint_every=1", "trainer.collapse.action=rollback",
         "trainer.collapse.lr_factor=0.1", "trainer.collapse.max_rollbacks=1", "logger=[]", "server.port=0",
         f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    every = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    alarms = [i for i, r in enumerate(every) if r["kind"] == "alarm"]
    assert alarms, [(r["step"], r["collapse/entropy"], r["collapse/flat_groups"]) for r in every if r["kind"] == "train"]
    first = alarms[0]
    before, alarm, after = every[:first], every[first], [r for r in every[first + 1:] if r["kind"] == "train"]
    # the onset: the first of the uninterrupted steps up to the alarm at which a signal the alarm names had
    # crossed its threshold (the run's path varies from run to run with the order in which episodes reach
    # the server: mostly the entropy falls first, sometimes every group's rewards go flat first)
    signals = re.findall(r"(collapse/\w+) [\d.]+ ([<>]) ([\d.]+)", alarm["alarm"])

    def collapsed(row: dict) -> bool:
        return any(row[k] < float(v) if op == "<" else row[k] > float(v) for k, op, v in signals)

    trained = [r for r in before if r["kind"] == "train"]
    onset = alarm["step"]
    for r in reversed(trained):
        if not collapsed(r):
            break
        onset = r["step"]
    assert onset > 1 and alarm["step"] - onset <= 2, (onset, alarm)  # fired within 3 steps of the onset
    assert alarm["taken"] == "rollback" and alarm["lr_factor"] == pytest.approx(0.1)
    window_start = int(re.search(r"steps (\d+)\.\.", alarm["alarm"]).group(1))
    assert alarm["rolled_back_to"] <= window_start - 2 and alarm["rolled_back_to"] < onset - 1
    assert after and after[0]["step"] == alarm["rolled_back_to"] + 1  # trains on from the restored weights
    assert all(r["lr"] == pytest.approx(0.01) for r in after)
    # its first batch was sampled by the restored weights: every episode it trained was registered at that
    # version and holds tokens of that version only (what the episodes were sampled with, read from the journal;
    # their entropy is no proxy: on some paths the policy hovered near collapse before the alarm's run of steps,
    # and the restored weights then sample a low-entropy batch too, e.g. 0.004 at step 12 after a rollback to 11)
    import sqlite3

    back = alarm["rolled_back_to"]
    with sqlite3.connect(tmp_path / "journal.sqlite") as db:
        first = db.execute("SELECT policy_version, timelines FROM episodes WHERE status='trained' AND trained_step=?",
                           (back + 1,)).fetchall()
    versions = {v for _, tl in first for t in json.loads(tl) for b in t.get("blocks", []) for v in b.get("versions") or []}
    assert first and {pv for pv, _ in first} == {back} and versions == {back}, (back, {pv for pv, _ in first}, versions)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["collapse_alarm"]["rollbacks"] == 1
    if summary["collapse_alarm"]["paused"]:  # the restored weights collapsed again: paused, the job ended
        assert "training paused at step" in out.stdout
    else:
        assert summary["global_step"] == 24


def test_held_out_fall_counts_only_a_fall_beyond_the_interval_of_the_difference():
    from swarmkit.swarm.collapse import held_out_fall

    assert held_out_fall((0.9, 0.1), (0.5, 0.1)) == pytest.approx(0.4)
    assert held_out_fall((0.9, 0.2), (0.7, 0.2)) is None  # 0.2 < sqrt(0.2² + 0.2²)
    assert held_out_fall((0.5, 0.1), (0.6, 0.1)) is None  # a rise
    assert held_out_fall((0.025, 0.0), (0.0, 0.0)) == pytest.approx(0.025)  # issue 34's tool game: every item lost


def test_the_main_job_says_when_the_held_out_reward_falls(monkeypatch):
    """The collapse alarm watches each step's rollouts; a run that narrows while its entropy stays up got past
    it (multi_calc seed 0 with step notes: 1.069 after the warm start, 0.312 at RL step 10, its real numbers). The main job
    compares every evaluation with the best earlier one and says so in red, and the summary keeps it."""
    from rich.console import Console

    from swarmkit.apps import main_job
    from swarmkit.apps.task_client import EvalResult

    out = Console(record=True, width=300)
    monkeypatch.setattr(main_job, "console", out)
    r = main_job._Run(info=None)  # type: ignore[arg-type]
    r.before = EvalResult(mean=0.0, ci95=0.0, n=16)
    r.midway[24], r.labels[24] = EvalResult(mean=1.069, ci95=0.176, n=16), "after the warm start (step 24)"
    main_job._check_fall(r, "after the warm start (step 24)", r.midway[24])
    r.midway[29], r.labels[29] = EvalResult(mean=0.9, ci95=0.2, n=16), "at step 29"
    main_job._check_fall(r, "at step 29", r.midway[29])  # within the intervals: quiet
    assert r.falls == [] and out.export_text() == ""
    r.midway[34] = EvalResult(mean=0.312, ci95=0.170, n=16)
    main_job._check_fall(r, "at step 34", r.midway[34])
    assert r.falls == [{"at": "at step 34", "mean": 0.312, "ci95": 0.170, "from": "after the warm start (step 24)",
                        "from_mean": 1.069, "from_ci95": 0.176}]
    text = out.export_text()
    assert "held-out reward at step 34, 0.312 ± 0.170, fell below after the warm start (step 24)'s 1.069" in text
