"""Decisions of the batching policies C1-C5 on constructed pools."""

from __future__ import annotations

import importlib
import threading

import pytest

from swarmkit.contract import ClientState, PoolEpisode
from swarmkit.errors import ConfigError
from swarmkit.swarm.presence import ClientTracker
from swarmkit_plugins.batching import policies as P
from swarmkit_plugins.batching.schema import BatchingConfig


def pool(spec: list[tuple[str, float] | tuple[str, float, str]]) -> list[PoolEpisode]:
    """Episodes oldest first from ``(task, reward[, family])``; ids are ``task#k``."""
    seen: dict[str, int] = {}
    out = []
    for i, item in enumerate(spec):
        task, reward, fam = (*item, "")[:3]
        k = seen[task] = seen.get(task, -1) + 1
        out.append(PoolEpisode(f"{task}#{k}", task, reward, task_family=fam, accepted_at=float(i)))
    return out


def make(name: str, **kw):
    cfg = {**vars(BatchingConfig()), "name": name, **kw}
    cls = {"c1": P.EpisodeCount, "c2": P.TaskCount, "c3": P.NonDegenerateTaskCount,
           "c4": P.AllClientsReady, "c5": P.AnyClientReady}[name]
    return cls(**cfg)


def test_registered_targets_exist():
    from swarmkit_plugins.batching import _POLICIES

    for cls_name, _ in _POLICIES.values():
        cls = getattr(importlib.import_module("swarmkit_plugins.batching.policies"), cls_name)
        assert issubclass(cls, P.BatchingPolicy)


def test_bad_config():
    with pytest.raises(ConfigError):
        make("c2", batch_size=0)
    with pytest.raises(ConfigError):
        make("c2", cocktail={"math": 1.5})


# ------------------------------------------------------------------ C1
def test_c1_episode_count():
    pol = make("c1", batch_size=2, rollouts_per_task=2)
    eps = pool([("a", 1), ("b", 0), ("a", 0)])
    d = pol.decide(eps, {}, 0.0)
    assert (d.fire, d.current, d.target, d.unit, d.selected) == (False, 3, 4, "episodes", [])
    eps = pool([("a", 1), ("b", 0), ("a", 0), ("c", 1), ("b", 1), ("d", 0)])
    d = pol.decide(eps, {}, 0.0)
    assert d.fire and d.current == 6
    # the 4 oldest, grouped by task (tasks oldest first); b#1 and d#0 stay
    assert d.selected == ["a#0", "a#1", "b#0", "c#0"]


# ------------------------------------------------------------------ C2
def test_c2_task_count_and_contents():
    pol = make("c2", batch_size=2, rollouts_per_task=2)
    eps = pool([("a", 1), ("b", 0), ("a", 0), ("c", 1), ("a", 1)])
    d = pol.decide(eps, {}, 0.0)
    assert (d.fire, d.current, d.target, d.unit) == (False, 1, 2, "tasks")
    assert d.detail["complete_tasks"] == 1 and d.detail["tasks"] == 3
    eps = pool([("a", 1), ("b", 0), ("a", 0), ("c", 1), ("a", 1), ("c", 0), ("b", 1)])
    d = pol.decide(eps, {}, 0.0)
    # all three complete; the two oldest (a, b) with their first N episodes; a#2 is an extra
    assert d.fire and d.current == 3
    assert d.selected == ["a#0", "a#1", "b#0", "b#1"]


def test_c2_nothing_dropped_over_cycles():
    """Repeatedly firing and removing the batch trains every complete group exactly once."""
    pol = make("c2", batch_size=2, rollouts_per_task=3)
    eps = pool([(f"t{i % 5}", float(i % 2)) for i in range(40)])
    left, trained = list(eps), []
    while (d := pol.decide(left, {}, 0.0)).fire:
        assert len(d.selected) == 6 and not set(d.selected) & set(trained)
        trained += d.selected
        left = [e for e in left if e.episode_id not in set(d.selected)]
    assert set(trained) | {e.episode_id for e in left} == {e.episode_id for e in eps}
    assert len(trained) + len(left) == len(eps)


# ------------------------------------------------------------------ C3
def test_c3_all_equal_rewards_do_not_count():
    pol = make("c3", batch_size=1, rollouts_per_task=3)
    eps = pool([("a", 1), ("a", 1), ("a", 1), ("b", 0), ("b", 0), ("b", 0), ("c", 1), ("c", 1)])
    d = pol.decide(eps, {}, 0.0)
    assert not d.fire and d.current == 0 and d.detail["degenerate_tasks"] == 2
    assert d.detail["filtered"] == ["a#0", "a#1", "a#2", "b#0", "b#1", "b#2"]
    # C2 would have fired on the same pool
    assert make("c2", batch_size=1, rollouts_per_task=3).decide(eps, {}, 0.0).fire
    eps.append(PoolEpisode("c#2", "c", 0.5, accepted_at=99.0))
    d = pol.decide(eps, {}, 0.0)
    assert d.fire and d.selected == ["c#0", "c#1", "c#2"] and d.current == 1


def test_c3_judges_the_first_n_rewards():
    pol = make("c3", batch_size=1, rollouts_per_task=2)
    # first two equal, third differs: the group that would train is degenerate
    d = pol.decide(pool([("a", 1), ("a", 1), ("a", 0)]), {}, 0.0)
    assert not d.fire and d.detail["filtered"] == ["a#0", "a#1"]


