""""Who is the Spy" (examples/who_is_spy): the rules with scripted players, and the set-ups end to end
with real server processes and the tiny model (shared: one server, two roles; adversarial: civilians on
server A, spies on server B, each journal holding only its own role's tokens; adapters: one server, each
side's tokens training its own LoRA adapter)."""

from __future__ import annotations

import collections
import importlib.util
import json
import sqlite3
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "who_is_spy"
sys.path.insert(0, str(EXAMPLE))

from game import CIVILIAN, NAMES, SPY, WORD_PAIRS, GameConfig, deal, parse_description, parse_vote, split_pairs, words  # noqa: E402,I001,E501
from players import Recorder, play, scripted_seat  # noqa: E402
from clues import CLUES  # noqa: E402


def _scripted(i, civ="honest", spy="honest"):
    return {CIVILIAN: scripted_seat(civ, i), SPY: scripted_seat(spy, i + 1)}


def test_a_deal_fixes_the_words_per_task_and_the_seats_per_episode():
    a, b = deal(3, 1, GameConfig()), deal(3, 2, GameConfig())
    assert (a.civilian_word, a.spy_word) == (b.civilian_word, b.spy_word)
    assert {a.civilian_word, a.spy_word} in [set(p) for p in WORD_PAIRS]
    assert [p.name for p in a.players] != [p.name for p in b.players]
    assert all(p.name in NAMES for p in a.players) and len({p.name for p in a.players}) == 4
    assert sum(p.role == SPY for p in a.players) == 1
    assert all(p.word == (a.spy_word if p.role == SPY else a.civilian_word) for p in a.players)
    train, held_out = split_pairs()
    assert not set(train) & set(held_out) and len(train) + len(held_out) == len(WORD_PAIRS)
    with pytest.raises(ValueError, match="civilians must outnumber"):
        GameConfig(players=3, spies=2)


def test_the_win_conditions():
    # civilians win when every spy is out
    g = deal(0, 0, GameConfig())
    spy = next(p for p in g.players if p.role == SPY)
    for p in g.alive():
        g.add_description(p, f"{p.name} hint")
    for p in g.alive():
        g.add_vote(p, spy.name if p is not spy else g.vote_candidates(p)[0])
    assert g.end_round() == spy.name and g.winner == CIVILIAN and g.rewards() == {CIVILIAN: 1.0, SPY: 0.0}
    # spies win when no fewer than the civilians: 4 players, two civilians voted out
    g = deal(0, 0, GameConfig())
    for _ in range(2):
        civs = [p for p in g.alive() if p.role == CIVILIAN]
        for p in g.alive():
            g.add_vote(p, civs[0].name if p is not civs[0] else civs[1].name)
        g.end_round()
    assert g.winner == SPY and g.rewards() == {CIVILIAN: 0.0, SPY: 1.0}
    # ... or when the rounds run out with a spy in
    g = deal(0, 0, GameConfig(players=7, spies=1, max_rounds=1))
    civ = next(p for p in g.players if p.role == CIVILIAN)
    for p in g.alive():
        g.add_vote(p, civ.name if p is not civ else g.vote_candidates(p)[0])
    g.end_round()
    assert g.winner == SPY


def test_a_tie_or_no_valid_vote_is_drawn_at_random_but_reproducibly():
    outs = set()
    for seed in range(20):
        g = deal(1, seed, GameConfig())
        for p in g.alive():
            g.add_vote(p, "I abstain")  # names nobody
        outs.add(g.end_round() == deal(1, seed, GameConfig()).players[0].name)
        g2 = deal(1, seed, GameConfig())
        for p in g2.alive():
            g2.add_vote(p, "I abstain")
        assert g2.end_round() == g.eliminated[0]
    assert outs == {True, False}


def test_copying_or_saying_the_word_is_withheld_and_costs_the_side():
    g = deal(5, 5, GameConfig())
    a, b, c, d = g.players
    assert not g.add_description(a, "a sweet red fruit").withheld
    copied = g.add_description(b, "A sweet, red fruit!")
    assert copied.withheld == f"copied {a.name}" and copied.shown() == f"(withheld: copied {a.name})"
    assert g.add_description(c, "sweet red fruit").withheld  # word-set overlap >= 0.8
    assert not g.add_description(d, "a sweet green fruit with seeds").withheld
    assert f"{b.name}: (withheld: copied {a.name})" in g.transcript()
    g2 = deal(5, 5, GameConfig())
    p = g2.players[0]
    assert g2.add_description(p, f"my word is {p.word}").withheld == "said the word"
    assert g2.offenders == {p.role}
    g2.winner = p.role
    assert g2.rewards()[p.role] == 0.5  # won, minus the penalty


def test_copying_does_not_pay_in_scripted_games():
    rewards = collections.defaultdict(list)
    for i in range(120):
        for spy in ("honest", "copycat"):
            r = play(deal(i, 1000 + i, GameConfig()), _scripted(i, "honest", spy))
            rewards[spy].append(r[SPY])
    assert sum(rewards["copycat"]) < sum(rewards["honest"])  # the guard makes the paper's hack a loss
    wins = collections.Counter(deal(i, i, GameConfig()).winner for i in range(3))
    assert wins == {None: 3}  # a dealt game has no winner yet


def test_replies_are_parsed_leniently():
    assert parse_description('Ava: "A tall animal"\nmore') == "A tall animal"
    assert parse_description("Description: long neck") == "long neck"
    assert parse_description("   ") == ""
    assert parse_vote("I vote for ben, because", ["Ava", "Ben"]) == "Ben"
    assert parse_vote("Benjamin?", ["Ava", "Ben"]) is None
    assert parse_vote("Ava or Ben", ["Ben", "Ava"]) == "Ava"


