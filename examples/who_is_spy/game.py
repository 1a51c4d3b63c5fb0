"""The rules of "Who is the Spy", as a pure state machine (no model, no HTTP).

N players sit in a random order under random names. Civilians share a word;
the spies get a similar one (a pair from :data:`WORD_PAIRS`). Nobody is told
whether they are a spy. Each round every living player describes their word
in a few words, then every living player votes for the one they think is the
spy; the player with most votes is out (a tie is broken by the game's seeded
random draw, so every round eliminates someone). Civilians win as soon as
every spy is out; spies win as soon as they are no fewer than the civilians,
or when ``max_rounds`` rounds pass with a spy still in.

**The guard against copying.** The paper's spies learnt to repeat another
player's description (a safe way to blend in). Here a description that
repeats an earlier one of the same game (same words after normalising, or a
content-word overlap (Jaccard, stop words left out) of at least ``copy_threshold``), or that says the player's
own word, is *withheld*: the others see ``(withheld: ...)``, the vote goes on,
and the offender's side loses ``copy_penalty`` of its reward. Copying then
neither hides a spy nor pays.

Rewards are per side: the winners' role gets 1, the losers' 0, minus the
penalty of a role that broke the rule (see :meth:`Game.rewards`).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field

CIVILIAN = "civilian"
SPY = "spy"
ROLES = (CIVILIAN, SPY)

#: (word, similar word): which of the two is the spies' is drawn per task
WORD_PAIRS: tuple[tuple[str, str], ...] = (
    ("apple", "pear"), ("cat", "dog"), ("coffee", "tea"), ("piano", "guitar"), ("river", "lake"),
    ("bus", "train"), ("shoe", "boot"), ("sun", "moon"), ("milk", "juice"), ("rose", "tulip"),
    ("pen", "pencil"), ("bread", "cake"), ("chair", "sofa"), ("lion", "tiger"), ("rain", "snow"),
    ("doctor", "nurse"), ("spoon", "fork"), ("car", "truck"), ("bee", "wasp"), ("cup", "glass"),
    ("book", "magazine"), ("ship", "boat"), ("honey", "jam"), ("shirt", "jacket"), ("bed", "couch"),
    ("violin", "cello"), ("soap", "shampoo"), ("bank", "shop"), ("eagle", "hawk"), ("lemon", "orange"),
    ("winter", "autumn"), ("forest", "park"), ("candle", "lamp"), ("key", "lock"), ("salt", "sugar"),
    ("horse", "donkey"), ("beach", "desert"), ("clock", "watch"), ("knife", "scissors"), ("rice", "pasta"),
)

NAMES = ("Ava", "Ben", "Cleo", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena", "Milo", "Nora",
         "Omar", "Pia", "Quin", "Rosa", "Sam", "Tess", "Uma", "Vik", "Wren", "Yara", "Zed")

_WORD = re.compile(r"[a-z0-9]+")
#: words ignored when descriptions are compared (a copy with an added "a" is still a copy)
STOP_WORDS = frozenset("a an the it its is are was be of and or to in on at for with my your this that".split())


@dataclass(frozen=True)
class GameConfig:
    players: int = 4
    spies: int = 1
    max_rounds: int = 3
    #: word-set overlap (Jaccard) at or above which a description counts as a copy
    copy_threshold: float = 0.8
    #: reward taken from a role whose player copied or said their own word (once per game)
    copy_penalty: float = 0.5
    #: longest description kept (characters)
    max_description: int = 80

    def __post_init__(self) -> None:
        if self.spies < 1 or self.players < 2 * self.spies + 1:
            raise ValueError(f"{self.players} players with {self.spies} spies: civilians must outnumber spies "
                             "at the start (players >= 2 * spies + 1)")
        if len(NAMES) < self.players:
            raise ValueError(f"at most {len(NAMES)} players")


@dataclass
class Player:
    name: str
    role: str
    word: str
    alive: bool = True


@dataclass
class Description:
    round: int
    name: str
    text: str
    #: "" when shown, else why it was withheld ("copied Ben", "said the word")
    withheld: str = ""

    def shown(self) -> str:
        return f"(withheld: {self.withheld})" if self.withheld else self.text


@dataclass
class Vote:
    round: int
    voter: str
    target: str | None  # None: no valid name in the reply (abstained)
    raw: str = ""


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def jaccard(a: str, b: str) -> float:
    """Overlap of two descriptions' content words (stop words left out): 1 = the same words."""
    sa, sb = set(words(a)) - STOP_WORDS, set(words(b)) - STOP_WORDS
    return len(sa & sb) / len(sa | sb) if sa and sb else 0.0


