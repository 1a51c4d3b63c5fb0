"""From accepted episodes to training samples: rewards, advantages, merged timelines.

:func:`build_samples` turns pool records into :class:`TrainSample` s:

1. Every (episode, role) gets a reward: the episode's reward when it is a
   number (all roles share it); ``reward[role]`` when it is a role → number
   dict. A timeline whose role is missing from the dict (or that has no role)
   falls back to the episode's scalar reward (:func:`swarmkit.contract.scalar_reward`,
   the mean over roles, as the pool's batching policies see it).
2. ``algo.episode_advantages`` runs once over the whole batch; groups are the
   task id for number rewards and (task id, role) for role rewards, so a role
   is compared with the same role of the other rollouts of its task. An
   algorithm that ``needs_values`` gets its token advantages in the engine
   (GAE over the value head), so none are assigned here. An algorithm with
   ``credit = "turn"`` instead labels every call of every unit with per-token
   advantages (``algo.turn_advantages``, from each call's own reward;
   :mod:`swarmkit.training.credit`), and every generated block of a merged
   sample gets the advantages of the call that generated it.
3. The episode's timelines are merged per role (a role's calls never absorb
   another role's) with the match strategy; every surviving timeline is one
   sample, and all its generated spans (loss mask 1) get the advantage of its
   (episode, role).
4. Generations the limit cut (``algo.overlong``, :mod:`swarmkit.training.overlong`):
   with ``filter`` the samples of a unit with a cut call are left out (its reward
   still counts in its group's advantages); with ``penalty`` the unit's reward gets
   DAPO's soft length penalty before advantages.
5. Demonstrated timelines (a supervised warm start) get no reward unit: they
   are merged apart from sampled ones, and every assistant token gets
   advantage 1 with its old logprob scored by the engine just before the step,
   so the policy-gradient loss (ratio 1) has the gradient of the plain token
   NLL. An algorithm that ``needs_values`` refuses them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from swarmkit.contract import Algorithm, MatchStrategy, TrainSample, scalar_reward
from swarmkit.pool.records import EpisodeRecord
from swarmkit.timelines import Block, Timeline, merge_timelines
from swarmkit.timelines.merging import MergeResult, drifted_blocks, merge
from swarmkit.training.credit import call_advantages, sample_advantages
from swarmkit.training.overlong import is_cut, unit_penalty

log = logging.getLogger(__name__)


def build_samples(records: Sequence[EpisodeRecord], algo: Algorithm,
                  match: str | MatchStrategy = "text", stats: dict[str, float] | None = None) -> list[TrainSample]:
    """Merged, advantage-labelled samples of ``records`` (see the module docstring).

    :param stats: filled with the merge of the sampled (not demonstrated) timelines:
        ``timelines``, ``groups`` (episode x role), ``absorbed`` (timelines merged into a
        longer one) and ``drifted_blocks`` (:func:`~swarmkit.timelines.merging.drifted_blocks`);
        and with the generations the limit cut: ``overlong_calls`` (sampled calls cut; only
        when there are some), ``overlong_filtered`` (samples left out, ``overlong=filter``),
        ``overlong_penalty`` and ``reward_units`` (the penalties' sum and the reward units,
        ``overlong=penalty``).

    :param records: the pool's records (``reward`` a float or role → float,
        ``timelines`` as ``Timeline.to_dict()`` dicts or Timelines, each with ``role``).
    :param algo: the algorithm; its ``episode_advantages`` labels the units
        unless it ``needs_values``.
    :param match: match strategy name (``"text"``, ``"token"``) or object.
    """
    # (record index, role or None) -> reward unit index
    units: dict[tuple[int, str | None], int] = {}
    unit_calls: list[list[Timeline]] = []  # the sampled calls of each reward unit
    rewards: list[float] = []
    groups: list[str] = []
    per_record: list[list[tuple[str | None, list[Timeline]]]] = []
    fallbacks = 0
    demos: list[tuple[int, str | None, list[Timeline]]] = []
    for r, rec in enumerate(records):
        timelines = [_rescored(Timeline.from_dict(t) if isinstance(t, Mapping) else t) for t in rec.timelines]
        by_role: dict[str | None, list[Timeline]] = {}
        demo_by_role: dict[str | None, list[Timeline]] = {}
        for t in timelines:
            (demo_by_role if is_demonstration(t) else by_role).setdefault(t.role, []).append(t)
        demos.extend((r, role, tls) for role, tls in demo_by_role.items())
        per_record.append(list(by_role.items()))
        reward = rec.reward
        for role in by_role:
            if isinstance(reward, Mapping) and role in reward:
                key: tuple[int, str | None] = (r, role)
                value, group = float(reward[role]), f"{rec.task_id}\x00role:{role}"
            else:
                if isinstance(reward, Mapping):
                    fallbacks += 1
                key, value, group = (r, None), scalar_reward(reward), str(rec.task_id)
            if key not in units:
                units[key] = len(rewards)
                rewards.append(value)
                groups.append(group)
                unit_calls.append([])
            unit_calls[units[key]].extend(by_role[role])
    if fallbacks:
        log.warning("%d timeline role(s) had no entry in their episode's role rewards; "
                    "used the episode's mean reward", fallbacks)
    cut_units = {u for u, calls in enumerate(unit_calls) if any(is_cut(t) for t in calls)}
    cut_calls = sum(is_cut(t) for calls in unit_calls for t in calls)
    if stats is not None and cut_calls:
        stats["overlong_calls"] = stats.get("overlong_calls", 0) + cut_calls
    if algo.overlong == "penalty":
        penalties = [unit_penalty(calls, algo.overlong_buffer) for calls in unit_calls]
        rewards = [r + p for r, p in zip(rewards, penalties, strict=True)]
        if stats is not None:
            stats["overlong_penalty"] = stats.get("overlong_penalty", 0.0) + sum(penalties)
            stats["reward_units"] = stats.get("reward_units", 0) + len(rewards)
    per_call: dict[int, list[float]] | None = None
    if algo.needs_values:
        # token advantages come from GAE over the value head inside the engine
        # (from each sample's ``reward``); none are assigned here
        advantages = [0.0] * len(rewards)
    elif algo.credit == "turn":
        # per-token advantages per call (swarmkit.training.credit); each generated block keeps its call's
        unit_episodes = [""] * len(rewards)
        for (r, _role), u in units.items():
            unit_episodes[u] = str(records[r].episode_id)
        per_call = call_advantages(algo, unit_calls, rewards, groups, unit_episodes)
        advantages = [0.0] * len(rewards)
    else:
        advantages = list(algo.episode_advantages(rewards, groups)) if rewards else []

    samples: list[TrainSample] = []
    for r, rec in enumerate(records):
        reward = rec.reward
        for role, timelines in per_record[r]:
            key = (r, role) if isinstance(reward, Mapping) and role in reward else (r, None)
            u = units[key]
            adv, value = float(advantages[u]), rewards[u]
            result = merge(timelines, match)
            if algo.overlong == "filter" and u in cut_units:
                if stats is not None:
                    stats["overlong_filtered"] = stats.get("overlong_filtered", 0) + sum(
                        any(m.loss_mask()) for m in result.timelines if isinstance(m, Timeline))
                    _merge_stats(stats, timelines, result)
                continue
            if stats is not None:
                _merge_stats(stats, timelines, result)
            token_adv = sample_advantages(timelines, result, per_call) if per_call is not None else None
            for n, merged in enumerate(result.timelines):
                assert isinstance(merged, Timeline)  # the merge answers in the form it was given
                ids, mask, lps = merged.token_ids(), merged.loss_mask(), merged.logprobs()
                if not any(mask):
                    continue
                row = token_adv[n] if token_adv is not None else [adv] * len(mask)
                samples.append(TrainSample(
                    input_ids=ids, loss_mask=mask, old_logprobs=lps,
                    advantages=[a if m else 0.0 for a, m in zip(row, mask, strict=True)],
                    episode_id=str(rec.episode_id),
                    task_id=str(rec.task_id), policy_version=int(rec.policy_version),
                    role=role, reward=value, versions=merged.versions(default=int(rec.policy_version))))
    if demos and algo.needs_values:
        raise ValueError("demonstrations (supervised warm start) need an algorithm without a value head "
                         f"(e.g. algo=grpo); {type(algo).__name__} needs values")
    for r, role, timelines in demos:
        rec = records[r]
        for merged in merge_timelines(timelines, match):
            assert isinstance(merged, Timeline)
            ids, mask = merged.token_ids(), merged.loss_mask()
            if not any(mask):
                continue
            # advantage 1 and old logprobs scored by the engine before the step (NaN): the
            # policy-gradient loss at ratio 1 has the gradient of the token NLL
            samples.append(TrainSample(
                input_ids=ids, loss_mask=mask, old_logprobs=[math.nan] * len(ids),
                advantages=[1.0 if m else 0.0 for m in mask], episode_id=str(rec.episode_id),
                task_id=str(rec.task_id), policy_version=int(rec.policy_version), role=role,
                reward=0.0, demonstration=True))
    return samples


def _merge_stats(stats: dict[str, float], timelines: Sequence[Timeline], result: MergeResult) -> None:
    """Add one (episode, role) merge to ``stats`` (see :func:`build_samples`)."""
    stats["timelines"] = stats.get("timelines", 0) + len(timelines)
    stats["groups"] = stats.get("groups", 0) + 1
    stats["absorbed"] = stats.get("absorbed", 0) + sum(a is not None for a in result.absorbed_into)
    stats["drifted_blocks"] = stats.get("drifted_blocks", 0) + drifted_blocks(timelines, result)


def _rescored(timeline: Timeline) -> Timeline:
    """A call under constrained decoding (``meta.structured``) with its generated logprobs
    unknown (NaN): the engine reports those of the grammar-masked distribution (vLLM's are 0.0
    where the grammar forces a token), which the policy's own are not; the engine scores them
    before the step (an on-policy ratio of 1 at the first update)."""
    if not timeline.meta.get("structured"):
        return timeline
    blocks = list(timeline.blocks)
    last = blocks[-1]
    if last.author == "llm":
        blocks[-1] = Block(last.author, last.text, last.token_ids, [math.nan] * len(last.token_ids), last.loss_mask,
                           last.versions)
    return Timeline(blocks, timeline.role, dict(timeline.meta))


def is_demonstration(timeline: Timeline) -> bool:
    """Whether a timeline came from ``POST /episodes/{id}/demonstration`` (trained supervised)."""
    return bool(timeline.meta.get("demonstration"))


def bound_staleness(samples: Sequence[TrainSample], current_version: int,
                    max_staleness: int | None = None) -> dict[str, float]:
    """Staleness of the generated tokens of ``samples``; with ``max_staleness`` also enforce it.

    A token's staleness is ``current_version - version``: how many optimizer steps older
    the weights that sampled it are than the weights being updated. With
    ``max_staleness`` set, every generated token staler than that is taken out of the
    loss (``loss_mask`` and advantage set to 0, in place) and counted; a sample left
    without a trained token trains nothing.

    Returns ``staleness_mean`` / ``staleness_max`` over the tokens kept,
    ``stale_tokens_dropped``, ``stale_samples`` (samples that lost tokens) and
    ``partial_rollouts`` (samples whose kept tokens come from more than one version).
    """
    total = kept = dropped = stale_samples = partial = 0
    worst = 0
    for s in samples:
        if s.demonstration:
            continue
        versions = s.token_versions()
        lost = False
        seen: set[int] = set()
        for t, m in enumerate(s.loss_mask):
            if not m:
                continue
            age = int(current_version) - versions[t]
            if max_staleness is not None and age > max_staleness:
                s.loss_mask[t] = 0
                s.advantages[t] = 0.0
                dropped += 1
                lost = True
                continue
            kept += 1
            total += age
            worst = max(worst, age)
            seen.add(versions[t])
        stale_samples += lost
        partial += len(seen) > 1
    return {"staleness_mean": total / kept if kept else 0.0, "staleness_max": float(worst),
            "stale_tokens_dropped": float(dropped), "stale_samples": float(stale_samples),
            "partial_rollouts": float(partial)}

