"""What the logger plugins share: which runs selected them, finite scalars, trajectory rows."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

H = TypeVar("H")

#: columns of a trajectory row (a W&B table, an MLflow artifact)
TRAJECTORY_COLUMNS = ("step", "episode_id", "task_id", "reward", "timeline", "role", "prompt", "completion",
                      "trained_tokens", "mean_logprob")


def selected(config: dict[str, Any], name: str) -> bool:
    """Whether the run's config lists the logger ``name`` in ``logger``."""
    loggers = config.get("logger")
    return isinstance(loggers, list | tuple) and name in loggers


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a step's metrics."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(float(v))}


def trajectory_rows(step: int, trajectories: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per timeline of the step's logged episodes: the prompt text, the generated text
    (``llm`` blocks), trained tokens and their mean logprob."""
    rows = []
    for ep in trajectories:
        reward = ep.get("reward")
        for k, tl in enumerate(ep.get("timelines") or []):
            blocks = tl.get("blocks") or []
            trained = [lp for b in blocks for lp, m in zip(b.get("logprobs") or [], b.get("loss_mask") or [],
                                                           strict=False) if m]
            rows.append({
                "step": step, "episode_id": ep.get("episode_id"), "task_id": ep.get("task_id"),
                "reward": reward if isinstance(reward, int | float) else str(reward), "timeline": k,
                "role": tl.get("role") or "",
                "prompt": "".join(b.get("text", "") for b in blocks if b.get("author") != "llm"),
                "completion": "".join(b.get("text", "") for b in blocks if b.get("author") == "llm"),
                "trained_tokens": len(trained),
                "mean_logprob": sum(trained) / len(trained) if trained else None,
            })
    return rows


class Runs(Generic[H]):
    """Open handles of the runs a logger serves, by run dir (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, H] = {}

    def open(self, run_dir: str, make: Callable[[], H]) -> None:
        with self._lock:
            if run_dir not in self._open:
                self._open[run_dir] = make()

    def get(self, run_dir: str) -> H | None:
        with self._lock:
            return self._open.get(run_dir)

    def pop(self, run_dir: str) -> H | None:
        with self._lock:
            return self._open.pop(run_dir, None)
