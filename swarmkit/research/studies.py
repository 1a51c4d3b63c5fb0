"""Ready-made studies (``study=NAME``): a goal and its constraints, runnable on a CPU.

``min_batch`` is the worked study of docs/research.md (its report is in
docs/research/min-batch/); ``min_batch_quick`` is its small sibling the
end-to-end test runs.
"""

from __future__ import annotations

from typing import Any

_TINY = {"model": "tiny", "task": "token_rule", "batching.rollouts_per_task": 8, "optim.lr": 0.01}

STUDIES: dict[str, dict[str, Any]] = {
    "min_batch": {
        "goal": "Find the minimum batch size (1 to 16 tasks per step) that still learns token_rule on the tiny "
                "model within 8 optimizer steps (training reward of the last 3 steps >= 0.25, from ~0.07 "
                "untrained), and whether max_tokens changes it",
        "constraints": {
            "shape": "threshold",
            "base": {**_TINY, "trainer.total_steps": 8, "task.eval_size": 16},
            "factor": "batching.batch_size",
            "range": [1, 16],
            "ratio": 4,
            "cross": {"task.max_tokens": [8, 4]},
            "metric": "train.reward_mean",
            "threshold": 0.25,
            "seeds": [0, 1, 2],
            "budget_s": 240,
            "max_stages": 3,
        },
    },
    "min_batch_quick": {
        "goal": "Find the minimum batch size (1 to 4) that still learns token_rule on the tiny model within "
                "4 optimizer steps, and whether max_tokens changes it",
        "constraints": {
            "shape": "threshold",
            "base": {**_TINY, "trainer.total_steps": 4, "task.eval_size": 8, "task.train_size": 16},
            "factor": "batching.batch_size",
            "range": [1, 4],
            "ratio": 4,
            "cross": {"task.max_tokens": [4, 8]},
            "metric": "eval_after",
            "threshold": 0.5,
            "seeds": [0],
            "budget_s": 150,
            "max_stages": 2,
        },
    },
}
