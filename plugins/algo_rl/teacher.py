"""The teacher of on-policy distillation: token logprobs from any OpenAI-compatible ``/completions``.

:class:`TeacherClient` sends each sequence as token ids with ``echo: true``, ``logprobs: 0`` and
``max_tokens: 0`` (vLLM's and OpenAI's legacy API's prompt scoring; a swarm server answers the same) and
reads ``choices[i].logprobs.token_logprobs``: log p_teacher(token t | tokens before t) for every token
(the first null). Requests that fail for a passing reason (connection errors, timeouts, 429, 5xx) are
retried with exponential backoff, honouring ``Retry-After``; any other answer is a :class:`TeacherError`
naming the teacher, the status and its message. With ``swarm=True`` the URL is a swarm server's root: one
eval episode is registered there per :meth:`TeacherClient.score` call (eval episodes never train the
teacher, and scoring calls are not recorded) and aborted afterwards.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import httpx

log = logging.getLogger(__name__)

#: the bearer key when ``algo.teacher_api_key`` is empty
KEY_ENV = "SWARMKIT_TEACHER_API_KEY"
#: statuses worth another attempt
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})


class TeacherError(RuntimeError):
    """The teacher could not score a batch (after the retries), or answered something unusable."""


class TeacherClient:
    """Scores token sequences with a teacher endpoint (see the module docstring).

    :param url: the API base URL (``http://host:port/v1``), or a swarm server's root with ``swarm``.
    :param api_key: bearer key (``$SWARMKIT_TEACHER_API_KEY`` when empty); with ``swarm`` the client token.
    :param model: the request's ``model`` field.
    :param timeout_s: seconds per request; ``retries``: attempts per request; ``batch``: sequences per request.
    :param transport: an httpx transport (tests).
    """

    def __init__(self, url: str, *, api_key: str = "", model: str = "", swarm: bool = False,
                 timeout_s: float = 120.0, retries: int = 3, batch: int = 16,
                 transport: httpx.BaseTransport | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key or os.environ.get(KEY_ENV, "")
        self.model = model
        self.swarm = bool(swarm)
        self.timeout_s = float(timeout_s)
        self.retries = max(1, int(retries))
        self.batch = max(1, int(batch))
        self._http = httpx.Client(timeout=self.timeout_s, transport=transport)
        #: counters since construction: requests, retries, tokens scored, seconds waited on the teacher
        self.stats = {"requests": 0, "retries": 0, "tokens": 0, "time_s": 0.0}

    def close(self) -> None:
        self._http.close()

    # ------------------------------------------------------------------ scoring
    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """``[len(seq)]`` per sequence: the teacher's logprob of each token given the ones before it
        (NaN at position 0). Raises :class:`TeacherError`."""
        if not sequences:
            return []
        t0 = time.perf_counter()
        base, key, episode = self._open()
        try:
            out: list[list[float]] = []
            for a in range(0, len(sequences), self.batch):
                out.extend(self._score_batch(base, key, [list(map(int, s)) for s in sequences[a:a + self.batch]]))
        finally:
            if episode is not None:
                self._close_episode(*episode)
            self.stats["time_s"] += time.perf_counter() - t0
        return out

    def _score_batch(self, base: str, key: str, seqs: list[list[int]]) -> list[list[float]]:
        body: dict[str, Any] = {"prompt": seqs, "echo": True, "max_tokens": 0, "logprobs": 0, "temperature": 0.0}
        if self.model:
            body["model"] = self.model
        answer = self._post(f"{base}/completions", body, key, "score")
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != len(seqs):
            raise TeacherError(f"teacher {self.url} answered {len(choices) if isinstance(choices, list) else 'no'} "
                               f"choices for {len(seqs)} prompts")
        by_index = sorted(choices, key=lambda c: int(c.get("index", 0)))
        out = []
        for seq, choice in zip(seqs, by_index, strict=True):
            lps = ((choice.get("logprobs") or {}).get("token_logprobs")) if isinstance(choice, dict) else None
            if not isinstance(lps, list) or len(lps) != len(seq):
                got = len(lps) if isinstance(lps, list) else "no"
                raise TeacherError(
                    f"teacher {self.url} returned {got} prompt logprobs for a sequence of {len(seq)} tokens: it must "
                    "support echo with logprobs and max_tokens 0, and share the student's tokenizer")
            out.append([math.nan if v is None else float(v) for v in lps])
            self.stats["tokens"] += len(seq)
        return out

    # ------------------------------------------------------------------ swarm teacher
    def _open(self) -> tuple[str, str, tuple[str, str] | None]:
        """``(api base URL, bearer key, (episode id, key) to abort or None)``."""
        if not self.swarm:
            return self.url, self.api_key, None
        got = self._post(f"{self.url}/api/v1/episodes", {"task_id": "distill-teacher", "eval": True},
                         self.api_key, "register an eval episode")
        try:
            return str(got["base_url"]).rstrip("/"), str(got["api_key"]), (str(got["episode_id"]), str(got["api_key"]))
        except KeyError as exc:
            raise TeacherError(f"swarm teacher {self.url}: its registration answer has no {exc}") from None

    def _close_episode(self, episode_id: str, key: str) -> None:
        try:
            self._http.post(f"{self.url}/api/v1/episodes/{episode_id}/abort", json={"reason": "distillation scored"},
                            headers={"Authorization": f"Bearer {key}"})
        except httpx.HTTPError as exc:  # the teacher reaps it at its deadline
            log.warning("swarm teacher %s: could not abort scoring episode %s: %s", self.url, episode_id, exc)

    # ------------------------------------------------------------------ HTTP
    def _post(self, url: str, body: dict[str, Any], key: str, what: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        last = ""
        for attempt in range(self.retries):
            if attempt:
                self.stats["retries"] += 1
            self.stats["requests"] += 1
            try:
                r = self._http.post(url, json=body, headers=headers)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
                wait = min(10.0, 0.5 * 2 ** attempt)
            else:
                if r.status_code < 300:
                    try:
                        data = r.json()
                    except ValueError:
                        raise TeacherError(f"teacher {url} ({what}) answered {r.status_code} with a body that is "
                                           "not JSON") from None
                    if not isinstance(data, dict):
                        raise TeacherError(f"teacher {url} ({what}) answered a JSON {type(data).__name__}, "
                                           "not an object")
                    return data
                last = f"HTTP {r.status_code}: {_message(r)}"
                if r.status_code not in RETRY_STATUSES:
                    raise TeacherError(f"teacher {url} refused to {what}: {last}")
                wait = _retry_after(r, min(10.0, 0.5 * 2 ** attempt))
            if attempt + 1 < self.retries:
                log.info("teacher %s (%s): %s; retrying in %.1f s", url, what, last, wait)
                time.sleep(wait)
        raise TeacherError(f"teacher {url} could not {what} after {self.retries} attempt(s): {last}")


def _message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    except (ValueError, AttributeError):
        pass
    return r.text[:300]


def _retry_after(r: httpx.Response, default: float) -> float:
    for header, scale in (("X-Swarm-Retry-After-Ms", 1e-3), ("Retry-After", 1.0)):
        value = r.headers.get(header)
        if value:
            try:
                return min(30.0, max(0.0, float(value) * scale))
            except ValueError:
                continue
    return default
