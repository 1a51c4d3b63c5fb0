"""A Hydra launcher that runs every multirun job in a fresh Python process.

Hydra's default launcher runs jobs one after another in one process, and
inference/training engines leak state (threads, CUDA contexts, process groups)
between jobs. This one starts ``python -m swarmkit <overrides>`` per job.
It is the default: ``hydra/launcher=swarmkit_subprocess``.

By default jobs run one after another with their output on the console, as
before. The settings under ``hydra.launcher``
(:class:`swarmkit.config.schema.SubprocessLauncherConfig`) add what a research campaign
needs (:mod:`swarmkit.research.executor` drives them):

- ``max_parallel``: jobs at once; ``gpus=0,1`` hands each running job
  ``gpus_per_job`` of those indices (``CUDA_VISIBLE_DEVICES``) and bounds the
  parallelism by them; ``threads_per_job`` caps each job's torch threads;
- a watchdog: ``timeout_s`` (or a job's own) kills a hung job's process group;
  a crashed or killed job is run again up to ``retries`` times, then recorded
  as failed (never dropped); a retried job's previous folder is kept beside it
  (``<dir>.attempt<N>``) so it starts clean;
- ``state``: a JSON record of every job (status ``ok``/``retried``/``failed``,
  attempts with their exit status and reason, log path), written atomically
  after every change. A launch that finds it resumes: finished jobs are not
  run again (an attempt cut short by the launcher's own death is marked
  ``interrupted`` and does not count against the retries);
- ``jobs_file``: a YAML/JSON list of jobs (``name``, ``overrides``, ``dir``,
  optional ``timeout_s`` and ``command``) run instead of the command line's
  sweep, for stages whose configurations are not a cartesian product;
- ``log_dir``: each attempt's output in ``<log_dir>/<name>.attempt<N>.log``;
- ``inject_crash=KEY@STEP`` (tests, the worked study): SIGKILL the first
  attempt of job KEY (its name or index) once its ``metrics.jsonl`` holds STEP
  training steps, a real crash for the retry path.

Children die with the launcher (``PR_SET_PDEATHSIG`` on Linux), so killing a
campaign does not leave orphaned training runs behind.
"""

# No ``from __future__ import annotations`` here: Hydra's plugin scan runs this module before it is in
# sys.modules, and a dataclass with string annotations looks its module up there (AttributeError).
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from hydra.core.utils import JobReturn, JobStatus, configure_log, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import DictConfig, open_dict

from swarmkit.procs import die_with_parent
from swarmkit.runfiles import write_json

log = logging.getLogger(__name__)

#: a job's final statuses (``retried``: succeeded after a failed attempt)
FINAL = ("ok", "retried", "failed")


class JobFailed(RuntimeError):
    """A multirun job's process exited with a non-zero status."""


@dataclass
class JobSpec:
    """One job: the overrides it runs with and its folder (``hydra.run.dir``)."""

    name: str
    overrides: list[str]
    dir: str
    timeout_s: float = 0.0
    command: list[str] = field(default_factory=list)


@dataclass
class _Running:
    job: JobSpec
    proc: subprocess.Popen[bytes]
    attempt: int
    started: float
    gpus: list[str]
    log_path: str | None
    log_file: IO[bytes] | None
    kill_reason: str | None = None


def load_jobs_file(path: str) -> list[JobSpec]:
    """The jobs of a jobs file (YAML or JSON list of mappings)."""
    import yaml

    items = yaml.safe_load(Path(path).read_text())
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a list of jobs")
    jobs = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not {"name", "overrides", "dir"} <= set(item):
            raise ValueError(f"{path}: job {i} needs name, overrides and dir")
        jobs.append(JobSpec(name=str(item["name"]), overrides=[str(o) for o in item["overrides"]], dir=str(item["dir"]),
                            timeout_s=float(item.get("timeout_s") or 0.0),
                            command=[str(c) for c in item.get("command") or []]))
    return jobs


