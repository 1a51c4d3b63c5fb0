"""Old import path of :mod:`swarmkit.contract` (kept for one release)."""

from swarmkit.contract import (
    Algorithm,
    BatchingPolicy,
    ClientState,
    Decision,
    GenerationOutput,
    InferenceBackend,
    LossInputs,
    MatchStrategy,
    OptimEngine,
    PoolEpisode,
    SamplingParams,
    StreamChunk,
    TrainSample,
)

__all__ = [
    "Algorithm",
    "BatchingPolicy",
    "ClientState",
    "Decision",
    "GenerationOutput",
    "InferenceBackend",
    "LossInputs",
    "MatchStrategy",
    "OptimEngine",
    "PoolEpisode",
    "SamplingParams",
    "StreamChunk",
    "TrainSample",
]
