"""A Hydra launcher that runs every multirun job in a fresh Python process.

Hydra's default launcher runs jobs one after another in one process, and
inference/training engines leak state (threads, CUDA contexts, process groups)
between jobs. This one starts ``python -m swarmkit <overrides>`` per job.
It is the default: ``hydra/launcher=swarmkit_subprocess``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

log = logging.getLogger(__name__)


@dataclass
class SubprocessLauncherConf:
    _target_: str = "hydra_plugins.swarmkit_launcher.subprocess_launcher.SubprocessLauncher"
    #: stop the sweep at the first failed job
    fail_fast: bool = False


class JobFailed(RuntimeError):
    """A multirun job's process exited with a non-zero status."""


class SubprocessLauncher(Launcher):
    def __init__(self, fail_fast: bool = False) -> None:
        self.fail_fast = fail_fast
        self.config: DictConfig | None = None
        self.hydra_context = None
        self.task_function = None

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        results: list[JobReturn] = []
        for offset, overrides in enumerate(job_overrides):
            idx = initial_job_idx + offset
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"job{idx}"
                sweep_config.hydra.job.num = idx
            job_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
            cmd = [sys.executable, "-m", "swarmkit", *overrides, f"hydra.run.dir={job_dir}"]
            log.info("#%d: %s", idx, " ".join(overrides))
            proc = subprocess.run(cmd, env=dict(os.environ))
            ret = JobReturn(
                overrides=list(overrides),
                cfg=sweep_config,
                hydra_cfg=sweep_config,
                working_dir=str(job_dir),
                task_name=str(sweep_config.hydra.job.name),
            )
            if proc.returncode == 0:
                ret.status = JobStatus.COMPLETED
                ret.return_value = 0
            else:
                ret.status = JobStatus.FAILED
                ret.return_value = JobFailed(f"job {idx} ({' '.join(overrides)}) exited with {proc.returncode}")
            results.append(ret)
            if self.fail_fast and proc.returncode != 0:
                break
        return results


def register_launcher_config() -> None:
    """Register the launcher class and its config (editable installs hide it from Hydra's scan)."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(SubprocessLauncher)
    ConfigStore.instance().store(
        group="hydra/launcher", name="swarmkit_subprocess", node=SubprocessLauncherConf, provider="swarmkit"
    )
