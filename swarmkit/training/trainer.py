"""The trainer the server drives in ``WEIGHT_SYNCING``: samples → optimizer engine → weights.

::

    metrics = trainer.step(records)
    await backend.update_weights(named_tensors=trainer.export_weights(), version=trainer.global_step)

Checkpoints live in ``run_dir/checkpoints/step_{global_step:08d}`` with a
``latest`` marker. With ``optim.nprocs > 1`` (or ``optim.nnodes > 1``) the engine trains in a torchrun
group of its own (:mod:`swarmkit.training.group`) that this process drives.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from swarmkit.config.plain import as_dict
from swarmkit.config.schema import AdapterSpec, ModelConfig, TrainerConfig
from swarmkit.contract import Algorithm, OptimEngine, check_algorithm, scalar_reward
from swarmkit.models import resolve_model_path
from swarmkit.plugins import get_registry, load_component
from swarmkit.pool.advantages import append_advantages
from swarmkit.pool.records import EpisodeRecord
from swarmkit.runfiles import staged_dir, write_text
from swarmkit.training.config import EngineConfig, GroupLaunch, launch_config
from swarmkit.training.overlong import overlong_metrics
from swarmkit.training.samples import bound_staleness, build_samples

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"


def checkpoint_path(run_dir: str | os.PathLike[str], step: int) -> Path:
    """The one name of step ``step``'s checkpoint folder: ``run_dir/checkpoints/step_{step:08d}``."""
    return Path(run_dir) / CHECKPOINT_DIR / f"step_{int(step):08d}"


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete ``step_*`` folders under ``root`` (0: none); the
    folder ``root/latest`` names is never deleted. Returns the deleted folders."""
    if keep <= 0 or not root.exists():
        return []
    steps = sorted(p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
    marker = root / LATEST
    latest = marker.read_text().strip() if marker.exists() else None
    gone = [p for p in steps[:-keep] if p.name != latest]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone


def resolve_algo_config(algo_cfg: Any, trainer_mode: str) -> dict[str, Any]:
    """The ``algo`` group as its algorithm resolves it for ``trainer.mode`` ``trainer_mode``
    (:meth:`swarmkit.contract.Algorithm.resolve_config`: e.g. ``grpo``'s ``decoupled: null``)."""
    cfg = as_dict(algo_cfg)
    if not cfg.get("name"):
        raise ValueError("the algo group needs a name (e.g. grpo, ppo)")
    cls = load_component("algo", str(cfg["name"]))
    resolve = getattr(cls, "resolve_config", None)  # None: not an Algorithm, which build_algo reports
    return dict(resolve(cfg, trainer_mode=trainer_mode)) if resolve is not None else cfg


def build_algo(algo_cfg: Any) -> Algorithm:
    """The checked algorithm of the ``algo`` group (``name`` picks the plugin).

    :raises TypeError: the algorithm misses part of :class:`swarmkit.contract.Algorithm`.
    """
    cfg = as_dict(algo_cfg)
    if not cfg.get("name"):
        raise ValueError("the algo group needs a name (e.g. grpo, ppo)")
    algo = load_component("algo", str(cfg["name"]))(**cfg)
    check_algorithm(algo)
    assert isinstance(algo, Algorithm)  # for the type checker: check_algorithm raised otherwise
    return algo


def optim_launch(optim_cfg: Mapping[str, Any]) -> tuple[str, GroupLaunch | None]:
    """``(engine name, launch)`` of the ``optim`` group: ``launch`` holds the group's launch keys,
    read through the engine's schema when it is an :class:`~swarmkit.training.config.EngineConfig`;
    ``None`` for other engines (they train in-process)."""
    name = str(optim_cfg.get("name") or "")
    if not name:
        raise ValueError("the optim group needs a name (e.g. fsdp, deepspeed)")
    schema = get_registry().get("optim", name).schema
    if schema is not None and issubclass(schema, EngineConfig):
        return name, launch_config(schema(**optim_cfg))
    return name, None


class Trainer:
    """Samples → optimizer engine → weights, plus checkpoints in ``run_dir/checkpoints``.

    :param model_cfg: the ``model`` group (``path``, ``lora_rank``, …).
    :param optim_cfg: the ``optim`` group (``name`` = ``fsdp`` | ``deepspeed``, ``lr``, …).
    :param algo_cfg: the ``algo`` group (``name`` = ``grpo`` | ``ppo``, …).
    :param match: match strategy for timeline merging (a name, a ``{"name": ...}`` group, or an object).
    :param run_dir: folder for checkpoints (``None``: only explicit paths work).
    :param seed: the run's seed; the engine's when ``optim.seed`` is not set.
    :param trainer_mode: ``trainer.mode`` of the run (``"sync"`` or ``"async"``); the algorithm
        resolves the ``algo`` keys that depend on it (:func:`resolve_algo_config`).
    """

    def __init__(self, model_cfg: Any, optim_cfg: Any, algo_cfg: Any, match: Any = "text",
                 run_dir: str | os.PathLike[str] | None = None, seed: int | None = None,
                 trainer_mode: str = TrainerConfig.mode):
        self.model_cfg = as_dict(model_cfg)
        self.optim_cfg = as_dict(optim_cfg)
        if seed is not None and self.optim_cfg.get("seed") is None:
            self.optim_cfg["seed"] = int(seed)
        #: the ``algo`` group as the algorithm resolved it for ``trainer_mode`` (what every rank builds)
        self.algo_cfg = resolve_algo_config(algo_cfg, trainer_mode)
        self.match = match.get("name", "text") if isinstance(match, Mapping) else match
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.algo = build_algo(self.algo_cfg)
        #: the typed ``model`` group (the engines get ``model_cfg``, the plain one)
        self.model = ModelConfig.of(self.model_cfg)
        self.model_path = resolve_model_path(self.model.path)
        #: the LoRA adapters trained over one base (model.adapters); [] = one model
        self.adapters = [s.name for s in self.model.adapter_specs()]
        #: the adapter the last step trained (its weights are the ones to push)
        self.last_adapter: str | None = None
        name, launch = optim_launch(self.optim_cfg)
        self.engine: OptimEngine
        if launch is not None and launch.grouped and "WORLD_SIZE" not in os.environ:
            # the engine trains in a torchrun group of its own (on several hosts with nnodes > 1); this
            # process drives it
            from swarmkit.training.group import ProcessGroupEngine

            log_path = None
            if self.run_dir is not None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                log_path = self.run_dir / "train_group.log"
            self.engine = ProcessGroupEngine(name, launch.nprocs, str(self.model_path), self.model_cfg, self.optim_cfg,
                                             self.algo_cfg, log_path=log_path)
        else:
            engine_cls = load_component("optim", name)
            self.engine = engine_cls(model_path=str(self.model_path), model_cfg=self.model_cfg,
                                     optim_cfg=self.optim_cfg, algo=self.algo)

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (= the policy version of the current weights); with ``model.adapters``
        the sum over the adapters (the run's step counter; each adapter's own is :meth:`adapter_step`)."""
        if self.adapters:
            return sum(self._adapter_engine().adapter_steps().values())
        return int(self.engine.optimizer_steps)

    @property
    def train_steps(self) -> int:
        """:meth:`step` calls that updated the model (= global_step with 1 epoch × 1 mini-batch)."""
        if self.adapters:
            return sum(self._adapter_engine().adapters.train_steps().values())
        return int(self.engine.train_steps)

    # ------------------------------------------------------------------ several adapters
    def _adapter_engine(self) -> Any:
        """The engine, which must train ``model.adapters`` (the fsdp engine in one process)."""
        if not callable(getattr(self.engine, "select_adapter", None)) or getattr(self.engine, "adapters", None) is None:
            raise ValueError(f"model.adapters needs an engine that trains several adapters (optim=fsdp in one "
                             f"process), not {type(self.engine).__name__}")
        return self.engine

    def adapter_step(self, name: str) -> int:
        """Adapter ``name``'s optimizer steps: its policy version."""
        return int(self._adapter_engine().adapter_steps()[name])

    def add_adapter(self, spec: AdapterSpec) -> None:
        """Train adapter ``spec`` too, from now on (a server's ``POST /api/v1/admin/adapters``): fresh,
        at step 0, initialised as if ``model.adapters`` had listed it last from the start."""
        self._adapter_engine().add_adapter(spec)
        self.adapters.append(spec.name)

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (the undo of :meth:`add_adapter` when serving it failed)."""
        self._adapter_engine().remove_adapter(name)
        self.adapters.remove(name)

    def export_adapter_lora(self, name: str) -> list[tuple[str, Any, Any, float]]:
        """Adapter ``name`` as ``(module, A, B, scale)`` for ``backend.update_adapter``."""
        return [(t.module, t.a, t.b, t.scale) for t in self._adapter_engine().export_lora(name)]

    def _batch_adapter(self, records: Sequence[EpisodeRecord]) -> str:
        """The one adapter of a batch (samples never mix across adapters): ValueError otherwise."""
        found = sorted({r.adapter for r in records})
        if len(found) != 1 or found[0] not in self.adapters:
            raise ValueError(f"a batch must hold the episodes of one adapter of {self.adapters}; it holds {found}")
        return found[0]

    def step(self, records: Sequence[EpisodeRecord], max_staleness: int | None = None) -> dict[str, float]:
        """Build samples from ``records`` and train on them; returns metrics.

        ``max_staleness`` (asynchronous training): generated tokens sampled more than that
        many versions before the current weights are left out of the loss
        (:func:`~swarmkit.training.samples.bound_staleness`; counted in the metrics).

        Metrics: the engine's (``loss``, ``trained_tokens``, ``tokens``,
        ``grad_norm``, ``lr``, …) plus ``reward_mean``, ``episodes``,
        ``timelines``, ``samples``, ``merge_ratio`` (timelines per sample), ``merge_rate``
        (of the sampled timelines that could merge into a longer call of their episode and role,
        the share that did: 1.0 = one sample per episode and role), ``drifted_blocks`` (generated
        blocks merged over history of equal text but other tokens: what the ``text`` match traded),
        ``demonstrations`` / ``demo_samples`` (supervised; not in ``reward_mean``), the staleness
        of the trained tokens (``staleness_mean``, ``staleness_max``, ``stale_tokens_dropped``,
        ``partial_rollouts``), the generations the limit cut (``overlong_calls``; with
        ``algo.overlong`` also ``overlong_filtered`` or ``overlong_penalty_mean``),
        the algorithm's relabelling metrics (:meth:`~swarmkit.contract.Algorithm.prepare_samples`),
        ``build_time_s``, ``step_time_s`` (whole call) and ``global_step``.
        """
        t0 = time.perf_counter()
        adapter = None
        if self.adapters:
            adapter = self._batch_adapter(records)
            self._adapter_engine().select_adapter(adapter)
            self.last_adapter = adapter
        merge_stats: dict[str, float] = {}
        samples = build_samples(records, self.algo, self.match, stats=merge_stats)
        # a token's version is its adapter's version (each adapter counts its own steps), else the model's
        current = self.adapter_step(adapter) if adapter is not None else self.global_step
        staleness = bound_staleness(samples, current, max_staleness)
        relabel = dict(self.algo.prepare_samples(samples))  # e.g. a teacher's per-token advantages
        if self.run_dir is not None:  # for the trajectory viewer: the advantages the tokens are trained with
            append_advantages(self.run_dir, self.train_steps + 1, samples)
        t1 = time.perf_counter()
        mergeable = merge_stats.get("timelines", 0) - merge_stats.get("groups", 0)
        metrics = dict(self.engine.train_step(samples))
        metrics.update(staleness)
        metrics.update(relabel)
        n_timelines = sum(len(r.timelines) for r in records)
        sampled = [r for r in records if not r.meta.get("demonstration")]
        metrics.update(
            reward_mean=(sum(scalar_reward(r.reward) for r in sampled) / len(sampled)) if sampled else 0.0,
            episodes=float(len(records)),
            demonstrations=float(len(records) - len(sampled)),
            demo_samples=float(sum(s.demonstration for s in samples)),
            timelines=float(n_timelines),
            samples=float(len(samples)),
            merge_ratio=(n_timelines / len(samples)) if samples else 0.0,
            merge_rate=(merge_stats.get("absorbed", 0) / mergeable) if mergeable > 0 else 1.0,
            drifted_blocks=float(merge_stats.get("drifted_blocks", 0)),
            build_time_s=t1 - t0,
            train_time_s=float(metrics.get("step_time_s", 0.0)),
            step_time_s=time.perf_counter() - t0,
            global_step=float(self.global_step),
        )
        metrics.update(overlong_metrics(self.algo.overlong, merge_stats))
        if adapter is not None:  # which adapter this step trained, and where it stands
            metrics[f"adapter/{adapter}/reward_mean"] = metrics["reward_mean"]
            metrics[f"adapter/{adapter}/step"] = float(self.adapter_step(adapter))
            metrics["adapter_index"] = float(self.adapters.index(adapter))
        return metrics

    def close(self) -> None:
        """Free the engine (stops its training group when ``optim.nprocs > 1``)."""
        self.engine.close()

    def export_weights(self) -> Iterable[tuple[str, Any]]:
        """Full HF-named weights (LoRA merged) for ``backend.update_weights(named_tensors=...)``."""
        return self.engine.export_weights()

    # ------------------------------------------------------------------ checkpoints
    def _require_run_dir(self) -> Path:
        if self.run_dir is None:
            raise ValueError("Trainer has no run_dir; pass an explicit checkpoint path")
        return self.run_dir

    def _ckpt_root(self) -> Path:
        return self._require_run_dir() / CHECKPOINT_DIR

    def save_checkpoint(self, path: str | os.PathLike[str] | None = None,
                        extra: Mapping[str, Any] | None = None) -> Path:
        """Save engine state + trainer state (+ ``extra``, e.g. the pool position); returns the folder.

        Default folder ``run_dir/checkpoints/step_{global_step:08d}``. Written to a
        temporary folder and renamed, then ``checkpoints/latest`` is updated, so a
        crash mid-save leaves the previous checkpoint current.
        """
        final = Path(path) if path is not None else checkpoint_path(self._require_run_dir(), self.global_step)
        with staged_dir(final, replace=True) as tmp:
            self.engine.save_checkpoint(str(tmp))
            state = {"global_step": self.global_step, "train_steps": self.train_steps,
                     "extra": dict(extra or {}), "saved_at": time.time(),
                     "model_path": str(self.model_path), "optim": self.optim_cfg["name"]}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1, default=str))
        write_text(final.parent / LATEST, final.name)
        return final

    def prune_checkpoints(self, keep: int) -> list[Path]:
        """Delete all but the newest ``keep`` step checkpoints (0: keep all); the one ``latest``
        names is always kept. Returns the deleted folders."""
        return prune_checkpoints(self._ckpt_root(), keep)

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

    def checkpoints(self) -> list[tuple[int, Path]]:
        """``(step, folder)`` of every complete step checkpoint under ``run_dir/checkpoints``, oldest first."""
        root = self._ckpt_root()
        out = []
        for p in root.glob("step_*") if root.exists() else ():
            if p.is_dir() and (p / "trainer_state.json").exists() and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p))
        return sorted(out)

    def discard_checkpoints_after(self, step: int) -> list[Path]:
        """Delete the step checkpoints taken after ``step`` and point ``checkpoints/latest`` at the
        newest one left (a rollback to ``step`` abandons them: a resume must not find them). Returns
        the deleted folders."""
        gone = [p for s, p in self.checkpoints() if s > step]
        kept = [p for s, p in self.checkpoints() if s <= step]
        if kept:
            write_text(self._ckpt_root() / LATEST, kept[-1].name)
        for p in gone:
            shutil.rmtree(p, ignore_errors=True)
        if not kept:
            (self._ckpt_root() / LATEST).unlink(missing_ok=True)
        return gone

    @property
    def lr_factor(self) -> float:
        """The run-time learning-rate factor of the engine (:meth:`set_lr_factor`; 1 by default)."""
        return float(getattr(self.engine, "_lr_factor", 1.0))

    def set_lr_factor(self, factor: float) -> bool:
        """Multiply the engine's learning rate by ``factor`` from now on (relative to ``optim.lr``,
        not cumulative); False when the engine cannot (a third-party engine without ``set_lr_factor``)."""
        set_lr_factor = getattr(self.engine, "set_lr_factor", None)
        if set_lr_factor is None:
            return False
        set_lr_factor(float(factor))
        return True

    def load_checkpoint(self, path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Restore from ``path`` (default: the latest checkpoint); returns the saved ``extra``."""
        p = Path(path) if path is not None else self.latest_checkpoint()
        if p is None:
            raise FileNotFoundError(f"no checkpoint under {self._ckpt_root()}")
        self.engine.load_checkpoint(str(p))
        state = json.loads((p / "trainer_state.json").read_text())
        return dict(state.get("extra") or {})
