"""Old import path of :mod:`swarmkit.training` (kept for one release)."""

from swarmkit.training import (
    CHECKPOINT_DIR,
    LATEST,
    Trainer,
    TrainSample,
    build_algo,
    build_samples,
)

__all__ = ["CHECKPOINT_DIR", "LATEST", "TrainSample", "Trainer", "build_algo", "build_samples"]