def test_the_clue_player_is_a_fair_teacher():
    """The warm start's scripted player: its clues never say its word or the partner's, it never
    copies, and as civilians it finds the spy."""
    for a, b in WORD_PAIRS:
        for word, other in ((a, b), (b, a)):
            assert len(CLUES[word]) >= 4
            for clue in CLUES[word]:
                said = set(words(clue))
                assert word not in said and other not in said, clue
    wins = 0
    for i in range(50):
        g = deal(i, 100 + i, GameConfig())
        seat = Recorder(scripted_seat("clue", i))
        play(g, {CIVILIAN: seat, SPY: seat})
        wins += g.winner == CIVILIAN
        assert not g.offenders
        for role, convs in seat.conversations.items():  # every answer is recorded as a conversation
            assert convs and all(c[-1]["role"] == "assistant" and c[0]["role"] == "system" for c in convs)
            assert all(role == SPY or g.spy_word not in c[0]["content"] for c in convs)
    assert wins == 50


def test_prompts_hide_the_roles_and_show_the_transcript():
    g = deal(2, 2, GameConfig())
    me = g.players[0]
    system, user = g.describe_prompt(me)
    assert me.word in system["content"] and "spy" in system["content"]
    assert "you are the spy" not in system["content"].lower()
    for p in g.alive():
        g.add_description(p, f"hint {p.name}")
    vote = g.vote_prompt(me)[1]["content"]
    assert f"{g.players[1].name}: hint {g.players[1].name}" in vote and me.name not in vote.split("Choose one of:")[1]


def _journal(run_dir: Path) -> list[dict]:
    db = sqlite3.connect(f"file:{run_dir / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT task_family, reward, timelines, adapter, trained_step FROM episodes").fetchall()
    finally:
        db.close()
    return [{"family": f, "reward": json.loads(r), "timelines": json.loads(t), "adapter": a, "trained_step": st}
            for f, r, t, a, st in rows]


def _load_runner():
    spec = importlib.util.spec_from_file_location("who_is_spy_run", EXAMPLE / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _run(tmp_path, *args):
    spy_run = _load_runner()

    out = tmp_path / "out.json"
    argv = [*args, "--model", "tiny", "--steps", "1", "--batch-size", "1", "--rollouts", "2", "--train-size", "2",
            "--eval-games", "2", "--max-tokens", "8", "--lr", "1e-3", "--timeout", "240", "--work-dir", str(tmp_path),
            "--out", str(out)]
    assert spy_run.main(argv) == 0
    return json.loads(out.read_text())


def test_shared_parameters_one_server_both_roles(tmp_path):
    summary = _run(tmp_path, "shared")
    assert summary["trained"] == [CIVILIAN, SPY] and summary["eval_before"]["games"] == 2
    rows = _journal(tmp_path / "server_a")
    assert rows and all(r["family"] == "who_is_spy" for r in rows)
    for r in rows:  # one episode, a key per role, a reward per role
        assert set(r["reward"]) == {CIVILIAN, SPY}
        assert {t["role"] for t in r["timelines"]} == {CIVILIAN, SPY}


def test_adversarial_each_server_learns_only_from_its_own_players(tmp_path):
    """Civilians on A, spies on B, with a supervised warm start: each server's journal holds only
    its own role's tokens, demonstrated and sampled."""
    summary = _run(tmp_path, "adversarial", "--train", "both", "--warm-start", "1")
    assert summary["trained"] == [CIVILIAN, SPY] and len(summary["steps"]) == 2
    assert summary["eval_after_warm_start"]["games"] == 2
    for server, role in (("a", CIVILIAN), ("b", SPY)):
        rows = _journal(tmp_path / f"server_{server}")
        demos = [r for r in rows if any(t["meta"].get("demonstration") for t in r["timelines"])]
        assert len(demos) == 2 and len(rows) > 2  # the warm start's games (1 step x 2 rollouts), then play
        for r in rows:
            assert set(r["reward"]) == {role}
            assert {t["role"] for t in r["timelines"]} == {role}


def test_adapters_one_server_each_side_trains_its_own_adapter(tmp_path):
    """Civilians and spies as two LoRA adapters of one base on one server, the civilians trained and the
    spies frozen, with a warm start: every episode holds one side's tokens under that side's adapter, every
    step trained one adapter's episodes only, and the spies' only in the warm start (their played parts are
    eval episodes, never journaled)."""
    summary = _run(tmp_path, "adapters", "--train", "civilian", "--warm-start", "1")
    assert summary["adapters"] == {CIVILIAN: "civilians", SPY: "spies"} and summary["frozen"] == [SPY]
    assert list(summary["server_peak_rss_bytes"]) == ["a"] and summary["server_peak_rss_bytes"]["a"] > 0
    rows = _journal(tmp_path / "server_a")
    adapter_of = {CIVILIAN: "civilians", SPY: "spies"}
    steps: dict[int, set[str]] = collections.defaultdict(set)
    for r in rows:
        (role,) = set(r["reward"])
        assert {t["role"] for t in r["timelines"]} == {role} and r["adapter"] == adapter_of[role]
        demo = any(t["meta"].get("demonstration") for t in r["timelines"])
        assert demo or role == CIVILIAN, r  # the frozen spies' played parts are eval episodes
        if r["trained_step"] is not None:
            steps[r["trained_step"]].add(r["adapter"])
    assert all(len(a) == 1 for a in steps.values()), steps  # one adapter per step
    assert len(steps) == 3 and set().union(*steps.values()) == {"civilians", "spies"}  # 2 warm + 1 RL
    assert any(not any(t["meta"].get("demonstration") for t in r["timelines"]) for r in rows)  # civilians played
