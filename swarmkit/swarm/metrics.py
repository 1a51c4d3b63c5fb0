"""Per-run metrics: one JSON line per optimizer step.

``<run_dir>/metrics.jsonl`` is the record of truth (append-only, flushed per
line). TensorBoard, W&B and MLflow get the same metrics through the lifecycle
hooks, from the logger plugins the config selects (``logger=[...]``).
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any


class MetricsWriter:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._lock = threading.Lock()
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        row = finite_or_none({"time": time.time(), "kind": kind, "step": step, **metrics})
        with self._lock:
            self._file.write(json.dumps(row, default=float) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def finite_or_none(metrics: dict[str, Any]) -> dict[str, Any]:
    """The metrics with NaN / inf numbers as None (JSON has no NaN: a status with one would not serialise)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}


def step_line(m: dict[str, Any], *, trigger: str | None = None, pool: str | None = None) -> str:
    """One console line for a training step's metrics ``m`` (with its ``step``): what fired it,
    reward (``sft`` for a step of demonstrations only), loss, samples, merge ratio, trained tokens,
    the collapse signals (share of identical and of flat groups, entropy; ``COLLAPSE ALARM`` while it is raised), pool fill after it, step time (and the drain before it, when it took a while) and weight-sync time."""
    demos = int(m.get("demonstrations") or 0)
    reward = m.get("reward_mean")
    reward_txt = "sft" if demos and demos == int(m.get("episodes") or 0) else (
        f"{reward:.3f}" if isinstance(reward, int | float) else "-")
    loss = m.get("loss")
    parts = [f"step {int(m.get('step') or 0):>3}"]
    if trigger:
        parts.append(f"trigger {trigger}")
    parts += [f"reward {reward_txt:>5}", f"loss {loss:+.4f}" if isinstance(loss, int | float) else "loss -",
              f"samples {int(m.get('samples') or 0)}"]
    if isinstance(m.get("merge_ratio"), int | float):
        parts.append(f"merge {m['merge_ratio']:.2f}")
    parts.append(f"tokens {int(m.get('trained_tokens', m.get('tokens')) or 0)}")
    collapse = [(label, m.get(key)) for label, key in (("identical", "collapse/identical_groups"),
                                                        ("flat", "collapse/flat_groups"), ("entropy", "collapse/entropy"))]
    if any(isinstance(v, int | float) for _, v in collapse):
        parts.append(" ".join(f"{label} {v:.2f}" for label, v in collapse if isinstance(v, int | float)))
    if m.get("collapse/alarm"):
        parts.append("COLLAPSE ALARM")
    if pool:
        parts.append(f"pool {pool}")
    drain = m.get("drain_s") or 0.0
    parts.append(f"{m.get('cycle_time_s') or 0.0:.1f}s ("
                 + (f"drain {drain:.1f}s, " if drain >= 0.05 else "") + f"sync {m.get('weight_sync_s') or 0.0:.2f}s)")
    return "  ".join(parts)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``<run_dir>/metrics.jsonl`` (none if there is no file), up to a last line
    that is still being written (the file is append-only: only the last line can be partial)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows
