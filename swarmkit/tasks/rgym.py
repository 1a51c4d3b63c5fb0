"""``reasoning_gym``: procedural math problems from the reasoning-gym package, scored by its own scorers.

Items come from reasoning-gym's ``composite`` dataset over a few math families
(``task.options.datasets``; by default ``gsm_symbolic``, GSM8K-style word
problems with new numbers, plus ``basic_arithmetic``, ``chain_sum`` and
``leg_counting``, equal weights). Train, eval and demonstration items are drawn
with separate reasoning-gym seeds (:func:`split_seed`), so the held-out split is
never trained on.

An episode is one chat call: the system prompt is reasoning-gym's ``direct``
prompt (``task.options.system_prompt``: another of its ``SYSTEM_PROMPTS``, or
``task.options.system``: a literal one), the user message the item's question.
The reward is the dataset's own ``score_answer`` on the reply's last
``<answer>...</answer>`` (reasoning-gym's ``extract_answer``): 1.0 for the right
answer, the family's own partial credit otherwise (``gsm_symbolic`` gives 0.01
for a number that is wrong, ``chain_sum`` ``len(answer)/len(reply)`` when the
answer is inside a longer one), 0 without the tag. Metrics: ``correct`` (score
1.0) and ``formatted`` (the tag was there).

Needs ``pip install 'swarmkit[suites]'`` (``reasoning-gym==0.1.25``); imported
only when the task is used, so the client stays light.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any

from swarmkit.tasks.base import Outcome, Task

__all__ = ["DEFAULT_DATASETS", "demonstration", "make_rg_tasks", "score_rg", "split_seed"]

DEFAULT_DATASETS = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "leg_counting")
_INSTALL = "task=reasoning_gym needs reasoning-gym: pip install 'swarmkit[suites]' (reasoning-gym==0.1.25)"


def _rg() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    return reasoning_gym


def split_seed(split: str, seed: int) -> int:
    """reasoning-gym's seed for ``split`` of task seed ``seed``: a stable 31-bit number (CRC-32), so
    train, eval and demo items come from different generator seeds in every process."""
    return zlib.crc32(f"swarmkit-rg-{split}-{seed}".encode()) & 0x7FFFFFFF


def _datasets(options: dict[str, Any]) -> list[tuple[str, float]]:
    """``task.options.datasets``: names (comma-separated or a list), each ``name`` or ``name:weight``."""
    raw = options.get("datasets", DEFAULT_DATASETS)
    items = [s.strip() for s in raw.split(",")] if isinstance(raw, str) else [str(s).strip() for s in raw]
    out = []
    for item in filter(None, items):
        name, _, weight = item.partition(":")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"task.options.datasets: bad weight in {item!r} (name:weight)") from None
        if w <= 0:
            raise ValueError(f"task.options.datasets: weight of {name!r} must be positive")
        out.append((name, w))
    if not out:
        raise ValueError("task.options.datasets: name at least one reasoning-gym dataset")
    return out


def _system(options: dict[str, Any]) -> str:
    if "system" in options:
        return str(options["system"])
    prompts = _rg().utils.SYSTEM_PROMPTS
    name = str(options.get("system_prompt", "direct"))
    if name not in prompts:
        raise ValueError(f"task.options.system_prompt: {name!r} is not a reasoning-gym prompt; "
                         f"known: {', '.join(sorted(prompts))}")
    return str(prompts[name])


def make_rg_tasks(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    """``n`` items of ``split`` from reasoning-gym's composite of ``task.options.datasets``."""
    rg = _rg()
    from reasoning_gym.composite import DatasetSpec

    known = set(rg.factory.DATASETS)
    specs = _datasets(options)
    unknown = [name for name, _ in specs if name not in known]
    if unknown:
        raise ValueError(f"task.options.datasets: unknown reasoning-gym dataset(s) {', '.join(unknown)}")
    if n <= 0:
        return []
    data = rg.create_dataset("composite", size=n, seed=split_seed(split, seed),
                             datasets=[DatasetSpec(name=name, weight=w, config={}) for name, w in specs])
    system = _system(options)
    tasks = []
    for i in range(n):
        entry = data[i]
        tasks.append(Task(
            task_id=f"rg-{split}-{i}",
            messages=[{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}],
            answer=str(entry["answer"]), family="reasoning_gym",
            meta={"entry": entry, "dataset": entry["metadata"]["source_dataset"]},
        ))
    return tasks


@functools.cache
def _scorer(dataset: str) -> Any:
    return _rg().get_score_answer_fn(dataset)


def score_rg(task: Task, completion: str) -> Outcome:
    """The dataset's own score of the last ``<answer>`` in ``completion`` (0 without one)."""
    answer = _rg().utils.extract_answer(completion or "")
    reward = float(_scorer(str(task.meta["dataset"]))(answer, task.meta["entry"])) if answer is not None else 0.0
    return Outcome(reward, completion, {"correct": float(reward >= 1.0), "formatted": float(answer is not None)})


def demonstration(task: Task) -> dict[str, Any]:
    """The ideal reply to ``task`` for the supervised warm start: the answer in the tag, nothing else
    (what the ``direct`` prompt asks for)."""
    return {"messages": [*task.messages, {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]}
