"""Who plays: LLM agents through the OpenAI SDK, or scripted players (for tests and baselines).

A *seat* answers a prompt for one player: ``ask(player, messages, kind) -> str``
with ``kind`` ``"describe"`` or ``"vote"``. :func:`play` drives a
:class:`~game.Game` to its end with one seat per role.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Mapping
from typing import Any

from clues import CLUES
from game import Game, Player, jaccard

Ask = Callable[[Player, list[dict[str, str]], str], str]


def play(game: Game, seats: Mapping[str, Ask]) -> dict[str, float]:
    """Play ``game`` to its end; ``seats[role]`` answers for every player of ``role``. Returns role -> reward."""
    while not game.over:
        for p in game.alive():
            game.add_description(p, seats[p.role](p, game.describe_prompt(p), "describe"))
        for p in game.alive():
            game.add_vote(p, seats[p.role](p, game.vote_prompt(p), "vote"))
        game.end_round()
    return game.rewards()


class OpenAISeat:
    """Answers through an OpenAI-compatible endpoint (the swarm episode's ``base_url`` and its role's key).

    :param max_tokens: per answer (descriptions are short; votes shorter).
    """

    def __init__(self, base_url: str, api_key: str, model: str, *, max_tokens: int = 24, temperature: float = 1.0,
                 http_client: Any = None):
        from openai import OpenAI

        self.client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, http_client=http_client)
        self.model = model
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.calls = 0

    def __call__(self, player: Player, messages: list[dict[str, str]], kind: str) -> str:
        self.calls += 1
        out = self.client.chat.completions.create(
            model=self.model, messages=messages,  # type: ignore[arg-type]
            max_tokens=self.max_tokens if kind == "describe" else min(8, self.max_tokens),
            temperature=self.temperature)
        return out.choices[0].message.content or ""


def shown_descriptions(prompt: str) -> list[tuple[str, str]]:
    """(name, description) pairs of the transcript in a prompt, in the order they were said."""
    out = []
    for line in prompt.splitlines():
        m = re.match(r"Round \d+: (.*)", line)
        if m:
            for part in m.group(1).split("; "):
                name, _, said = part.partition(": ")
                out.append((name, said))
    return out


def scripted_seat(style: str, seed: int = 0) -> Ask:
    """A player without a model, for tests and baselines.

    ``honest``: hints at its word (spelt backwards) and votes for a player whose
    hint names another word (else at random); ``copycat``: repeats the last
    description said; ``revealer``: says its word; ``random``: hints, and votes
    at random; ``clue``: plays well (:func:`clue_answer`), the demonstrations of
    the supervised warm start.
    """
    rng = random.Random(seed)

    def ask(player: Player, messages: list[dict[str, str]], kind: str) -> str:
        prompt = messages[-1]["content"]
        said = shown_descriptions(prompt)
        if style == "clue":
            return clue_answer(player, said, vote_choices(prompt) if kind == "vote" else [], kind, rng)
        if kind == "describe":
            if style == "copycat" and said:
                return said[-1][1]
            if style == "revealer":
                return f"it is a {player.word}"
            return f"{player.word[::-1]} hint {rng.randrange(10_000)}"
        choices = vote_choices(prompt)
        if style == "honest":
            odd = [n for n, d in said if n in choices and player.word[::-1] not in d]
            if odd:
                return odd[-1]
        return rng.choice(choices)

    return ask


def vote_choices(prompt: str) -> list[str]:
    """The names a vote prompt offers."""
    return prompt.rsplit("Choose one of: ", 1)[1].split(". Reply")[0].split(", ")


def fits(word: str, description: str) -> bool:
    """Whether ``description`` is (close to) one of ``word``'s clues."""
    return any(jaccard(description, c) >= 0.5 for c in CLUES.get(word, ()))


def clue_answer(player: Player, said: list[tuple[str, str]], choices: list[str], kind: str,
                rng: random.Random) -> str:
    """A good player's answer from :data:`clues.CLUES`.

    Describe: a clue of its word that nobody said yet (two clues joined once all were said).
    Vote: a player whose description does not fit its own word; a player who finds most
    descriptions odd is probably the spy itself and votes for one of the others at random.
    """
    if kind == "describe":
        clues = list(CLUES[player.word])
        rng.shuffle(clues)
        fresh = [c for c in clues if all(jaccard(c, d) < 0.5 for _, d in said)]
        return fresh[0] if fresh else f"{clues[0]}, {clues[1]}"
    latest = {name: d for name, d in said if name in choices}  # each player's last description
    odd = [n for n in choices if n in latest and not fits(player.word, latest[n])]
    if odd and len(odd) <= len(choices) / 2:
        return rng.choice(odd)
    return rng.choice(choices)


class Recorder:
    """Wraps a seat and keeps every (prompt, answer) as a conversation per role: demonstrations."""

    def __init__(self, seat: Ask):
        self.seat = seat
        self.conversations: dict[str, list[list[dict[str, str]]]] = {}

    def __call__(self, player: Player, messages: list[dict[str, str]], kind: str) -> str:
        answer = self.seat(player, messages, kind)
        self.conversations.setdefault(player.role, []).append(
            [*messages, {"role": "assistant", "content": answer}])
        return answer
