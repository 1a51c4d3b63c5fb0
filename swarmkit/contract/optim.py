"""The optimizer-engine contract: owns the trainable model, its optimizer and the distributed set-up.

An engine (kind ``optim``) subclasses :class:`OptimEngine` and is built as
``cls(model_path=..., model_cfg=..., optim_cfg=..., algo=...)``: a local HF
model folder, the ``model`` and ``optim`` groups as plain dicts, and the
checked :class:`~swarmkit.contract.algo.Algorithm`. Engines built on the
training core (:class:`swarmkit.training.engine.TrainingEngine`) get all of
this but the distributed parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

from swarmkit.contract.samples import TrainSample


class OptimEngine(ABC):
    """One trainable model.

    ``optimizer_steps`` counts optimizer updates (= the policy version of the
    weights); ``train_steps`` counts :meth:`train_step` calls that updated the
    model (equal unless the algorithm takes several epochs or mini-batches).
    Both are restored by :meth:`load_checkpoint`.
    """

    optimizer_steps: int = 0
    train_steps: int = 0

    @abstractmethod
    def train_step(self, batch: Sequence[TrainSample]) -> dict[str, float]:
        """Train on ``batch`` (every rank gets the whole batch); returns scalar metrics.

        Metrics the server shows when present: ``loss``, ``trained_tokens``,
        ``tokens``, ``grad_norm``, ``lr``, ``step_time_s``.
        """

    @abstractmethod
    def export_weights(self) -> Iterable[tuple[str, Any]]:
        """``(name, tensor)`` of the full HF model (LoRA merged) for the inference engine.

        Collective under torch.distributed; ranks > 0 may return nothing.
        """

    @abstractmethod
    def save_checkpoint(self, path: str) -> None:
        """Write weights, optimizer state and counters into the folder ``path``."""

    @abstractmethod
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (counters included)."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Free the engine (and any processes it started)."""
