"""From accepted episodes to optimizer steps: samples, advantages, the engine, checkpoints.

:func:`build_samples` turns pool records into :class:`TrainSample` s:

1. Every (episode, role) gets a reward: the episode's reward when it is a
   number (all roles share it); ``reward[role]`` when it is a role → number
   dict. A timeline whose role is missing from the dict (or that has no role)
   falls back to the episode's scalar reward (mean over roles, as the pool's
   batching policies see it).
2. ``algo.episode_advantages`` runs once over the whole batch; groups are the
   task id for number rewards and (task id, role) for role rewards, so a role
   is compared with the same role of the other rollouts of its task.
3. The episode's timelines are merged per role (a role's calls never absorb
   another role's) with the match strategy; every surviving timeline is one
   sample, and all its generated spans (loss mask 1) get the advantage of its
   (episode, role).

:class:`Trainer` is what the server drives in ``WEIGHT_SYNCING``::

    metrics = trainer.step(records)
    await backend.update_weights(named_tensors=trainer.export_weights(), version=trainer.global_step)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"


@dataclass
class TrainSample:
    """One training sequence; all lists are token-aligned, length T.

    ``old_logprobs[t]`` is log p(input_ids[t] | input_ids[:t]) recorded at
    rollout time (only meaningful where ``loss_mask[t] == 1``);
    ``advantages[t]`` is the sample's advantage on generated tokens, 0 elsewhere.
    ``reward`` is the (episode, role) reward (PPO puts it on the last generated token).
    """

    input_ids: list[int]
    loss_mask: list[int]
    old_logprobs: list[float]
    advantages: list[float]
    episode_id: str = ""
    task_id: str = ""
    policy_version: int = 0
    role: str | None = None
    reward: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSample:
        return cls(**dict(d))


def _scalar(reward: float | Mapping[str, float]) -> float:
    if isinstance(reward, Mapping):
        return float(sum(reward.values()) / len(reward)) if reward else 0.0
    return float(reward)


def build_samples(records: Sequence[Any], algo: Any, match: Any = "text") -> list[TrainSample]:
    """Merged, advantage-labelled samples of ``records`` (see the module docstring).

    :param records: objects with ``episode_id``, ``task_id``, ``reward`` (float
        or role → float), ``timelines`` (``Timeline.to_dict()`` dicts, each with
        ``role``) and ``policy_version``.
    :param algo: has ``episode_advantages(rewards, task_ids) -> list[float]``.
    :param match: match strategy name (``"text"``, ``"token"``) or object.
    """
    from swarmkit.timeline import Timeline, merge_timelines

    # (record index, role or None) -> reward unit index
    units: dict[tuple[int, str | None], int] = {}
    rewards: list[float] = []
    groups: list[str] = []
    per_record: list[list[tuple[str | None, list[Timeline]]]] = []
    fallbacks = 0
    for r, rec in enumerate(records):
        timelines = [Timeline.from_dict(t) if isinstance(t, Mapping) else t for t in rec.timelines]
        by_role: dict[str | None, list[Timeline]] = {}
        for t in timelines:
            by_role.setdefault(t.role, []).append(t)
        per_record.append(list(by_role.items()))
        reward = rec.reward
        for role in by_role:
            if isinstance(reward, Mapping) and role in reward:
                key: tuple[int, str | None] = (r, role)
                value, group = float(reward[role]), f"{rec.task_id}\x00role:{role}"
            else:
                if isinstance(reward, Mapping):
                    fallbacks += 1
                key, value, group = (r, None), _scalar(reward), str(rec.task_id)
            if key not in units:
                units[key] = len(rewards)
                rewards.append(value)
                groups.append(group)
    if fallbacks:
        log.warning("%d timeline role(s) had no entry in their episode's role rewards; "
                    "used the episode's mean reward", fallbacks)
    if getattr(algo, "needs_values", False) or not hasattr(algo, "episode_advantages"):
        # PPO-style: token advantages come from GAE over the value head inside the
        # engine (from each sample's ``reward``); none are assigned here
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
            for t in merge_timelines(timelines, match):
                ids, mask, lps = t.token_ids(), t.loss_mask(), t.logprobs()
                if not any(mask):
                    continue
                samples.append(TrainSample(
                    input_ids=ids, loss_mask=mask, old_logprobs=lps,
                    advantages=[adv if m else 0.0 for m in mask], episode_id=str(rec.episode_id),
                    task_id=str(rec.task_id), policy_version=int(getattr(rec, "policy_version", 0) or 0),
                    role=role, reward=value))
    return samples


def _plain(cfg: Any) -> dict[str, Any]:
    """A plain dict from a dict, dataclass or OmegaConf config."""
    if cfg is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            return dict(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]
    except ImportError:  # pragma: no cover
        pass
    if hasattr(cfg, "__dataclass_fields__"):
        return asdict(cfg)
    return dict(cfg)


def build_algo(algo_cfg: Mapping[str, Any]) -> Any:
    """The algorithm object of the ``algo`` group (``name`` picks the plugin, default grpo)."""
    from swarmkit.plugins import load_component

    cfg = _plain(algo_cfg)
    cls = load_component("algo", cfg.get("name", "grpo"))
    return cls(**cfg)


class Trainer:
    """Samples → optimizer engine → weights, plus checkpoints in ``run_dir/checkpoints``.

    :param model_cfg: the ``model`` group (``path``, ``lora_rank``, …).
    :param optim_cfg: the ``optim`` group (``name`` = ``fsdp`` | ``deepspeed``, ``lr``, …).
    :param algo_cfg: the ``algo`` group (``name`` = ``grpo`` | ``ppo``, …).
    :param match: match strategy for timeline merging.
    :param run_dir: folder for checkpoints (``None``: only explicit paths work).
    """

    def __init__(self, model_cfg: Any, optim_cfg: Any, algo_cfg: Any, match: Any = "text",
                 run_dir: str | os.PathLike[str] | None = None, seed: int | None = None):
        from swarmkit.models import resolve_model_path
        from swarmkit.plugins import load_component

        self.model_cfg = _plain(model_cfg)
        self.optim_cfg = _plain(optim_cfg)
        if seed is not None and self.optim_cfg.get("seed") is None:
            self.optim_cfg["seed"] = int(seed)
        self.algo_cfg = _plain(algo_cfg)
        self.match = match if not isinstance(match, Mapping) else match.get("name", "text")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.algo = build_algo(self.algo_cfg)
        self.model_path = resolve_model_path(str(self.model_cfg.get("path", "builtin:tiny")))
        name = str(self.optim_cfg.get("name", "fsdp"))
        nprocs = int(self.optim_cfg.get("nprocs", 1) or 1)
        if nprocs > 1 and "WORLD_SIZE" not in os.environ:
            # the engine trains in a torchrun group of its own; this process drives it
            from swarmkit_plugins.optim_fsdp.group import ProcessGroupEngine

            log_path = None
            if self.run_dir is not None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                log_path = self.run_dir / "train_group.log"
            self.engine = ProcessGroupEngine(name, nprocs, str(self.model_path), self.model_cfg, self.optim_cfg,
                                             self.algo_cfg, log_path=log_path)
        else:
            engine_cls = load_component("optim", name)
            self.engine = engine_cls(model_path=str(self.model_path), model_cfg=self.model_cfg,
                                     optim_cfg=self.optim_cfg, algo=self.algo)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (= the policy version of the current weights)."""
        return int(self.engine.optimizer_steps)

    @property
    def train_steps(self) -> int:
        """:meth:`step` calls that updated the model (= global_step with 1 epoch × 1 mini-batch)."""
        return int(self.engine.train_steps)

    def step(self, records: Sequence[Any]) -> dict[str, float]:
        """Build samples from ``records`` and train on them; returns metrics.

        Metrics: the engine's (``loss``, ``trained_tokens``, ``tokens``,
        ``grad_norm``, ``lr``, …) plus ``reward_mean``, ``episodes``,
        ``timelines``, ``samples``, ``merge_ratio`` (timelines per sample),
        ``build_time_s``, ``step_time_s`` (whole call) and ``global_step``.
        """
        t0 = time.perf_counter()
        samples = build_samples(records, self.algo, self.match)
        t1 = time.perf_counter()
        metrics = dict(self.engine.train_step(samples))
        n_timelines = sum(len(r.timelines) for r in records)
        metrics.update(
            reward_mean=(sum(_scalar(r.reward) for r in records) / len(records)) if records else 0.0,
            episodes=float(len(records)),
            timelines=float(n_timelines),
            samples=float(len(samples)),
            merge_ratio=(n_timelines / len(samples)) if samples else 0.0,
            build_time_s=t1 - t0,
            train_time_s=float(metrics.get("step_time_s", 0.0)),
            step_time_s=time.perf_counter() - t0,
            global_step=float(self.global_step),
        )
        return metrics

    def close(self) -> None:
        """Free the engine (stops its training group when ``optim.nprocs > 1``)."""
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()

    def export_weights(self) -> Iterable[tuple[str, Any]]:
        """Full HF-named weights (LoRA merged) for ``backend.update_weights(named_tensors=...)``."""
        return self.engine.export_weights()

    def export_adapter(self, path: str | os.PathLike[str]) -> None:
        """The LoRA adapter as a peft folder (``backend.update_weights(path=...)``)."""
        self.engine.export_adapter(path)

    # ------------------------------------------------------------------ checkpoints
    def _ckpt_root(self) -> Path:
        if self.run_dir is None:
            raise ValueError("Trainer has no run_dir; pass an explicit checkpoint path")
        return self.run_dir / CHECKPOINT_DIR

    def save_checkpoint(self, path: str | os.PathLike[str] | None = None,
                        extra: Mapping[str, Any] | None = None) -> Path:
        """Save engine state + trainer state (+ ``extra``, e.g. the pool position); returns the folder.

        Default folder ``run_dir/checkpoints/step_{global_step:08d}``. Written to a
        temporary folder and renamed, then ``checkpoints/latest`` is updated, so a
        crash mid-save leaves the previous checkpoint current.
        """
        final = Path(path) if path is not None else self._ckpt_root() / f"step_{self.global_step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.engine.save_checkpoint(str(tmp))
        state = {"global_step": self.global_step, "train_steps": self.train_steps,
                 "extra": dict(extra or {}), "saved_at": time.time(),
                 "model_path": str(self.model_path), "optim": self.optim_cfg.get("name", "fsdp")}
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        root = final.parent
        (root / (LATEST + ".tmp")).write_text(final.name)
        os.replace(root / (LATEST + ".tmp"), root / LATEST)
        return final

    def latest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint under ``run_dir/checkpoints``, or None."""
        root = self._ckpt_root()
        marker = root / LATEST
        if marker.exists():
            p = root / marker.read_text().strip()
            if (p / "trainer_state.json").exists():
                return p
        done = sorted(p for p in root.glob("step_*") if (p / "trainer_state.json").exists()) if root.exists() else []
        return done[-1] if done else None

    def load_checkpoint(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Restore from ``path`` (default: the latest checkpoint); returns the saved ``extra``."""
        p = Path(path) if path is not None else self.latest_checkpoint()
        if p is None:
            raise FileNotFoundError(f"no checkpoint under {self._ckpt_root()}")
        self.engine.load_checkpoint(str(p))
        state = json.loads((p / "trainer_state.json").read_text())
        return dict(state.get("extra") or {})
