"""What the dashboard shows, as JSON-ready dicts.

Pure views over a server's state (:class:`~swarmkit.swarm.server.SwarmServer`),
the rows of its ``metrics.jsonl`` and its episodes: no I/O here but reading the
metrics file (:class:`MetricsTail`). Times are ``time.time()`` seconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from swarmkit.pool.advantages import expand
from swarmkit.swarm.episodes import Episode
from swarmkit.swarm.metrics import read_metrics
from swarmkit.timelines import Timeline, merge_timelines

#: ``token ids -> their text`` (special tokens kept, no space clean-up: what the model wrote)
Decode = Callable[[list[int]], str]
#: tokens of left context when a token's text is cut out of a decode (merges, leading spaces)
DECODE_WINDOW = 8
#: at most this many state spans and episodes in one answer
MAX_SPANS = 300
MAX_EPISODES = 200


def state_spans(history: Sequence[tuple[float, Any]], now: float, limit: int = MAX_SPANS) -> list[dict[str, Any]]:
    """One ``{state, start, seconds}`` per stay in a state, oldest first; the last is still open.

    ``history``: ``(time entered, state)`` pairs in order (``StateMachine.history``).
    """
    recent = history[-limit:]
    spans = []
    for k, (start, state) in enumerate(recent):
        end = recent[k + 1][0] if k + 1 < len(recent) else now
        spans.append({"state": str(state), "start": start, "seconds": max(0.0, end - start)})
    return spans


def pool_tasks(episodes: Iterable[tuple[str, str, Any]], needed: int | None,
               limit: int = 50) -> list[dict[str, Any]]:
    """The pool per task, fullest first: ``(task_id, family, reward)`` of each untrained episode in,
    ``{task_id, family, episodes, needed, rewards_differ}`` out (the paper's Fig. 4: what the batching
    trigger counts — episodes per task against ``rollouts_per_task``, tasks whose rewards differ)."""
    by_task: dict[str, dict[str, Any]] = {}
    for task_id, family, reward in episodes:
        row = by_task.setdefault(task_id, {"task_id": task_id, "family": family, "episodes": 0, "needed": needed,
                                           "_rewards": set()})
        row["episodes"] += 1
        row["_rewards"].add(json.dumps(reward, sort_keys=True))
    rows = sorted(by_task.values(), key=lambda r: (-r["episodes"], r["task_id"]))[:limit]
    for row in rows:
        row["rewards_differ"] = len(row.pop("_rewards")) > 1
    return rows


def generated_tokens(ep: Episode) -> int:
    """Tokens the model generated for an episode (the trainable ones of its timelines)."""
    return sum(sum(b.loss_mask) for tl in ep.timelines for b in tl.blocks if b.author == "llm")


def episode_row(ep: Episode, now: float) -> dict[str, Any]:
    """The summary line of an episode in the dashboard's tables."""
    roles = sorted({tl.role for tl in ep.timelines if tl.role} | set(ep.roles))
    return {
        "episode_id": ep.id,
        "task_id": ep.task_id,
        "family": ep.meta.get("task_family") if isinstance(ep.meta, dict) else None,
        "eval": ep.eval,
        "client_id": ep.client_id,
        "status": ep.status,
        "roles": roles,
        "age_s": (ep.ended or now) - ep.created,
        "created": ep.created,
        "calls": ep.n_calls,
        "timelines": len(ep.timelines),
        "tokens": generated_tokens(ep),
        "reward": _finite(ep.reward),
        "rewards": {k: _finite(v) for k, v in ep.rewards.items()} or None,
        "policy_version": ep.policy_version,
        "adapter": ep.adapter,
        "accepted": ep.accepted,
        "abort_reason": ep.abort_reason,
    }


def client_rows(clients: dict[str, Any], now: float, window_s: float) -> list[dict[str, Any]]:
    """``ClientTracker.all()`` as rows: seconds since last seen, ready vote, active or not."""
    rows = [{"client_id": cid, "last_seen_s": now - s.last_seen, "ready": s.ready,
             "active": now - s.last_seen <= window_s} for cid, s in clients.items()]
    return sorted(rows, key=lambda r: r["last_seen_s"])


def find_episodes(episodes: Iterable[Episode], now: float, *, task: str = "", role: str = "", client: str = "",
                  status: str = "", kind: str = "", adapter: str = "", min_reward: float | None = None,
                  max_reward: float | None = None, limit: int = MAX_EPISODES) -> list[dict[str, Any]]:
    """Rows of the episodes that pass every filter given, newest first.

    ``task`` / ``client``: substrings of the task id / client id; ``role``: a role the
    episode played; ``status``: running, finished, aborted, …; ``kind``: ``train`` or
    ``eval``; ``adapter``: the LoRA adapter it sampled with (``model.adapters``; exact name);
    rewards: bounds on the episode's reward (episodes without one fail them).
    """
    out = []
    for ep in sorted(episodes, key=lambda e: e.created, reverse=True):
        if task and task not in ep.task_id or client and client not in ep.client_id:
            continue
        if adapter and ep.adapter != adapter:
            continue
        if status and ep.status != status or kind and (kind == "eval") != ep.eval:
            continue
        row = episode_row(ep, now)
        if role and role not in row["roles"]:
            continue
        r = row["reward"]
        if (min_reward is not None or max_reward is not None) and r is None:
            continue
        if min_reward is not None and r < min_reward or max_reward is not None and r > max_reward:
            continue
        out.append(row)
        if len(out) >= limit:
            break
    return out


