"""Responses the generation limit cut: leave them out of the loss, or shape their reward by length.

A recorded call (one timeline) ends with the completion block of the tokens the
model generated. Its meta holds ``finish_reason`` (``length`` when generation
stopped at the limit: the request's ``max_tokens``, clipped to the context left)
and, for calls through the chat, messages and responses endpoints, that limit as
``max_tokens``. A reward for a cut answer says little about the answer (it was
not finished), so the algorithm's ``overlong`` option (``algo.overlong``) picks
what training does with it, per reward unit (an episode, or an episode's role
with per-role rewards), before advantages are computed:

- ``none``: nothing (the cut calls are still counted in the step metrics).
- ``filter``: every sample of a unit with a cut call is left out of the loss.
  The unit's reward still counts in its group's baseline.
- ``penalty``: DAPO's soft length penalty is added to the unit's reward: 0 while
  a call stays ``overlong_buffer`` tokens or more below its limit, then falling
  linearly to -1 at the limit (:func:`length_penalty`); the unit takes the
  penalty of its worst call, so it stays in [-1, 0]. A call without a recorded
  limit (``/v1/completions``, journals older than the field) gets -1 when it was
  cut and 0 otherwise.

Everything here is a pure function of the recorded timelines.
"""

from __future__ import annotations

from collections.abc import Iterable

from swarmkit.timelines import Timeline

#: the ``finish_reason`` of a generation the limit cut
CUT = "length"


def length_penalty(length: int, limit: int, buffer: int) -> float:
    """DAPO's soft overlong penalty of one generation of ``length`` tokens under a ``limit``, in [-1, 0].

    With ``start = max(0, limit - buffer)``: 0 up to ``start`` tokens, then
    ``-(length - start) / (limit - start)`` (linear), and -1 from ``limit`` on. ``buffer`` 0
    penalises only a generation that reached the limit.
    """
    if limit <= 0:
        raise ValueError(f"the generation limit must be > 0, got {limit}")
    if buffer < 0:
        raise ValueError(f"the overlong buffer must be >= 0, got {buffer}")
    if length >= limit:
        return -1.0
    start = max(0, limit - buffer)
    if length <= start:
        return 0.0
    return -(length - start) / (limit - start)


def generated_length(timeline: Timeline) -> int:
    """Tokens the model generated in this call: the trained tokens of its last (completion) block
    (tokens the server prefilled, e.g. a forced tool-call opening, are not counted)."""
    if not timeline.blocks:
        return 0
    last = timeline.blocks[-1]
    return sum(last.loss_mask or ()) if last.author == "llm" else 0


def is_cut(timeline: Timeline) -> bool:
    """Whether the call's generation stopped at its limit (``finish_reason == "length"``)."""
    return timeline.meta.get("finish_reason") == CUT


def call_limit(timeline: Timeline) -> int | None:
    """The call's recorded generation limit (``meta["max_tokens"]``), or None."""
    limit = timeline.meta.get("max_tokens")
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def call_penalty(timeline: Timeline, buffer: int) -> float:
    """The soft overlong penalty of one recorded call, in [-1, 0] (see the module docstring)."""
    limit = call_limit(timeline)
    if is_cut(timeline):
        return -1.0
    if limit is None:
        return 0.0
    return length_penalty(generated_length(timeline), limit, buffer)


def unit_penalty(timelines: Iterable[Timeline], buffer: int) -> float:
    """The penalty of a reward unit: its worst call's (0 without calls)."""
    return min((call_penalty(t, buffer) for t in timelines), default=0.0)


def overlong_metrics(mode: str, stats: dict[str, float]) -> dict[str, float]:
    """Step metrics from :func:`~swarmkit.training.samples.build_samples`'s ``stats``: ``overlong_calls``
    (sampled calls the limit cut) always; ``overlong_filtered`` (samples left out) with ``filter``;
    ``overlong_penalty_mean`` (mean penalty over reward units) with ``penalty``."""
    out = {"overlong_calls": float(stats.get("overlong_calls", 0))}
    if mode == "filter":
        out["overlong_filtered"] = float(stats.get("overlong_filtered", 0))
    elif mode == "penalty":
        units = stats.get("reward_units", 0)
        out["overlong_penalty_mean"] = float(stats.get("overlong_penalty", 0.0)) / units if units else 0.0
    return out
