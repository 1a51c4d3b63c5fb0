"""The RL-algorithm contract: advantages from rewards, and the loss of a micro-batch.

An algorithm (kind ``algo``) subclasses :class:`Algorithm` and is built as
``cls(**config)`` from the ``algo`` group. The training core reads only what
is declared here: the class attributes tell the engine what to prepare, one
of the two advantage methods labels the samples, and :meth:`Algorithm.loss`
turns one micro-batch (:class:`LossInputs`) into a loss. :func:`check_algorithm`
runs when the algorithm is built, so a plugin that misses part of this
contract fails at once with a :class:`TypeError` naming what is missing,
never by training on silent defaults.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarmkit.contract.credit import CREDIT_MODES, CreditUnit
from swarmkit.contract.samples import TrainSample

if TYPE_CHECKING:  # pragma: no cover - torch is imported by the engines, not by the contract
    from torch import Tensor
else:
    Tensor = Any

#: how a (B, T) per-token loss is reduced to a scalar (see ``swarmkit_plugins.algo_rl.losses``)
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: which weights the reference policy holds: the initial ones, or the weights the warm start reached
REFERENCE_MODES: tuple[str, ...] = ("initial", "warm_start")
#: what happens to a response the generation limit cut (see ``swarmkit.training.overlong``)
OVERLONG_MODES: tuple[str, ...] = ("none", "filter", "penalty")


@dataclass
class LossInputs:
    """One packed micro-batch as the engine hands it to :meth:`Algorithm.loss`.

    Every tensor is (B, T): B rows (samples), T the longest trained span.
    ``mask`` is 1.0 on trained (generated) tokens. ``advantages`` is (B, T) or (B,).
    ``ref_logprobs`` is set when the algorithm ``needs_reference``; ``prox_logprobs``
    (the logprobs of the weights before this step, scored without gradient) when it
    ``needs_proximal``; ``values``, ``old_values`` and ``returns`` when it ``needs_values``.
    ``old_logprobs`` are the rollout's (the behaviour policy: with asynchronous training,
    possibly older weights). ``entropy`` is the entropy (nats) of the policy's next-token
    distribution at each trained token, with gradient (an entropy bonus may use it); the
    engines built on the training core always fill it.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    mask: Tensor
    ref_logprobs: Tensor | None = None
    prox_logprobs: Tensor | None = None
    values: Tensor | None = None
    old_values: Tensor | None = None
    returns: Tensor | None = None
    entropy: Tensor | None = None


