"""Where the dashboard's data comes from: a live server, or the folder of a finished run.

Both sources answer the same questions (:class:`DashboardSource`), so the same
routes and pages serve ``/dashboard`` of a running server and ``python -m
swarmkit monitor RUN_DIR``.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Protocol

from swarmkit.errors import ApiError
from swarmkit.pool import JournalReader
from swarmkit.pool.records import EpisodeRecord
from swarmkit.server.dashboard.data import (
    Decode,
    MetricsTail,
    adapters_from_metrics,
    client_rows,
    pool_tasks,
)
from swarmkit.swarm.auth import AdminAuth
from swarmkit.swarm.episodes import Episode
from swarmkit.swarm.server import STATES_FILE, SwarmServer
from swarmkit.timelines import Timeline

#: journal records a run-dir dashboard lists
RUN_DIR_EPISODES = 2000


class DashboardSource(Protocol):
    """What the dashboard reads."""

    live: bool
    run_dir: Path | None

    def is_admin(self, token: str | None) -> bool: ...
    def status(self) -> dict[str, Any]: ...
    def state_history(self) -> list[tuple[float, str]]: ...
    def running(self) -> list[Episode]: ...
    def all_episodes(self) -> list[Episode]: ...
    def episode(self, episode_id: str) -> Episode: ...
    def clients(self, now: float) -> list[dict[str, Any]]: ...
    def decoder(self) -> Decode | None: ...
    def match(self) -> str: ...
    def pool_tasks(self) -> list[dict[str, Any]]: ...
    def adapters(self) -> list[str]: ...


class LiveSource:
    """A running :class:`~swarmkit.swarm.server.SwarmServer`."""

    live = True

    def __init__(self, srv: SwarmServer):
        self.srv = srv
        self._tokenizer: tuple[Any, Any] | None = None

    @property
    def run_dir(self) -> Path | None:
        return self.srv.run_dir

    def is_admin(self, token: str | None) -> bool:
        return self.srv.auth.is_admin(token)

    def status(self) -> dict[str, Any]:
        return self.srv.status()

    def state_history(self) -> list[tuple[float, str]]:
        return [(t, str(s)) for t, s in self.srv.state.history]

    def running(self) -> list[Episode]:
        return self.srv.episodes.running()

    def all_episodes(self) -> list[Episode]:
        return [*self.srv.episodes.running(), *self.srv.episodes.ended()]

    def episode(self, episode_id: str) -> Episode:
        return self.srv.episodes.get(episode_id)

    def clients(self, now: float) -> list[dict[str, Any]]:
        return client_rows(self.srv.clients.all(), now, self.srv.clients.active_window_s)

    def decoder(self) -> Decode | None:
        backend = self.srv.backend
        if backend is None:
            return None
        if self._tokenizer is None or self._tokenizer[0] is not backend:
            # a private copy: the server's own is busy encoding in the render thread (a Rust tokenizer
            # that one thread mutably borrows refuses another: "Already borrowed")
            self._tokenizer = (backend, copy.deepcopy(backend.tokenizer))
        tok = self._tokenizer[1]
        return lambda ids: str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def match(self) -> str:
        return match_name(self.srv.config)

    def pool_tasks(self) -> list[dict[str, Any]]:
        return pool_tasks(((e.task_id, e.task_family, e.reward) for e in self.srv.waiting()),
                          rollouts_per_task(self.srv.config))

    def adapters(self) -> list[str]:
        return list(self.srv.adapters)


class RunDirSource:
    """The folder of a run, read-only: ``metrics.jsonl``, ``states.jsonl``, ``journal.sqlite``.

    Episodes are the journal's (accepted training episodes: status ``untrained``,
    ``trained`` or ``filtered``); the tokenizer of the run's model gives per-token
    text when it can be loaded (``model_path``, or the ``model.path`` of the newest
    checkpoint's config).
    """

    live = False

    def __init__(self, run_dir: str | os.PathLike[str], admin_token: str, model_path: str | None = None):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(f"no run folder at {self.run_dir}")
        self._auth = AdminAuth(admin_token, None)
        self._model_path = model_path
        self._tail = MetricsTail()
        journal = self.run_dir / "journal.sqlite"
        self._journal = JournalReader(journal) if journal.exists() else None
        self._decode: Decode | None = None
        self._tokenizer_tried = False

    def is_admin(self, token: str | None) -> bool:
        return self._auth.is_admin(token)

    def status(self) -> dict[str, Any]:
        rows = [r for r in self._tail.rows(self.run_dir) if r.get("kind", "train") == "train"]
        last = rows[-1] if rows else {}
        history = self.state_history()
        counts = self._journal.counts() if self._journal is not None else {}
        step = int(last.get("step") or 0)
        adapters = adapters_from_metrics(rows)
        first = history[0][0] if history else (rows[0]["time"] if rows else time.time())
        end = rows[-1]["time"] if rows else first
        return {
            "state": history[-1][1] if history else "OFFLINE",
            "source": f"run folder {self.run_dir} (not live)",
            "global_step": step, "policy_version": step, "model": self._model_label(),
            "last_error": None, "training_finished": None, "uptime_s": max(0.0, end - first),
            "episodes": {"running": 0, "running_train": 0, "running_eval": 0,
                         "finished": sum(counts.get(k, 0) for k in ("untrained", "trained", "filtered"))},
            "pool": {"episodes": counts.get("untrained", 0), "tasks": counts.get("untrained_tasks", 0),
                     "reserved": 0, "trained": counts.get("trained", 0), "filtered": counts.get("filtered", 0),
                     "fill": None, "last_step": last or None, **({"adapters": adapters} if adapters else {})},
            "clients": {"active": 0, "ready": 0},
        }

    def state_history(self) -> list[tuple[float, str]]:
        path = self.run_dir / STATES_FILE
        if not path.exists():
            return []
        out = []
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
                out.append((float(row["time"]), str(row["state"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
        return out

    def running(self) -> list[Episode]:
        return []

    def all_episodes(self) -> list[Episode]:
        if self._journal is None:
            return []
        return [_episode(r) for r in self._journal.newest(RUN_DIR_EPISODES)]

    def episode(self, episode_id: str) -> Episode:
        record = self._journal.get(episode_id) if self._journal is not None else None
        if record is None:
            raise ApiError(404, f"no episode '{episode_id}' in this run's journal", "episode_not_found")
        return _episode(record)

    def clients(self, now: float) -> list[dict[str, Any]]:
        return []

    def decoder(self) -> Decode | None:
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            path = self._model_path or self._checkpoint_model_path()
            if path:
                try:
                    from transformers import AutoTokenizer

                    from swarmkit.models import resolve_model_path

                    tok = AutoTokenizer.from_pretrained(resolve_model_path(path))
                    self._decode = lambda ids: str(tok.decode(ids, skip_special_tokens=False,
                                                              clean_up_tokenization_spaces=False))
                except Exception:  # noqa: BLE001 - per-block text is the fallback
                    self._decode = None
        return self._decode

    def match(self) -> str:
        return match_name(self._checkpoint_config())

    def pool_tasks(self) -> list[dict[str, Any]]:
        if self._journal is None:
            return []
        return pool_tasks(self._journal.untrained_rewards(), rollouts_per_task(self._checkpoint_config()))

    def adapters(self) -> list[str]:
        return adapter_names(self._checkpoint_config())

    def _checkpoint_config(self) -> dict[str, Any]:
        configs = sorted((self.run_dir / "checkpoints").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
        if not configs:
            return {}
        try:
            data = json.loads(configs[-1].read_text())
        except (OSError, json.JSONDecodeError):
            return {}
        return data if isinstance(data, dict) else {}

    def _checkpoint_model_path(self) -> str | None:
        model = self._checkpoint_config().get("model")
        path = model.get("path") if isinstance(model, dict) else None
        return str(path) if path else None

    def _model_label(self) -> str:
        path = self._model_path or self._checkpoint_model_path()
        return Path(path).name if path else "-"


def rollouts_per_task(config: Any) -> int | None:
    """``batching.rollouts_per_task`` of a config, if it names one."""
    try:
        value = config["batching"]["rollouts_per_task"]
    except (KeyError, TypeError):
        return None
    return int(value) if isinstance(value, int) else None


def adapter_names(config: Any) -> list[str]:
    """The names of a config's ``model.adapters`` (each a name or ``{name, lr, batching}``); [] for one model."""
    try:
        entries = config["model"]["adapters"] or []
    except (KeyError, TypeError):
        return []
    names = [e.get("name") if isinstance(e, dict) else e for e in entries] if isinstance(entries, list) else []
    return [str(n) for n in names if n]


def match_name(config: Any) -> str:
    """The configured match strategy's name (``text`` when the config names none)."""
    try:
        match = config["match"]
        name = match.get("name") if hasattr(match, "get") else match
    except (KeyError, TypeError, AttributeError):
        return "text"
    return str(name) if name else "text"


def _episode(record: EpisodeRecord) -> Episode:
    """A journal record in the shape the dashboard's views read."""
    reward = record.reward
    return Episode(
        id=record.episode_id, task_id=record.task_id, eval=False, client_id=record.client_id,
        created=record.accepted_at, deadline=record.accepted_at, keys={},
        meta={**record.meta, "task_family": record.task_family}, policy_version=record.policy_version,
        status=record.status, reward=float(reward) if isinstance(reward, int | float) else None,
        rewards=dict(reward) if isinstance(reward, dict) else {}, ended=record.accepted_at,
        timelines=[Timeline.from_dict(t) for t in record.timelines], n_calls=len(record.timelines), accepted=True,
        adapter=record.adapter or None)
