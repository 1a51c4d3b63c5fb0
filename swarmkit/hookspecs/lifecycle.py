"""Lifecycle notifications for loggers, dashboards and third parties.

All of these are fire-and-forget: every implementation is called, return
values are ignored, and an implementation that raises is logged and skipped
so a broken logger never stops training.
"""

from __future__ import annotations

from typing import Any

from swarmkit.hookspecs import hookspec


@hookspec
def on_run_start(config: dict[str, Any], run_dir: str) -> None:
    """A server's training run starts (after BOOTING, before the first episode).

    :param config: the validated training configuration as a plain dict.
    :param run_dir: the run folder (metrics, checkpoints, journal).
    :returns: nothing; every implementation is called.
    """


@hookspec
def on_run_end(summary: dict[str, Any], run_dir: str) -> None:
    """A server's training run ends (stopped, finished or failed).

    :param summary: final numbers (``global_step``, ``episodes``, ``reason``...).
    :param run_dir: the run folder (as ``on_run_start`` got it: the run's key).
    :returns: nothing; every implementation is called.
    """


@hookspec
def on_step_end(step: int, metrics: dict[str, float], run_dir: str, trajectories: list[dict[str, Any]]) -> None:
    """An optimizer step finished.

    An implementation may take any subset of the arguments (pluggy passes only those it names).

    :param step: the global step just taken (1 for the first step).
    :param metrics: scalar metrics of the step (loss, reward mean, tokens...).
    :param run_dir: the run folder (as ``on_run_start`` got it: the run's key).
    :param trajectories: a few of the step's episodes (``trainer.log_trajectories``), each
        ``episode_id``, ``task_id``, ``reward`` and ``timelines`` (``Timeline.to_dict()``: blocks
        with text, token ids, logprobs and loss masks).
    :returns: nothing; every implementation is called.
    """


@hookspec
def on_weights_synced(step: int, seconds: float) -> None:
    """New weights reached the inference engine; later episodes use them.

    :param step: the policy version now served.
    :param seconds: wall time the sync took.
    :returns: nothing; every implementation is called.
    """


@hookspec
def on_episode_finished(episode: dict[str, Any]) -> None:
    """An episode ended (reported, aborted or reaped).

    :param episode: ``id``, ``task_id``, ``status`` (``finished``/``aborted``),
        ``reward``, ``eval``, ``client_id``, ``policy_version`` and ``n_calls``.
    :returns: nothing; every implementation is called.
    """