def parse_description(reply: str, limit: int = 80) -> str:
    """The first non-empty line of a reply, without quotes or a ``Name:`` prefix, cut to ``limit``."""
    for line in reply.strip().splitlines():
        line = re.sub(r"^(description|my description|[A-Z][a-z]+)\s*:\s*", "", line.strip(), flags=re.IGNORECASE)
        line = line.strip().strip('"').strip()
        if line:
            return line[:limit]
    return ""


def parse_vote(reply: str, candidates: list[str]) -> str | None:
    """The candidate named first in ``reply`` (whole word, any case), or None."""
    best: tuple[int, str] | None = None
    for name in candidates:
        m = re.search(rf"\b{re.escape(name)}\b", reply, flags=re.IGNORECASE)
        if m and (best is None or m.start() < best[0]):
            best = (m.start(), name)
    return best[1] if best else None


@dataclass
class Game:
    """One game; drive it with :meth:`describe_prompt` / :meth:`add_description` / :meth:`vote_prompt` /
    :meth:`add_vote` / :meth:`end_round`, or let :func:`play` do it."""

    config: GameConfig
    civilian_word: str
    spy_word: str
    seed: int
    players: list[Player] = field(default_factory=list)
    descriptions: list[Description] = field(default_factory=list)
    votes: list[Vote] = field(default_factory=list)
    eliminated: list[str] = field(default_factory=list)
    round: int = 1
    winner: str | None = None
    #: roles that broke the description rule (copied, or said their word)
    offenders: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        if not self.players:
            names = self.rng.sample(NAMES, self.config.players)
            spies = set(self.rng.sample(range(self.config.players), self.config.spies))
            self.players = [Player(n, SPY if i in spies else CIVILIAN, self.spy_word if i in spies else self.civilian_word)
                            for i, n in enumerate(names)]

    # ------------------------------------------------------------------ state
    def alive(self) -> list[Player]:
        return [p for p in self.players if p.alive]

    def player(self, name: str) -> Player:
        return next(p for p in self.players if p.name == name)

    @property
    def over(self) -> bool:
        return self.winner is not None

    # ------------------------------------------------------------------ prompts
    def rules(self, me: Player) -> str:
        names = ", ".join(p.name for p in self.players)
        return (f"You are {me.name}, playing 'Who is the Spy' with {names}. Everyone got a secret word: most "
                f"players share one word, {self.config.spies} {'spy' if self.config.spies == 1 else 'spies'} got a "
                "similar but different word, and nobody "
                "knows who the spy is (it may be you). Each round every player describes their word in a few "
                "words without saying it; then everyone votes out the player they think is the spy. Never say "
                "your word and never repeat someone else's description.\n"
                f"Your secret word: {me.word}")

    def transcript(self) -> str:
        lines = []
        for r in range(1, self.round + 1):
            said = [d for d in self.descriptions if d.round == r]
            if said:
                lines.append(f"Round {r}: " + "; ".join(f"{d.name}: {d.shown()}" for d in said))
            out = [v for v in self.votes if v.round == r]
            if out and r < self.round:
                lines.append(f"Round {r} votes: " + ", ".join(f"{v.voter} -> {v.target or 'nobody'}" for v in out)
                             + f". {self.eliminated[r - 1]} was voted out.")
        return "\n".join(lines)

    def describe_prompt(self, me: Player) -> list[dict[str, str]]:
        history = self.transcript()
        ask = (f"{history}\n\n" if history else "") + (
            f"Round {self.round}. Your turn, {me.name}: describe your word in at most eight words. "
            "Reply with the description only.")
        return [{"role": "system", "content": self.rules(me)}, {"role": "user", "content": ask}]

    def vote_prompt(self, me: Player) -> list[dict[str, str]]:
        others = [p.name for p in self.alive() if p.name != me.name]
        ask = (f"{self.transcript()}\n\nRound {self.round}, vote. Who is the spy? Choose one of: "
               f"{', '.join(others)}. Reply with the name only.")
        return [{"role": "system", "content": self.rules(me)}, {"role": "user", "content": ask}]

    def vote_candidates(self, me: Player) -> list[str]:
        return [p.name for p in self.alive() if p.name != me.name]

    # ------------------------------------------------------------------ moves
    def add_description(self, me: Player, reply: str) -> Description:
        """Record ``me``'s description (withheld if it copies an earlier one or says ``me``'s word)."""
        text = parse_description(reply, self.config.max_description)
        withheld = ""
        if not text:
            withheld = "said nothing"
        elif me.word.lower() in words(text):
            withheld = "said the word"
        else:
            for d in self.descriptions:
                if d.text and (words(d.text) == words(text) or jaccard(d.text, text) >= self.config.copy_threshold):
                    withheld = f"copied {d.name}" if d.name != me.name else "repeated itself"
                    break
        if withheld and withheld != "said nothing":
            self.offenders.add(me.role)
        desc = Description(self.round, me.name, text, withheld)
        self.descriptions.append(desc)
        return desc

    def add_vote(self, me: Player, reply: str) -> Vote:
        vote = Vote(self.round, me.name, parse_vote(reply, self.vote_candidates(me)), reply[:200])
        self.votes.append(vote)
        return vote

    def end_round(self) -> str:
        """Count this round's votes, eliminate one player, settle the winner; returns who was voted out."""
        tally = Counter(v.target for v in self.votes if v.round == self.round and v.target)
        alive = [p.name for p in self.alive()]
        if tally:
            top = max(tally.values())
            tied = sorted(n for n, c in tally.items() if c == top)
        else:
            tied = alive
        out = self.rng.choice(tied)
        self.player(out).alive = False
        self.eliminated.append(out)
        spies = sum(p.role == SPY for p in self.alive())
        civilians = sum(p.role == CIVILIAN for p in self.alive())
        if spies == 0:
            self.winner = CIVILIAN
        elif spies >= civilians or self.round >= self.config.max_rounds:
            self.winner = SPY
        self.round += 1
        return out

    # ------------------------------------------------------------------ outcome
    def rewards(self) -> dict[str, float]:
        """Role -> reward: 1 for the winners, 0 for the losers, minus ``copy_penalty`` for a rule breaker."""
        if self.winner is None:
            raise RuntimeError("the game is not over")
        return {role: (1.0 if role == self.winner else 0.0) - (self.config.copy_penalty if role in self.offenders
                                                               else 0.0)
                for role in ROLES}

    def summary(self) -> dict[str, object]:
        return {
            "winner": self.winner, "rounds": self.round - 1, "civilian_word": self.civilian_word,
            "spy_word": self.spy_word, "spies": [p.name for p in self.players if p.role == SPY],
            "eliminated": self.eliminated, "offenders": sorted(self.offenders),
            "withheld": sum(bool(d.withheld) for d in self.descriptions),
            "descriptions": [(d.round, d.name, d.text, d.withheld) for d in self.descriptions],
            "votes": [(v.round, v.voter, v.target) for v in self.votes],
        }


def deal(task_seed: int, episode_seed: int, config: GameConfig, pairs: tuple[tuple[str, str], ...] = WORD_PAIRS
         ) -> Game:
    """A game of task ``task_seed`` (fixes the words and which one is the spies'), seated by ``episode_seed``
    (names, seats and who the spies are differ between rollouts of one task)."""
    trng = random.Random(task_seed)
    a, b = pairs[trng.randrange(len(pairs))]
    civ, spy = (a, b) if trng.random() < 0.5 else (b, a)
    return Game(config, civ, spy, seed=episode_seed)


def split_pairs(eval_share: float = 0.25) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """(training pairs, held-out pairs): a fixed split of :data:`WORD_PAIRS`."""
    n_eval = max(1, round(len(WORD_PAIRS) * eval_share))
    return WORD_PAIRS[:-n_eval], WORD_PAIRS[-n_eval:]