class Algorithm(ABC):
    """An RL algorithm, as the trainer and the engines use it.

    Declared attributes (class attributes or set in ``__init__``):

    - ``needs_values``: the engine keeps a value head, scores old values in a
      pre-pass and calls :meth:`token_advantages`; otherwise the trainer calls
      :meth:`episode_advantages` once per batch.
    - ``needs_reference``: the engine keeps the frozen initial policy and fills
      ``LossInputs.ref_logprobs``.
    - ``needs_proximal``: the engine scores the batch with the weights before the
      step (a pre-pass) and fills ``LossInputs.prox_logprobs`` (decoupled PPO for
      off-policy samples).
    - ``ppo_epochs`` passes over each batch, each cut into ``mini_batches``
      optimizer steps.
    - ``loss_agg``: one of :data:`LOSS_AGG_MODES`; the engine weights
      micro-batches so that gradient accumulation equals one big batch.
    - ``reference``: one of :data:`REFERENCE_MODES` (read when ``needs_reference``):
      ``initial`` keeps the initial policy; ``warm_start`` moves the reference to the
      current weights at the first step after a run of demonstration-only steps.
    - ``overlong`` (one of :data:`OVERLONG_MODES`) and ``overlong_buffer`` (tokens):
      what the trainer does with responses the generation limit cut, before advantages
      (:mod:`swarmkit.training.overlong`).
    - ``credit``: one of :data:`~swarmkit.contract.credit.CREDIT_MODES`. ``"episode"``: one
      advantage per reward unit (:meth:`episode_advantages`), and the server refuses per-call
      rewards. ``"turn"``: the trainer calls :meth:`turn_advantages` with each unit's calls and
      their own rewards, and trains each generated token with the advantage answered for it.
    """

    name: str = ""
    needs_values: bool = False
    needs_reference: bool = False
    needs_proximal: bool = False
    ppo_epochs: int = 1
    mini_batches: int = 1
    loss_agg: str = "token-mean"
    reference: str = "initial"
    overlong: str = "none"
    overlong_buffer: int = 0
    credit: str = "episode"

    def episode_advantages(self, rewards: Sequence[float], groups: Sequence[str]) -> list[float]:
        """One advantage per reward unit (required unless ``needs_values``).

        :param rewards: (G,) one reward per (episode, role).
        :param groups: (G,) the group of each reward: the task id, or task id
            and role for per-role rewards; compare a reward only within its group.
        :returns: (G,) advantages; every generated token of the unit gets its value.
        """
        raise NotImplementedError

    def token_advantages(self, rewards: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Per-token ``(advantages, returns)``, both (B, T) (required when ``needs_values``).

        :param rewards: (B,) the sequence reward of each sample.
        :param values: (B, T) the value head's estimates at rollout (old values).
        :param mask: (B, T) 1.0 on generated tokens.
        """
        raise NotImplementedError

    def turn_advantages(self, units: Sequence[CreditUnit]) -> list[list[list[float]]]:
        """Per-token advantages of every call of every unit (required when ``credit == "turn"``).

        :param units: (U,) the batch's reward units, each with its calls in order
            (:class:`~swarmkit.contract.credit.CreditUnit`).
        :returns: (U, turns, tokens): for unit ``u`` and turn ``k``, ``units[u].turns[k].tokens``
            finite advantages, one per generated token of that call (the trainer checks it).
        """
        raise NotImplementedError

    def prepare_samples(self, samples: list[TrainSample]) -> dict[str, float]:
        """Relabel a step's samples before the engine trains them (optional; nothing by default).

        The trainer calls it once per step, in its own process, after the samples are built (rewards,
        advantages, merging) and the staleness bound has masked stale tokens, and before
        ``OptimEngine.train_step``. It may rewrite ``advantages`` (per token) in place, e.g. with a
        teacher's logprobs of the student's own tokens (on-policy distillation), and may do I/O.
        Its metrics join the step's. An exception fails the step (its episodes stay in the pool).

        :param samples: the step's samples (``demonstration`` ones included: leave them alone).
        :returns: scalar metrics of the relabelling.
        """
        return {}

    @abstractmethod
    def loss(self, inputs: LossInputs) -> tuple[Tensor, dict[str, float]]:
        """The 0-d loss of a micro-batch and its scalar metrics (computed without gradient)."""

    @classmethod
    def resolve_config(cls, config: dict[str, Any], *, trainer_mode: str) -> dict[str, Any]:
        """The ``algo`` group to build this algorithm from when the trainer runs in ``trainer_mode``
        (``trainer.mode``: ``"sync"`` or ``"async"``), for keys whose default depends on it.

        The trainer calls it once, before it builds the algorithm, and builds the algorithm (here
        and in every rank of a training group) from the group it returns. The default returns
        ``config`` unchanged.
        """
        return config


def _overrides(obj: Any, method: str) -> bool:
    return getattr(type(obj), method) is not getattr(Algorithm, method)


def check_algorithm(algo: Any) -> None:
    """Raise :class:`TypeError` naming every part of the contract ``algo`` misses."""
    name = f"algorithm {type(algo).__module__}.{type(algo).__qualname__}"
    if not isinstance(algo, Algorithm):
        raise TypeError(f"{name} must subclass swarmkit.contract.Algorithm")
    problems = []
    for attr in ("needs_values", "needs_reference", "needs_proximal"):
        if not isinstance(getattr(algo, attr), bool):
            problems.append(f"{attr} must be a bool, got {getattr(algo, attr)!r}")
    for attr in ("ppo_epochs", "mini_batches"):
        value = getattr(algo, attr)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append(f"{attr} must be an int >= 1, got {value!r}")
    if algo.loss_agg not in LOSS_AGG_MODES:
        problems.append(f"loss_agg must be one of {LOSS_AGG_MODES}, got {algo.loss_agg!r}")
    if algo.reference not in REFERENCE_MODES:
        problems.append(f"reference must be one of {REFERENCE_MODES}, got {algo.reference!r}")
    if algo.overlong not in OVERLONG_MODES:
        problems.append(f"overlong must be one of {OVERLONG_MODES}, got {algo.overlong!r}")
    buffer = algo.overlong_buffer
    if isinstance(buffer, bool) or not isinstance(buffer, int) or buffer < 0:
        problems.append(f"overlong_buffer must be an int >= 0, got {buffer!r}")
    if algo.credit not in CREDIT_MODES:
        problems.append(f"credit must be one of {CREDIT_MODES}, got {algo.credit!r}")
    elif algo.credit == "turn":
        if algo.needs_values:
            problems.append("credit 'turn' with needs_values is not supported (the value head's GAE labels tokens)")
        if not _overrides(algo, "turn_advantages"):
            problems.append("credit is 'turn' but turn_advantages(units) is not implemented")
    if algo.needs_values and not _overrides(algo, "token_advantages"):
        problems.append("needs_values is True but token_advantages(rewards, values, mask) is not implemented")
    if not algo.needs_values and algo.credit != "turn" and not _overrides(algo, "episode_advantages"):
        problems.append("episode_advantages(rewards, groups) is not implemented "
                        "(or set needs_values = True and implement token_advantages)")
    if problems:
        raise TypeError(f"{name} does not meet the algorithm contract: " + "; ".join(problems))