def _train_steps(run_dir: str) -> int:
    """How many training steps ``run_dir/metrics.jsonl`` records (cheap: no JSON parse)."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", "rb") as f:
            return sum(1 for line in f if b'"kind": "train"' in line and line.endswith(b"\n"))
    except OSError:
        return 0


class JobRunner:
    """Runs jobs as processes: parallel within the budget, watched, retried, recorded."""

    def __init__(self, *, max_parallel: int = 1, timeout_s: float = 0.0, retries: int = 0, state: str = "",
                 log_dir: str = "", gpus: str = "", gpus_per_job: int = 1, threads_per_job: int = 0,
                 inject_crash: str = "", poll_s: float = 0.5, fail_fast: bool = False) -> None:
        self.gpus = [g.strip() for g in str(gpus).split(",") if g.strip()]
        self.gpus_per_job = max(1, int(gpus_per_job))
        parallel = max(1, int(max_parallel))
        if self.gpus:
            parallel = min(parallel, max(1, len(self.gpus) // self.gpus_per_job))
        self.parallel = parallel
        self.timeout_s = float(timeout_s)
        self.retries = max(0, int(retries))
        self.state_path = Path(state) if state else None
        self.log_dir = Path(log_dir) if log_dir else None
        self.threads_per_job = int(threads_per_job)
        self.poll_s = float(poll_s)
        self.fail_fast = fail_fast
        self.crash_key, self.crash_step = "", 0
        if inject_crash:
            key, _, step = str(inject_crash).rpartition("@")
            if not key or not step.isdigit():
                raise ValueError(f"inject_crash: expected KEY@STEP, got {inject_crash!r}")
            self.crash_key, self.crash_step = key, int(step)
        self.records: dict[str, dict[str, Any]] = {}

    # ------------------------------------------------------------------ the record
    def _load(self) -> None:
        if self.state_path is None or not self.state_path.exists():
            return
        self.records = json.loads(self.state_path.read_text()).get("jobs", {})
        for rec in self.records.values():
            if rec.get("status") not in FINAL:  # the launcher died with it running or waiting
                for att in rec.get("attempts", []):
                    if att.get("reason") is None and att.get("rc") is None:
                        att.update(rc=None, reason="interrupted", ended=att.get("ended") or time.time())
                rec["status"] = "pending"

    def _save(self) -> None:
        if self.state_path is not None:
            write_json(self.state_path, {"updated": time.time(), "jobs": self.records}, default=str, allow_nan=False)

    def _record(self, job: JobSpec, idx: int) -> dict[str, Any]:
        rec = self.records.get(job.name)
        if rec is None:
            rec = self.records[job.name] = {"name": job.name, "index": idx, "overrides": job.overrides,
                                            "dir": job.dir, "status": "pending", "attempts": []}
        return rec

    @staticmethod
    def counted_failures(rec: dict[str, Any]) -> int:
        """Failed attempts that count against the retries (not those cut short by the launcher's death)."""
        return sum(1 for a in rec.get("attempts", []) if a.get("reason") not in (None, "interrupted"))

    # ------------------------------------------------------------------ running
    def _start(self, job: JobSpec, free_gpus: list[str]) -> _Running:
        rec = self.records[job.name]
        attempt = len(rec["attempts"]) + 1
        job_dir = Path(job.dir)
        if job_dir.exists() and any(job_dir.iterdir()):  # a previous attempt's folder: keep it aside
            aside = job_dir.with_name(f"{job_dir.name}.attempt{attempt - 1}")
            n = attempt - 1
            while aside.exists():
                n += 1
                aside = job_dir.with_name(f"{job_dir.name}.attempt{n}")
            job_dir.rename(aside)
            if rec["attempts"]:
                rec["attempts"][-1]["moved_to"] = str(aside)
        job_dir.parent.mkdir(parents=True, exist_ok=True)
        command = list(job.command) or [sys.executable, "-m", "swarmkit"]
        if command[0] == "python":
            command[0] = sys.executable
        quoted_dir = "'" + job.dir.replace("'", "\\'") + "'"  # a folder may hold ',' or ' '
        cmd = [*command, *job.overrides, f"hydra.run.dir={quoted_dir}"]
        env = dict(os.environ)
        gpus = free_gpus[: self.gpus_per_job] if self.gpus else []
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        if self.threads_per_job > 0:
            env["SWARMKIT_TORCH_THREADS"] = env["OMP_NUM_THREADS"] = str(self.threads_per_job)
        log_path, log_file = None, None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = str(self.log_dir / f"{job.name.replace('/', '__')}.attempt{attempt}.log")
            log_file = open(log_path, "wb")  # noqa: SIM115 - closed when the job ends
        log.info("%s (attempt %d): %s", job.name, attempt, " ".join(job.overrides))
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT if log_file else None,
                                start_new_session=True, preexec_fn=die_with_parent)
        now = time.time()
        rec["status"] = "running"
        rec["attempts"].append({"n": attempt, "pid": proc.pid, "started": now, "ended": None, "rc": None,
                                "reason": None, "log": log_path, "gpus": gpus})
        rec["log"] = log_path
        self._save()
        return _Running(job, proc, attempt, now, gpus, log_path, log_file)

    def _kill(self, run: _Running, reason: str) -> None:
        if run.kill_reason is None:
            run.kill_reason = reason
            log.warning("%s (attempt %d): %s: killing it", run.job.name, run.attempt, reason)
            try:
                os.killpg(run.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                run.proc.kill()

    def _watch(self, run: _Running, idx: int) -> None:
        limit = run.job.timeout_s or self.timeout_s
        if limit and time.time() - run.started > limit:
            self._kill(run, f"timeout after {limit:g} s")
        elif (self.crash_key and run.attempt == 1 and self.crash_key in (run.job.name, str(idx))
              and _train_steps(run.job.dir) >= self.crash_step):
            self._kill(run, f"injected crash at step {self.crash_step}")

    def _finish(self, run: _Running, rc: int) -> str:
        """Record an ended attempt; the job's status after it (``retrying`` when it runs again)."""
        if run.log_file is not None:
            run.log_file.close()
        rec = self.records[run.job.name]
        att = rec["attempts"][-1]
        reason = run.kill_reason or (None if rc == 0 else f"exit status {rc}")
        att.update(ended=time.time(), rc=rc, reason=reason)
        rec["rc"] = rc
        if rc == 0 and run.kill_reason is None:
            rec["status"] = "ok" if self.counted_failures(rec) == 0 else "retried"
        elif self.counted_failures(rec) <= self.retries:
            rec["status"] = "retrying"
            log.warning("%s: attempt %d failed (%s); running it again", run.job.name, run.attempt, reason)
        else:
            rec["status"] = "failed"
            log.error("%s: failed after %d attempt(s) (%s)", run.job.name, len(rec["attempts"]), reason)
        self._save()
        return str(rec["status"])

    def run(self, jobs: Sequence[JobSpec]) -> dict[str, dict[str, Any]]:
        """Run ``jobs`` (skipping those a previous launch finished); the record of each, by name."""
        self._load()
        index = {job.name: i for i, job in enumerate(jobs)}
        pending: deque[JobSpec] = deque()
        for i, job in enumerate(jobs):
            rec = self._record(job, i)
            if rec["status"] in FINAL:
                log.info("%s: %s in an earlier launch, not run again", job.name, rec["status"])
            else:
                pending.append(job)
        self._save()
        running: list[_Running] = []
        try:
            self._loop(pending, running, index)
        except BaseException:  # Ctrl-C (the jobs run in their own sessions) or a launcher error
            self._stop_all(running)
            raise
        return {job.name: self.records[job.name] for job in jobs}

    def _stop_all(self, running: list[_Running]) -> None:
        """Stop the running jobs (SIGINT, then SIGKILL after 10 s); their attempts are recorded ``interrupted``."""
        for run in running:
            try:
                os.killpg(run.proc.pid, signal.SIGINT)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + 10
        for run in running:
            try:
                run.proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self._kill(run, "interrupted")
                run.proc.wait()
            if run.log_file is not None:
                run.log_file.close()
            rec = self.records[run.job.name]
            rec["attempts"][-1].update(ended=time.time(), rc=run.proc.returncode, reason="interrupted")
            rec["status"] = "pending"
        self._save()

    def _loop(self, pending: deque[JobSpec], running: list[_Running], index: dict[str, int]) -> None:
        free = list(self.gpus)
        stop = False
        while (pending and not stop) or running:
            while pending and not stop and len(running) < self.parallel and (
                    not self.gpus or len(free) >= self.gpus_per_job):
                run = self._start(pending.popleft(), free)
                free = [g for g in free if g not in run.gpus]
                running.append(run)
            time.sleep(self.poll_s)
            for run in list(running):
                rc = run.proc.poll()
                if rc is None:
                    self._watch(run, index[run.job.name])
                    continue
                running.remove(run)
                free += run.gpus
                status = self._finish(run, rc)
                if status == "retrying":
                    pending.append(run.job)
                elif status == "failed" and self.fail_fast:
                    stop = True


class SubprocessLauncher(Launcher):
    def __init__(self, fail_fast: bool = False, max_parallel: int = 1, timeout_s: float = 0.0, retries: int = 0,
                 state: str = "", jobs_file: str = "", log_dir: str = "", gpus: str = "", gpus_per_job: int = 1,
                 threads_per_job: int = 0, inject_crash: str = "", poll_s: float = 0.5) -> None:
        self.fail_fast = fail_fast
        self.jobs_file = jobs_file
        self.runner_options: dict[str, Any] = dict(
            max_parallel=max_parallel, timeout_s=timeout_s, retries=retries, state=state, log_dir=log_dir,
            gpus=gpus, gpus_per_job=gpus_per_job, threads_per_job=threads_per_job, inject_crash=inject_crash,
            poll_s=poll_s, fail_fast=fail_fast)
        self.config: DictConfig | None = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        configs: list[Any] = []
        jobs: list[JobSpec] = []
        for offset, overrides in enumerate(job_overrides):
            idx = initial_job_idx + offset
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"job{idx}"
                sweep_config.hydra.job.num = idx
            job_dir = Path(str(sweep_config.hydra.sweep.dir)) / str(sweep_config.hydra.sweep.subdir)
            configs.append(sweep_config)
            jobs.append(JobSpec(name=f"job{idx}", overrides=list(overrides), dir=str(job_dir)))
        if self.jobs_file:  # the listed jobs replace the command line's (sweep-free) job
            if len(jobs) > 1:
                raise ValueError("hydra.launcher.jobs_file lists the jobs: sweep nothing on the command line")
            jobs = load_jobs_file(self.jobs_file)
            configs = [configs[0]] * len(jobs)
        if self.runner_options["max_parallel"] <= 1 and not self.runner_options["state"] and not (
                self.runner_options["timeout_s"] or self.runner_options["retries"] or self.jobs_file):
            self.runner_options["poll_s"] = min(0.1, float(self.runner_options["poll_s"]))
        records = JobRunner(**self.runner_options).run(jobs)
        results: list[JobReturn] = []
        for job, cfg in zip(jobs, configs, strict=True):
            rec = records[job.name]
            if rec["status"] not in FINAL:  # not run: fail_fast stopped the sweep before it
                continue
            ret = JobReturn(overrides=list(job.overrides), cfg=cfg, hydra_cfg=cfg, working_dir=job.dir,
                            task_name=str(cfg.hydra.job.name))
            if rec["status"] in ("ok", "retried"):
                ret.status = JobStatus.COMPLETED
                ret.return_value = 0
            else:
                ret.status = JobStatus.FAILED
                ret.return_value = JobFailed(f"{job.name} ({' '.join(job.overrides)}) failed after "
                                             f"{len(rec['attempts'])} attempt(s): {rec['attempts'][-1]['reason']}")
            results.append(ret)
        return results


def register_launcher() -> None:
    """Make the launcher class known to Hydra. Hydra's own plugin scan finds it in an installed
    package; an editable install hides ``hydra_plugins`` from that scan, so the command line
    (:mod:`swarmkit.apps.cli`) registers it before a run. Its config
    (``hydra/launcher=swarmkit_subprocess``) is stored by :mod:`swarmkit.config.compose`, from
    :class:`swarmkit.config.schema.SubprocessLauncherConfig`."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(SubprocessLauncher)
