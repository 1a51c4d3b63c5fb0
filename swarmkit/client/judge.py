"""LLM-as-judge rewards for swarm clients: score one episode, or rank a task's group of episodes (httpx only).

:class:`Judge` asks any OpenAI-compatible chat endpoint (OpenAI, vLLM, another swarm server through an
eval episode's ``base_url`` / ``api_key``) for a reward in [0, 1]:

- :meth:`Judge.score`: one episode on its own, against a rubric (:data:`SCORE_PROMPT`);
- :meth:`Judge.rank`: every episode of one task in a single call, scored *relative to each other*
  (RULER-style, :data:`RANK_PROMPT`): a group-relative algorithm (GRPO) only needs the order and the gaps
  inside a group, and a judge compares trajectories side by side more reliably than it grades one alone.

The judge answers JSON (``{"score": x, "reason": ...}`` / ``{"scores": [{"id", "score", "reason"}...]}``);
an answer that does not parse, or leaves an episode out, is asked again. Answers are cached by request
(in memory, and in ``cache_path`` as JSON lines when given, so a restarted client pays nothing twice).
Transient failures (connection errors, timeouts, 429, 5xx) are retried with exponential backoff, honouring
``Retry-After``; every call counts against the budget (``max_calls``, ``max_tokens`` as the answers' usage
reports them), and a call past it raises :class:`JudgeBudgetExceeded` before it is sent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

log = logging.getLogger("swarmkit.client")

#: the system prompt of :meth:`Judge.score`; ``{rubric}`` is filled in
SCORE_PROMPT = """You are a strict, fair judge of an AI agent's work on a task.
Read the task and the agent's trajectory (its messages, tool calls and answer), then grade how well the
trajectory accomplishes the task according to this rubric:

{rubric}

Answer with one JSON object and nothing else: {{"reason": "<one or two sentences>", "score": <a number from 0
to 1>}}, where 1 means the task is fully and correctly done and 0 means not at all."""

#: the system prompt of :meth:`Judge.rank`; ``{rubric}`` and ``{n}`` are filled in
RANK_PROMPT = """You are a strict, fair judge comparing {n} attempts by AI agents at the same task.
Read the task and every trajectory, compare them against each other, and grade each according to this rubric:

{rubric}

Scores are relative within this group: give better trajectories higher scores, equal ones equal scores,
use the whole range from 0 to 1 when the attempts differ, and never reward length for its own sake.
Answer with one JSON object and nothing else: {{"scores": [{{"id": <trajectory number>, "reason": "<one
sentence>", "score": <a number from 0 to 1>}}, ...]}} with exactly one entry for each of the {n} trajectories."""

#: the rubric when none is given
DEFAULT_RUBRIC = ("Correctness of the final answer or outcome first; then whether the agent followed the task's "
                  "instructions and format; then efficiency (no needless or failed steps).")

#: statuses worth another attempt
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class JudgeError(RuntimeError):
    """The judge could not give a usable verdict (after the retries), or refused the request."""


class JudgeBudgetExceeded(JudgeError):
    """A call would pass the judge's budget (``max_calls`` or ``max_tokens``)."""


@dataclass
class Verdict:
    """A judge's grade of one episode: ``score`` in [0, 1], its ``reason``, and whether it came from the cache."""

    score: float
    reason: str = ""
    cached: bool = False


def render_episode(episode: str | Sequence[dict[str, Any]]) -> str:
    """An episode as the judge reads it: a text as it is, or OpenAI chat messages one per line
    (``role: content``, tool calls as ``name(arguments)``)."""
    if isinstance(episode, str):
        return episode
    lines = []
    for m in episode:
        content = m.get("content")
        if isinstance(content, list):  # content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        line = f"{m.get('role', '?')}: {content or ''}".rstrip()
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            line += f"\n  -> {fn.get('name', '?')}({fn.get('arguments', '')})"
        lines.append(line)
    return "\n".join(lines)


def parse_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in ``text`` (a model may wrap it in prose or a code fence); None if there is none."""
    for m in re.finditer(r"\{", text):
        try:
            value, _ = json.JSONDecoder().raw_decode(text[m.start():])
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _unit(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float) or x != x:
        return None
    return min(1.0, max(0.0, float(x)))


class Judge:
    """Rewards from an OpenAI-compatible judge (see the module docstring).

    :param base_url: the API base URL (``http://host:port/v1``; with a swarm server, an eval episode's).
    :param api_key: bearer key; ``model``: the request's ``model`` field.
    :param max_calls: most chat calls (retries included) this judge may make; None: no limit.
    :param max_tokens: most tokens (prompt + completion, as the answers report) it may spend; None: no limit.
    :param retries: attempts per verdict (transient HTTP failures and unusable answers alike).
    :param timeout_s: seconds per call (of the judge's own client); ``temperature``, ``max_completion_tokens``: the judge's sampling.
    :param cache_path: a JSON-lines file that keeps verdicts across runs (None: memory only).
    :param http: an ``httpx.Client`` to send with (e.g. a Starlette ``TestClient``); default: its own.
    """

    def __init__(self, base_url: str, api_key: str = "", model: str = "judge", *, max_calls: int | None = None,
                 max_tokens: int | None = None, retries: int = 3, timeout_s: float = 60.0, temperature: float = 0.0,
                 max_completion_tokens: int = 512, cache_path: str | Path | None = None,
                 http: httpx.Client | None = None):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.max_calls = max_calls
        self.max_tokens = max_tokens
        self.retries = max(1, int(retries))
        self.temperature = float(temperature)
        self.max_completion_tokens = int(max_completion_tokens)
        self._own = http is None
        self._http = http if http is not None else httpx.Client(timeout=timeout_s)
        self._lock = threading.Lock()
        self._cache: dict[str, Any] = {}
        self.cache_path = Path(cache_path) if cache_path is not None else None
        if self.cache_path is not None and self.cache_path.exists():
            for line in self.cache_path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    self._cache[row["key"]] = row["value"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a crash
        #: calls made (retries included), tokens spent, verdicts served from the cache, retries
        self.stats = {"calls": 0, "tokens": 0, "cache_hits": 0, "retries": 0}

    def close(self) -> None:
        if self._own:
            self._http.close()

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ verdicts
    def score(self, task: str, episode: str | Sequence[dict[str, Any]], rubric: str = DEFAULT_RUBRIC) -> Verdict:
        """Grade one episode of ``task`` (its text, or its chat messages) in [0, 1]."""
        messages = [{"role": "system", "content": SCORE_PROMPT.format(rubric=rubric)},
                    {"role": "user", "content": f"Task:\n{task}\n\nTrajectory:\n{render_episode(episode)}"}]

        def read(answer: dict[str, Any]) -> dict[str, Any] | None:
            score = _unit(answer.get("score"))
            return None if score is None else {"score": score, "reason": str(answer.get("reason", ""))}

        value, cached = self._verdict(messages, read)
        return Verdict(value["score"], value["reason"], cached)

    def rank(self, task: str, episodes: Sequence[str | Sequence[dict[str, Any]]],
             rubric: str = DEFAULT_RUBRIC) -> list[Verdict]:
        """Grade a group of episodes of one ``task`` against each other in one call (RULER-style); one
        :class:`Verdict` per episode, in order. A group of one is graded with :meth:`score`."""
        if not episodes:
            return []
        if len(episodes) == 1:
            return [self.score(task, episodes[0], rubric)]
        n = len(episodes)
        body = "\n\n".join(f"Trajectory {i + 1}:\n{render_episode(e)}" for i, e in enumerate(episodes))
        messages = [{"role": "system", "content": RANK_PROMPT.format(rubric=rubric, n=n)},
                    {"role": "user", "content": f"Task:\n{task}\n\n{body}"}]

        def read(answer: dict[str, Any]) -> dict[str, Any] | None:
            rows = answer.get("scores")
            if not isinstance(rows, list):
                return None
            got: dict[int, dict[str, Any]] = {}
            for row in rows:
                if not isinstance(row, dict) or isinstance(row.get("id"), bool) or not isinstance(row.get("id"), int):
                    return None
                score = _unit(row.get("score"))
                if score is None or not 1 <= row["id"] <= n:
                    return None
                got[row["id"]] = {"score": score, "reason": str(row.get("reason", ""))}
            return {"scores": [got[i] for i in range(1, n + 1)]} if len(got) == n else None

        value, cached = self._verdict(messages, read)
        return [Verdict(v["score"], v["reason"], cached) for v in value["scores"]]

    # ------------------------------------------------------------------ calls
    def _verdict(self, messages: list[dict[str, str]], read: Any) -> tuple[dict[str, Any], bool]:
        body = {"model": self.model, "messages": messages, "temperature": self.temperature,
                "max_tokens": self.max_completion_tokens}
        key = hashlib.sha256(json.dumps([self.base_url, body], sort_keys=True).encode()).hexdigest()
        with self._lock:
            if key in self._cache:
                self.stats["cache_hits"] += 1
                return self._cache[key], True
        last = ""
        for attempt in range(self.retries):
            if attempt:
                self.stats["retries"] += 1
            text, last = self._chat(body, attempt)
            answer = parse_json_object(text) if text is not None else None
            value = read(answer) if answer is not None else None
            if value is not None:
                self._remember(key, value)
                return value, False
            if text is not None and not last:
                last = f"an unusable verdict: {text[:200]!r}"
        raise JudgeError(f"judge {self.base_url} gave no usable verdict in {self.retries} attempt(s): {last}")

    def _chat(self, body: dict[str, Any], attempt: int) -> tuple[str | None, str]:
        """One chat call: ``(reply text, "")``, or ``(None, why)`` after a transient failure (waited out)."""
        with self._lock:
            if self.max_calls is not None and self.stats["calls"] >= self.max_calls:
                raise JudgeBudgetExceeded(f"the judge's budget of {self.max_calls} calls is spent")
            if self.max_tokens is not None and self.stats["tokens"] >= self.max_tokens:
                raise JudgeBudgetExceeded(f"the judge's budget of {self.max_tokens} tokens is spent "
                                          f"({self.stats['tokens']} used)")
            self.stats["calls"] += 1
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        wait = min(10.0, 0.5 * 2 ** attempt)
        try:
            r = self._http.post(f"{self.base_url}/chat/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        else:
            if r.status_code < 300:
                try:
                    data = r.json()
                    usage = data.get("usage") or {}
                    with self._lock:
                        self.stats["tokens"] += int(usage.get("total_tokens") or 0)
                    return str(data["choices"][0]["message"].get("content") or ""), ""
                except (ValueError, KeyError, IndexError, TypeError, AttributeError):
                    return "", f"a malformed answer: {r.text[:200]!r}"
            why = f"HTTP {r.status_code}: {r.text[:300]}"
            if r.status_code not in RETRY_STATUSES:
                raise JudgeError(f"judge {self.base_url} refused the request: {why}")
            wait = _retry_after(r, wait)
        if attempt + 1 < self.retries:
            log.info("judge %s: %s; retrying in %.1f s", self.base_url, why, wait)
            time.sleep(wait)
        return None, why

    def _remember(self, key: str, value: dict[str, Any]) -> None:
        with self._lock:
            self._cache[key] = value
            if self.cache_path is not None:
                self.cache_path.parent.mkdir(parents=True, exist_ok=True)
                with self.cache_path.open("a") as fh:
                    fh.write(json.dumps({"key": key, "value": value}) + "\n")


def _retry_after(r: httpx.Response, default: float) -> float:
    for header, scale in (("X-Swarm-Retry-After-Ms", 1e-3), ("Retry-After", 1.0)):
        value = r.headers.get(header)
        if value:
            try:
                return min(30.0, max(0.0, float(value) * scale))
            except ValueError:
                continue
    return default