# ------------------------------------------------------------------ C4 / C5
def clients(**spec: tuple[float, bool]) -> dict[str, ClientState]:
    return {cid: ClientState(cid, last, ready) for cid, (last, ready) in spec.items()}


def test_c4_all_active_clients_ready():
    pol = make("c4", active_window_s=10.0)
    eps = pool([("a", 1), ("b", 0), ("a", 0)])
    cs = clients(x=(99.5, True), y=(95, False))
    d = pol.decide(eps, cs, 100.0)
    assert (d.fire, d.current, d.target, d.unit) == (False, 1, 2, "ready clients")
    # y goes silent: past the window it drops out and x alone decides
    d = pol.decide(eps, cs, 106.0)
    assert (d.fire, d.current, d.target) == (True, 1, 1)
    assert d.detail["active_clients"] == ["x"]
    assert d.selected == ["a#0", "a#1", "b#0"]  # everything, grouped by task
    # no active client at all, or an empty pool: no training
    assert not pol.decide(eps, cs, 200.0).fire
    assert not pol.decide([], clients(x=(0, True)), 0.0).fire


def test_c4_with_tracker():
    tr = ClientTracker(active_window_s=5.0)
    tr.touch("x", now=0.0)
    tr.touch("y", now=0.0)
    tr.set_ready("x", True, now=1.0)
    pol = make("c4", active_window_s=5.0)
    eps = pool([("a", 1)])
    assert not pol.decide(eps, tr.active(2.0), 2.0).fire
    assert set(tr.active(5.5)) == {"x"}  # y silent for 5.5 s
    assert pol.decide(eps, tr.active(5.5), 5.5).fire
    tr.reset_ready()
    assert not pol.decide(eps, tr.active(5.5), 5.5).fire


def test_c5_any_active_client_ready():
    pol = make("c5", active_window_s=10.0)
    eps = pool([("a", 1), ("b", 0)])
    cs = clients(x=(0, False), y=(0, False))
    d = pol.decide(eps, cs, 1.0)
    assert (d.fire, d.current, d.target) == (False, 0, 1)
    cs["y"].ready = True
    d = pol.decide(eps, cs, 1.0)
    assert d.fire and d.selected == ["a#0", "b#0"]
    # a ready client that went silent does not count
    assert not pol.decide(eps, {"y": ClientState("y", 0.0, True)}, 50.0).fire


# ------------------------------------------------------------------ cocktail
def test_cocktail_c2_caps_a_fast_family():
    pol = make("c2", batch_size=4, rollouts_per_task=1, cocktail={"fast": 0.5})
    fast = [(f"f{i}", 0.0, "fast") for i in range(6)]
    d = pol.decide(pool(fast), {}, 0.0)
    assert not d.fire and d.current == 2  # only 2 fast tasks may count
    assert d.detail["held_by_cocktail"] == {"fast": 4}  # enough in the pool: the caps alone hold it back
    assert "held_by_cocktail" not in pol.decide(pool(fast[:3]), {}, 0.0).detail  # too few anyway
    eps = pool([*fast, ("s0", 1.0, "slow"), ("s1", 1.0, "slow")])
    d = pol.decide(eps, {}, 0.0)
    assert d.fire and d.current == 4 and "held_by_cocktail" not in d.detail
    assert d.selected == ["f0#0", "f1#0", "s0#0", "s1#0"]


def test_cocktail_c1_in_episodes():
    pol = make("c1", batch_size=2, rollouts_per_task=2, cocktail={"fast": 0.25})
    eps = pool([("f", 0, "fast")] * 5 + [("s", 1, "slow")] * 2)
    d = pol.decide(eps, {}, 0.0)
    assert not d.fire and d.current == 3  # 1 fast (cap floor(.25*4)) + 2 slow
    assert d.detail["held_by_cocktail"] == {"fast": 4}
    eps += pool([("t", 1, "slow")])
    d = pol.decide(eps, {}, 0.0)
    assert d.fire and d.selected == ["f#0", "s#0", "s#1", "t#0"]


def test_cocktail_c5_share_of_whole_pool():
    pol = make("c5", rollouts_per_task=2, cocktail={"fast": 0.5})
    eps = pool([(f"f{i}", 0, "fast") for i in range(4) for _ in range(2)]
               + [("s0", 1, "slow"), ("s0", 0, "slow")])
    d = pol.decide(eps, clients(x=(0, True)), 0.0)
    # 2 slow episodes allow 2 fast ones (one task of two); the rest stays in the pool
    assert d.fire and d.selected == ["f0#0", "f0#1", "s0#0", "s0#1"]


def test_tracker_threads():
    tr = ClientTracker(active_window_s=60.0)

    def worker(w: int) -> None:
        for i in range(200):
            tr.touch(f"c{w}-{i % 10}", now=float(i))
            tr.set_ready(f"c{w}-{i % 10}", i % 2 == 0, now=float(i))
            tr.active(float(i))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(tr.active(199.0)) == 40 and len(tr.all()) == 40
    tr.forget("c0-0")
    assert "c0-0" not in tr.all()


def test_policies_are_thread_safe_to_call():
    pol = make("c2", batch_size=2, rollouts_per_task=2)
    eps = pool([("a", 1), ("a", 0), ("b", 1), ("b", 0)])
    results = []
    threads = [threading.Thread(target=lambda: results.append(pol.decide(eps, {}, 0.0).fire))
               for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert results == [True] * 4