def adapter_names(episodes: Iterable[Episode], rows: Iterable[dict[str, Any]] = ()) -> list[str]:
    """The LoRA adapters (``model.adapters``) that ``episodes`` sampled with or metrics ``rows`` trained, sorted."""
    names = {ep.adapter for ep in episodes if ep.adapter}
    names |= {k[len("adapter/"):-len("/step")] for r in rows for k in r if k.startswith("adapter/") and k.endswith("/step")}
    return sorted(names)


def adapters_from_metrics(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each adapter's last ``step`` and ``reward_mean`` from the rows of ``metrics.jsonl`` (a finished run's
    ``status()["pool"]["adapters"]``; its serving and pool counts are not in the file)."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith("adapter/") and k.endswith("/step"):
                name = k[len("adapter/"):-len("/step")]
                out[name] = {"step": int(v), "policy_version": int(v), "waiting": None, "running": 0,
                             "reward_mean": _finite(r.get(f"adapter/{name}/reward_mean"))}
    return dict(sorted(out.items()))


def token_pieces(decode: Decode, ids: list[int], window: int = DECODE_WINDOW) -> list[str]:
    """Each token's share of ``decode(ids)``: the pieces join to it.

    A token's text is what it adds to the decode of the tokens before it (``window`` of them:
    enough for a tokenizer's merges and leading spaces). A token that ends inside a UTF-8
    character gets ``""``; the token that completes the character carries it whole.
    """
    pieces: list[str] = []
    start = 0  # the first token whose text is not out yet
    for k in range(len(ids)):
        s = max(0, start - window)
        upto = decode(ids[s:k + 1])
        if upto.endswith("\ufffd") and k + 1 < len(ids):
            pieces.append("")  # an incomplete character: the next token finishes it
            continue
        base = decode(ids[s:start]) if start > s else ""
        pieces.append(upto[len(base):] if upto.startswith(base) else decode(ids[start:k + 1]))
        start = k + 1
    return pieces


def timeline_view(tl: Timeline, decode: Decode | None, advantages: Sequence[float | None] | None = None
                  ) -> dict[str, Any]:
    """A timeline token by token: each block's author, ``[text, id, logprob, trained]`` per token
    (:func:`token_pieces`: a block's pieces join to what its tokens decode to) and, for a generated
    block, the policy version that sampled each token (``versions``; null where unknown).

    With ``advantages`` (one per token of the timeline, None where not trained) each token gets a
    fifth entry, the advantage it was trained with. Without ``decode`` (no tokenizer loaded) a
    block is one piece: its text, no id.
    """
    blocks = []
    pos = 0
    for b in tl.blocks:
        if decode is None:
            tokens = [[b.text, None, None, int(any(b.loss_mask))]]
            if advantages is not None:
                trained = [a for a in advantages[pos:pos + len(b)] if a is not None]
                tokens[0].append(sum(trained) / len(trained) if trained else None)
        else:
            pieces = token_pieces(decode, list(b.token_ids))
            tokens = [[piece, t, _finite(lp) if m else None, m]
                      for piece, t, lp, m in zip(pieces, b.token_ids, b.logprobs, b.loss_mask, strict=True)]
            if advantages is not None:
                for k, row in enumerate(tokens):
                    row.append(_finite(advantages[pos + k]))
        pos += len(b)
        blocks.append({"author": b.author, "tokens": tokens, "versions": b.versions if decode is not None else None})
    meta = {k: v for k, v in tl.meta.items() if isinstance(v, str | int | float | bool) or v is None}
    return {"role": tl.role, "meta": meta, "blocks": blocks}


def _trained_for(samples: Sequence[Timeline], trained: Sequence[dict[str, Any]]) -> list[list[float | None] | None]:
    """Per merged sample, the advantages a training step gave its tokens (lines of
    ``advantages.jsonl``, matched in order by role and length), None when no step trained it."""
    left = list(trained)
    out: list[list[float | None] | None] = []
    for tl in samples:
        n = tl.num_tokens()
        k = next((i for i, line in enumerate(left) if line.get("role") == tl.role and int(line["tokens"]) == n), None)
        out.append(expand(left.pop(k)) if k is not None else None)
    return out


def episode_view(ep: Episode, now: float, decode: Decode | None, match: str = "text",
                 trained: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """An episode for the trajectory viewer: its row, its timelines (one per call) and the
    training samples they merge into under ``match`` (what the trainer would build); once a step
    trained them (``trained``: :func:`swarmkit.pool.advantages.read_advantages`), every sample
    token carries the advantage it was trained with."""
    samples = [t for t in merge_timelines(list(ep.timelines), match) if isinstance(t, Timeline)] if ep.timelines else []
    advantages = _trained_for(samples, trained)
    return {
        "episode": episode_row(ep, now),
        "match": match,
        "timelines": [timeline_view(tl, decode) for tl in ep.timelines],
        "samples": [timeline_view(tl, decode, adv) for tl, adv in zip(samples, advantages, strict=True)],
        "advantages": any(a is not None for a in advantages),
    }


class MetricsTail:
    """The rows of a run's ``metrics.jsonl``, re-read only when the file changed size."""

    def __init__(self) -> None:
        self._key: tuple[Path, int] | None = None
        self._rows: list[dict[str, Any]] = []

    def rows(self, run_dir: str | Path | None) -> list[dict[str, Any]]:
        path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        if path is None or not path.exists():
            return []
        key = (path, path.stat().st_size)
        if key != self._key:
            self._rows, self._key = read_metrics(path.parent), key
        return self._rows


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and math.isfinite(x) else None
