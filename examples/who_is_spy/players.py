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

from game import Game, Player

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
    at random.
    """
    rng = random.Random(seed)

    def ask(player: Player, messages: list[dict[str, str]], kind: str) -> str:
        prompt = messages[-1]["content"]
        said = shown_descriptions(prompt)
        if kind == "describe":
            if style == "copycat" and said:
                return said[-1][1]
            if style == "revealer":
                return f"it is a {player.word}"
            return f"{player.word[::-1]} hint {rng.randrange(10_000)}"
        choices = prompt.rsplit("Choose one of: ", 1)[1].split(". Reply")[0].split(", ")
        if style == "honest":
            odd = [n for n, d in said if n in choices and player.word[::-1] not in d]
            if odd:
                return odd[-1]
        return rng.choice(choices)

    return ask
