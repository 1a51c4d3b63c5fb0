"""The advantages each trained episode's tokens got: ``run_dir/advantages.jsonl``, for the trajectory viewer.

One JSON line per trained sample, written by the trainer after it labelled a step's samples::

    {"step": 3, "episode_id": "...", "role": null, "tokens": 412, "runs": [[start, length, value], ...]}

``runs`` cover the trained tokens (loss mask 1) as runs of equal advantage (a turn's tokens
share one under per-turn credit, a whole episode's under GRPO), so a line stays short. The
file is a log, not state: a line cut by a crash is skipped when read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from swarmkit.contract import TrainSample

ADVANTAGES_FILE = "advantages.jsonl"
log = logging.getLogger(__name__)


def runs(advantages: Sequence[float], mask: Sequence[int]) -> list[list[float]]:
    """``[[start, length, value], ...]``: maximal runs of equal advantage over the tokens with mask 1."""
    out: list[list[float]] = []
    for t, (a, m) in enumerate(zip(advantages, mask, strict=True)):
        if not m:
            continue
        last = out[-1] if out else None
        if last is not None and last[0] + last[1] == t and last[2] == a:
            last[1] += 1
        else:
            out.append([t, 1, float(a)])
    return out


def expand(line: dict[str, Any]) -> list[float | None]:
    """``(tokens,)`` a line's advantage per token, None on tokens that were not trained."""
    out: list[float | None] = [None] * int(line["tokens"])
    for start, length, value in line["runs"]:
        out[int(start):int(start) + int(length)] = [float(value)] * int(length)
    return out


def append_advantages(run_dir: str | os.PathLike[str], step: int, samples: Iterable[TrainSample]) -> None:
    """Append one line per sampled (not demonstrated) sample of step ``step``."""
    lines = [json.dumps({"step": int(step), "episode_id": s.episode_id, "role": s.role, "tokens": len(s.input_ids),
                         "runs": runs(s.advantages, s.loss_mask)}, allow_nan=False)
             for s in samples if not s.demonstration]
    if not lines:
        return
    try:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(run_dir) / ADVANTAGES_FILE, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    except OSError as exc:  # the viewer's log never stops a step
        log.warning("could not append to %s: %s", Path(run_dir) / ADVANTAGES_FILE, exc)


def read_advantages(run_dir: str | os.PathLike[str] | None, episode_id: str) -> list[dict[str, Any]]:
    """The lines of ``episode_id`` (its newest step's, if it was trained twice), in the order written."""
    path = Path(run_dir) / ADVANTAGES_FILE if run_dir else None
    if path is None or not path.exists():
        return []
    found: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if episode_id not in raw:
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # a line a crash cut short
            if line.get("episode_id") != episode_id:
                continue
            if found and found[-1]["step"] != line["step"]:
                found = []
            found.append(line)
    return found
