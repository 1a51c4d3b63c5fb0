"""The plugin contract: what each kind of component implements.

One module per kind (:mod:`.backend`, :mod:`.optim`, :mod:`.algo`,
:mod:`.match`, :mod:`.batching`) plus the data that crosses the boundary
(:mod:`.samples`, :mod:`.streaming`). These classes are the *only* contract:
the core calls nothing a plugin is not declared to have here, and
:func:`check_implementation` refuses a component that misses part of it when
it is loaded. Nothing here imports torch.
"""

from __future__ import annotations

import inspect
from typing import Any

from swarmkit.contract.algo import (
    LOSS_AGG_MODES,
    OVERLONG_MODES,
    REFERENCE_MODES,
    Algorithm,
    LossInputs,
    check_algorithm,
)
from swarmkit.contract.backend import (
    EngineFailure,
    GenerationOutput,
    InferenceBackend,
    PromptScores,
    SamplingParams,
    StreamChunk,
    decode_generated,
)
from swarmkit.contract.batching import (
    BatchingPolicy,
    ClientState,
    Decision,
    PoolEpisode,
    scalar_reward,
)
from swarmkit.contract.credit import CREDIT_MODES, CreditUnit, Turn, check_turn_advantages
from swarmkit.contract.match import MatchStrategy
from swarmkit.contract.optim import OptimEngine
from swarmkit.contract.samples import TrainSample

#: kind -> the base class (or protocol) its implementations must meet
CONTRACTS: dict[str, type] = {
    "backend": InferenceBackend,
    "optim": OptimEngine,
    "algo": Algorithm,
    "match": MatchStrategy,
    "batching": BatchingPolicy,
}


def check_implementation(kind: str, obj: Any, name: str = "") -> None:
    """Raise :class:`TypeError` when ``obj`` (a class, or for ``match`` an object) misses the contract of ``kind``.

    A class must subclass the kind's base class and leave no abstract method
    unimplemented; a match strategy must have ``key(block)``, ``stable_keys`` and ``key_field``.
    """
    what = f"{kind} '{name}'" if name else kind
    base = CONTRACTS[kind]
    if kind == "match":
        missing = [m for m in ("key", "stable_keys", "key_field") if not hasattr(obj, m)]
        if missing or not callable(getattr(obj, "key", None)):
            raise TypeError(f"{what} ({obj!r}) is not a swarmkit.contract.MatchStrategy: it lacks "
                            f"{', '.join(missing) or 'a callable key(block)'}")
        return
    if not (inspect.isclass(obj) and issubclass(obj, base)):
        raise TypeError(f"{what} ({obj!r}) must be a class subclassing swarmkit.contract.{base.__name__}")
    abstract = sorted(getattr(obj, "__abstractmethods__", ()))
    if abstract:
        raise TypeError(f"{what} ({obj.__module__}.{obj.__qualname__}) does not implement "
                        f"{', '.join(abstract)} of swarmkit.contract.{base.__name__}")


__all__ = [
    "CONTRACTS",
    "CREDIT_MODES",
    "LOSS_AGG_MODES",
    "OVERLONG_MODES",
    "REFERENCE_MODES",
    "Algorithm",
    "BatchingPolicy",
    "ClientState",
    "CreditUnit",
    "Decision",
    "EngineFailure",
    "GenerationOutput",
    "InferenceBackend",
    "LossInputs",
    "MatchStrategy",
    "OptimEngine",
    "PoolEpisode",
    "PromptScores",
    "SamplingParams",
    "StreamChunk",
    "TrainSample",
    "Turn",
    "check_algorithm",
    "check_implementation",
    "check_turn_advantages",
    "decode_generated",
    "scalar_reward",
]
