"""Collapse signals of a training step, and the alarm that watches them (issue 34).

A policy that collapses shows it in what it samples before its reward curve
says anything: every rollout of a group becomes the same answer, every group
scores the same (GRPO then has no signal at all: loss 0), the entropy of the
generated tokens drops towards zero, and a task's own validity checks (a
well-formed tool call, a parsable answer) fail. Each step the training cycle
computes these from the records it trains on with the pure functions below
and writes them with the step's metrics:

============================  ====================================================================
``collapse/identical_groups``  share of groups whose rollouts are all identical (:func:`group_signals`)
``collapse/flat_groups``       share of groups with no reward variance (:func:`group_signals`)
``collapse/groups``            groups of two or more rollouts the two shares count
``collapse/sampled_nll``       mean negative logprob of the sampled tokens (:func:`sampled_nll`)
``collapse/entropy``           the trainer's ``entropy`` when it reports one, else ``collapse/sampled_nll``
``collapse/warm_entropy``      the trainer's ``entropy`` on a step of demonstrations only (supervised warm start)
``task/<name>``                the step mean of a metric clients report in ``meta["metrics"]`` (:func:`task_metrics`)
============================  ====================================================================

A *group* is the rollouts of one task in one step (the unit GRPO normalises
over). Demonstrations (supervised warm start) are left out of every signal; a
step that trains on demonstrations alone reports ``collapse/warm_entropy``
instead, and the alarm lowers its entropy floor to ``entropy_warm_factor`` times
the last one (:func:`entropy_floor`): a warm-started format samples near
deterministically by design, which is not a collapse.
:class:`CollapseAlarm` (``trainer.collapse``) turns the signals into an alarm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmkit.config.schema import CollapseConfig
from swarmkit.pool.records import EpisodeRecord

#: metric names of the signals
IDENTICAL, FLAT, GROUPS = "collapse/identical_groups", "collapse/flat_groups", "collapse/groups"
ENTROPY, SAMPLED_NLL, WARM_ENTROPY = "collapse/entropy", "collapse/sampled_nll", "collapse/warm_entropy"
#: prefix of the task-declared metrics (``task/valid_tool_call``)
TASK_PREFIX = "task/"
#: what a signal past its threshold means to the person reading the alarm (a newcomer's first alarm
#: is often a reward that never varies, not a policy that fell)
MEANING = {
    FLAT: ("flat groups: every rollout of a task got the same reward, so GRPO has no signal and nothing is "
           "learned (loss 0); give partial credit that tells attempts apart, or warm-start the model "
           "(docs/training.md, \"Collapse alarm\")"),
    IDENTICAL: ("identical groups: the rollouts of a task are all the same answer, so they score alike and "
                "nothing more is learned (the policy collapsed); lower optim.lr, or add algo.kl_coef or "
                "algo.entropy_coef, or trainer.collapse.action=rollback"),
    ENTROPY: "low entropy: the policy samples almost deterministically",
}


def meanings(signals: set[str]) -> list[str]:
    """What the signals of an alarm mean, in :data:`MEANING`'s order; flat groups that identical rollouts
    explain are the collapse itself, not a reward that never varies."""
    shown = signals - {FLAT} if IDENTICAL in signals else signals
    return [text for name, text in MEANING.items() if name in shown]
#: two rewards closer than this count as equal (a group of them has "no variance")
REWARD_EPS = 1e-9


def _sampled(records: Iterable[EpisodeRecord]) -> list[EpisodeRecord]:
    """The records of sampled episodes (demonstrations left out)."""
    return [r for r in records if not r.meta.get("demonstration")]


def rollout_key(record: EpisodeRecord) -> tuple[tuple[str | None, tuple[tuple[int, ...], ...]], ...]:
    """What the model generated in one episode: per timeline (in order), its role and the token ids
    of each of its ``llm`` blocks. Two episodes with equal keys are identical rollouts (prompts and
    environment text are not compared: rollouts of one task share them)."""
    return tuple(
        (tl.get("role"), tuple(tuple(int(t) for t in b.get("token_ids") or ()) for b in tl.get("blocks", ())
                               if b.get("author") == "llm"))
        for tl in record.timelines
    )


def _reward_parts(reward: float | Mapping[str, float]) -> dict[str, float]:
    """A reward as role -> number (a number reward is the role "")."""
    if isinstance(reward, Mapping):
        return {str(k): float(v) for k, v in reward.items()}
    return {"": float(reward)}


def is_flat(rewards: Sequence[float | Mapping[str, float]]) -> bool:
    """No reward variance in a group: for every role (or the number reward), all rollouts scored the
    same (within :data:`REWARD_EPS`). A role only some rollouts have counts on those that have it."""
    by_role: dict[str, list[float]] = {}
    for reward in rewards:
        for role, value in _reward_parts(reward).items():
            by_role.setdefault(role, []).append(value)
    return all(max(v) - min(v) <= REWARD_EPS for v in by_role.values())


def group_signals(records: Iterable[EpisodeRecord]) -> dict[str, float]:
    """The group shares of one step's records (``EpisodeRecord`` s: ``task_id``, ``reward``,
    ``timelines`` in ``Timeline.to_dict()`` form).

    Groups are the records of one ``task_id``; only groups of two or more sampled episodes count (a
    lone rollout can be neither compared nor normalised). Returns ``collapse/identical_groups``
    (share of groups whose :func:`rollout_key` s are all equal), ``collapse/flat_groups`` (share
    of groups that :func:`is_flat`) and ``collapse/groups`` (how many groups counted); ``{}`` when
    no group has two rollouts.
    """
    groups: dict[str, list[EpisodeRecord]] = {}
    for r in _sampled(records):
        groups.setdefault(r.task_id, []).append(r)
    counted = [g for g in groups.values() if len(g) >= 2]
    if not counted:
        return {}
    identical = sum(1 for g in counted if len({rollout_key(r) for r in g}) == 1)
    flat = sum(1 for g in counted if is_flat([r.reward for r in g]))
    n = len(counted)
    return {IDENTICAL: identical / n, FLAT: flat / n, GROUPS: float(n)}


def sampled_nll(records: Iterable[EpisodeRecord]) -> float | None:
    """Mean negative logprob of the generated tokens (``llm`` blocks, loss mask 1) under the policy
    that sampled them (the logprobs the inference engine recorded): a Monte-Carlo estimate of the
    behaviour policy's entropy per token, in nats. Non-finite logprobs (not recorded) are skipped;
    None without any token."""
    total, n = 0.0, 0
    for r in _sampled(records):
        for tl in r.timelines:
            for b in tl.get("blocks", ()):
                if b.get("author") != "llm":
                    continue
                logprobs = b.get("logprobs") or ()
                mask = b.get("loss_mask")
                for i, lp in enumerate(logprobs):
                    if mask is not None and i < len(mask) and not mask[i]:
                        continue
                    if isinstance(lp, int | float) and math.isfinite(lp):
                        total -= float(lp)
                        n += 1
    return total / n if n else None


def task_metrics(records: Iterable[EpisodeRecord]) -> dict[str, float]:
    """``task/<name>``: the mean over the step's sampled episodes that report it of each number in
    their ``meta["metrics"]`` (what a client sends with ``ep.report(reward, meta={"metrics":
    {"valid_tool_call": 1.0}})``). Booleans count as 0 / 1; other values are ignored."""
    sums: dict[str, list[float]] = {}
    for r in _sampled(records):
        reported = r.meta.get("metrics")
        if not isinstance(reported, Mapping):
            continue
        for name, value in reported.items():
            if isinstance(value, bool):
                value = float(value)
            if isinstance(value, int | float) and math.isfinite(value):
                sums.setdefault(str(name), []).append(float(value))
    return {f"{TASK_PREFIX}{name}": sum(v) / len(v) for name, v in sorted(sums.items())}


def collapse_signals(records: Sequence[EpisodeRecord], step_metrics: Mapping[str, Any] | None = None) -> dict[str, float]:
    """Every signal of one step: :func:`group_signals`, ``collapse/sampled_nll``,
    ``collapse/entropy`` (``step_metrics["entropy"]``, the trainer's, when it is a finite number,
    else the sampled NLL) and :func:`task_metrics`. Signals that cannot be measured are absent.
    A step of demonstrations only gives the trainer's entropy as ``collapse/warm_entropy`` instead
    of ``collapse/entropy``: it is what supervised learning left, not what the policy samples."""
    out = group_signals(records)
    nll = sampled_nll(records)
    if nll is not None:
        out[SAMPLED_NLL] = nll
    entropy = (step_metrics or {}).get("entropy")
    measured = isinstance(entropy, int | float) and not isinstance(entropy, bool) and math.isfinite(entropy)
    demonstrations_only = bool(records) and not _sampled(records)
    if measured and demonstrations_only:
        out[WARM_ENTROPY] = float(entropy)
    elif measured:
        out[ENTROPY] = float(entropy)
    elif nll is not None:
        out[ENTROPY] = nll
    out.update(task_metrics(records))
    return out


# ---------------------------------------------------------------------- the alarm
@dataclass
class Crossing:
    """One signal past its threshold: since which step (of the current run of steps past it)."""

    signal: str
    value: float
    threshold: float
    #: "above" (the value must stay at most the threshold) or "below" (at least)
    side: str
    since: int
    steps: int

    def text(self) -> str:
        rel = ">" if self.side == "above" else "<"
        return (f"{self.signal} {self.value:.3f} {rel} {self.threshold:g} for {self.steps} step"
                f"{'s' if self.steps != 1 else ''}")


@dataclass
class Alarm:
    """A fired alarm: the step, the signals past their thresholds for ``patience`` steps, the first
    step of its window (the earliest step of those runs)."""

    step: int
    crossings: list[Crossing]
    window_start: int
    action: str
    message: str = ""
    fired_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "window_start": self.window_start, "action": self.action,
                "message": self.message, "fired_at": self.fired_at,
                "signals": {c.signal: {"value": c.value, "threshold": c.threshold, "side": c.side,
                                       "since": c.since, "steps": c.steps} for c in self.crossings},
                **self.extra}


def thresholds(cfg: CollapseConfig) -> dict[str, tuple[float, str]]:
    """signal -> (threshold, side) of ``cfg`` (``side`` "above": alarm when value > threshold)."""
    out = {IDENTICAL: (float(cfg.identical_groups_max), "above"), FLAT: (float(cfg.flat_groups_max), "above"),
           ENTROPY: (float(cfg.entropy_min), "below")}
    if cfg.validity_metric:
        out[TASK_PREFIX + cfg.validity_metric] = (float(cfg.validity_min), "below")
    return out


def entropy_floor(entropy_min: float, warm_factor: float, warm_entropy: float | None) -> float:
    """The entropy the alarm fires below: ``entropy_min``, lowered after a supervised warm start to
    ``warm_factor`` times the entropy (nats per token) its last demonstration step ended with, when that
    is lower. ``warm_factor`` 0 or no warm start: ``entropy_min``."""
    if warm_entropy is None or warm_factor <= 0 or not math.isfinite(warm_entropy):
        return entropy_min
    return min(entropy_min, warm_factor * warm_entropy)


def held_out_fall(earlier: tuple[float, float], later: tuple[float, float]) -> float | None:
    """How far the held-out reward fell from ``earlier`` to ``later`` (each ``(mean, 95% half-interval)``),
    when the fall is beyond the 95% interval of the difference, ``sqrt(ci_earlier² + ci_later²)`` (the two
    evaluations taken as independent: for the same items this errs on the side of silence); else None."""
    (m0, c0), (m1, c1) = earlier, later
    fall = m0 - m1
    return fall if fall > math.hypot(c0 or 0.0, c1 or 0.0) else None


def past(value: float, threshold: float, side: str) -> bool:
    """Whether ``value`` is past ``threshold`` on ``side``."""
    return value > threshold if side == "above" else value < threshold


class CollapseAlarm:
    """Counts, per signal, the steps in a row it is past its threshold (``trainer.collapse``).

    :meth:`observe` takes one step's signals and returns an :class:`Alarm` the step a signal's run
    reaches ``patience`` steps (once per run: the next one needs the signal back within its
    threshold first, or :meth:`reset`). A step that does not measure a signal (no group of two
    rollouts, no validity metric reported) leaves that signal's run as it is. ``active`` holds the
    last alarm while any signal of it is still past its threshold. A step's ``collapse/warm_entropy``
    sets :attr:`warm_entropy`, which lowers the entropy floor (:func:`entropy_floor`).
    """

    def __init__(self, cfg: CollapseConfig):
        self.cfg = cfg
        self.limits = thresholds(cfg)
        #: the entropy the supervised warm start ended with (its last demonstration step), None without one
        self.warm_entropy: float | None = None
        self.patience = max(1, int(cfg.patience))
        #: signal -> (first step of its current run past the threshold, steps in the run)
        self.runs: dict[str, tuple[int, int]] = {}
        self._fired: set[str] = set()
        self.active: Alarm | None = None
        self.fired = 0

    def set_warm_entropy(self, value: float | None) -> None:
        """Record the entropy a supervised warm start ended with (also from a checkpoint on resume) and
        move the entropy floor to :func:`entropy_floor` of it."""
        if value is not None and (not isinstance(value, int | float) or not math.isfinite(value)):
            return
        self.warm_entropy = None if value is None else float(value)
        floor = entropy_floor(float(self.cfg.entropy_min), float(self.cfg.entropy_warm_factor), self.warm_entropy)
        self.limits[ENTROPY] = (floor, "below")

    def reset(self) -> None:
        """Forget every run (after a rollback: the steps of the window are undone)."""
        self.runs.clear()
        self._fired.clear()
        self.active = None

    def crossings(self, step: int, signals: Mapping[str, float]) -> list[Crossing]:
        """The signals of ``signals`` that are past their thresholds at ``step``, with their runs
        (after :meth:`observe` of that step)."""
        out = []
        for name, (limit, side) in self.limits.items():
            run = self.runs.get(name)
            value = signals.get(name)
            if run is not None and isinstance(value, int | float):
                out.append(Crossing(name, float(value), limit, side, run[0], run[1]))
        return out

    def observe(self, step: int, signals: Mapping[str, float]) -> Alarm | None:
        """Count ``step``'s ``signals``; an :class:`Alarm` when one reaches ``patience`` steps."""
        if not self.cfg.enabled:
            return None
        if isinstance(signals.get(WARM_ENTROPY), int | float):
            self.set_warm_entropy(float(signals[WARM_ENTROPY]))
        for name, (limit, side) in self.limits.items():
            value = signals.get(name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                continue  # not measured this step: its run stays as it is
            if past(float(value), limit, side):
                since, n = self.runs.get(name, (step, 0))
                self.runs[name] = (since, n + 1)
            else:
                self.runs.pop(name, None)
                self._fired.discard(name)
        over = self.crossings(step, signals)
        if self.active is not None and not any(c.signal in self.runs for c in self.active.crossings):
            self.active = None  # every signal of the last alarm is back within its threshold
        ripe = [c for c in over if c.steps >= self.patience]
        fresh = [c for c in ripe if c.signal not in self._fired]
        if not fresh:
            return None
        self._fired.update(c.signal for c in ripe)
        self.fired += 1
        alarm = Alarm(step=step, crossings=ripe, window_start=min(c.since for c in ripe), action=self.cfg.action)
        alarm.message = (f"collapse alarm at step {step}: " + "; ".join(c.text() for c in ripe)
                         + f" (steps {alarm.window_start}..{step}; trainer.collapse.action={self.cfg.action})"
                         + "".join(f" - {m}" for m in meanings({c.signal for c in ripe})))
        floor = self.limits[ENTROPY][0]
        if any(c.signal == ENTROPY for c in ripe) and floor < float(self.cfg.entropy_min):
            alarm.message += (f" (entropy floor {floor:.3g} = trainer.collapse.entropy_warm_factor "
                              f"{self.cfg.entropy_warm_factor:g} x the warm start's {self.warm_entropy:.3g})")
        self.active = alarm
        return alarm
