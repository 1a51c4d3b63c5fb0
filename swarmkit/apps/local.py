"""``mode=local`` (the default job): a whole swarm on this machine.

Starts a swarm server in this process, configures it through the same
controller API a remote controller uses, evaluates the model on held-out
tasks, runs the built-in task client until ``trainer.total_steps``
optimizer steps are done (one metrics line per step), evaluates again and
prints a summary. Everything lands in the run folder: ``metrics.jsonl``,
``states.jsonl``, ``tensorboard/`` (the default logger), ``journal.sqlite``,
``checkpoints/``, ``summary.json``; the dashboard's URL is printed at start.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swarmkit.apps.processes import port_free
from swarmkit.apps.serve import start_server_thread
from swarmkit.apps.task_client import EvalResult, TrainingClient, evaluate, send_demonstrations
from swarmkit.client import SwarmClient
from swarmkit.config.validate import to_dict
from swarmkit.server.run import token_hint
from swarmkit.swarm.metrics import read_metrics, step_line
from swarmkit.tasks import make_tasks

#: soft wrap: a line piped to a file is never cut at 80 columns
console = Console(soft_wrap=True)


def _step_line(m: dict[str, Any], fill: dict[str, Any] | None) -> str:
    return step_line(m, pool=f"{fill['current']:g}/{fill['target']:g} {fill['unit']}" if fill else None)


def run_local(cfg: DictConfig) -> int:
    import logging

    # one line per request is noise next to the per-step lines; the client's retry lines too (the status bar
    # shows the state), and the server's own step lines (this job prints its step lines with the pool's fill)
    for name in ("httpx", "httpcore", "httpx2", "swarmkit.client", "swarmkit.cycle"):
        logging.getLogger(name).setLevel(logging.WARNING)
    t_start = time.time()
    run_dir = Path(cfg.server.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not port_free(cfg.server.host, int(cfg.server.port)):
        console.print(f"port {cfg.server.port} is taken: using a free port")
        cfg.server.port = 0
    handle = start_server_thread(cfg)
    console.print(f"[bold]swarmkit[/] local swarm: server {handle.url}  run dir {run_dir}")
    console.print(f"dashboard: {handle.url}/dashboard (admin token {token_hint(handle.swarm)})", soft_wrap=True)
    client = SwarmClient(handle.url, token=handle.admin_token, retry_for=3600)
    task = cfg.task
    batching = cfg.batching
    try:
        client.configure(to_dict(cfg))
        client.start()
        with console.status(f"BOOTING: loading {cfg.model.name} ({cfg.model.path}) and the trainer..."):
            client.wait_for_state("ROLLING", timeout=3600)
        eval_tasks = make_tasks(task.name, task.eval_size, seed=task.seed, split="eval", options=dict(task.options))
        train_tasks = make_tasks(task.name, task.train_size, seed=task.seed, split="train", options=dict(task.options))
        with console.status(f"evaluating on {len(eval_tasks)} held-out tasks (greedy)..."):
            before = evaluate(client, eval_tasks, max_tokens=task.max_tokens, concurrency=task.concurrency)
        console.print(f"eval reward before training: {before}")
        n_demos = 0
        if int(task.demonstrations) > 0:
            demo_tasks = make_tasks(task.name, int(task.demonstrations), seed=task.seed + 1, split="demo",
                                    options=dict(task.options))
            with console.status(f"supervised warm start: sending {len(demo_tasks)} demonstrations..."):
                n_demos = send_demonstrations(client, demo_tasks, group_size=int(batching.rollouts_per_task),
                                              concurrency=task.concurrency)
            console.print(f"supervised warm start: {n_demos} demonstrations in the pool (trained before RL episodes)")

        rewards: list[float] = []

        def sampler(seed: int) -> TrainingClient:
            return TrainingClient(
                client, train_tasks, rollouts_per_task=int(batching.rollouts_per_task), max_tokens=task.max_tokens,
                temperature=task.temperature, concurrency=task.concurrency, seed=seed,
                on_result=lambda r: rewards.append(r.reward),
            )

        def eval_now(label: str) -> EvalResult:
            result = evaluate(client, eval_tasks, max_tokens=task.max_tokens, concurrency=task.concurrency)
            progress.console.print(f"eval reward {label}: {result}")
            return result

        trainer_client = sampler(cfg.seed)
        midway: dict[int, EvalResult] = {}
        # sampling starts once the warm start is trained: earlier episodes would come from the untrained policy
        warm_steps = n_demos // max(1, int(batching.batch_size) * int(batching.rollouts_per_task))
        sampling = False
        total = int(cfg.trainer.total_steps)
        eval_every = int(cfg.trainer.eval_every)
        next_eval = eval_every
        seen = 0
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            bar = progress.add_task("training steps", total=total or None)
            while True:
                status = client.status()
                step = int(status["global_step"])
                pool = status.get("pool", {})
                last = pool.get("last_step")
                if last and int(last["step"]) > seen:  # every step's line, also of steps taken between polls
                    new = [r for r in read_metrics(run_dir) if r.get("kind", "train") == "train"
                           and int(r.get("step") or 0) > seen]
                    for row in new:
                        progress.console.print(_step_line(row, pool.get("fill") if row is new[-1] else None),
                                               soft_wrap=True)
                    seen = max([seen, int(last["step"]), *(int(r["step"]) for r in new)])
                if not sampling and step >= warm_steps:
                    if n_demos:  # the warm start alone, before any sampled episode
                        midway[step] = eval_now(f"after the warm start (step {step})")
                    trainer_client.start()
                    sampling = True
                elif sampling and eval_every and step >= next_eval and (not total or step < total):
                    trainer_client.stop()  # no sampling while evaluating (steps already released may still run)
                    midway[step] = eval_now(f"at step {step}")
                    next_eval = step + eval_every
                    trainer_client = sampler(cfg.seed + step).start()
                progress.update(bar, completed=step,
                                description=f"{status['state']:<14} episodes {len(rewards):>5}")
                if total and step >= total:
                    break
                if pool.get("last_error"):
                    progress.console.print(f"[red]{pool['last_error']}[/]")
                if status["state"] == "OFFLINE":
                    raise RuntimeError(f"the server went OFFLINE: {status.get('last_error')}")
                time.sleep(0.5)
        trainer_client.stop()
        ckpt = client.checkpoint()
        with console.status("evaluating after training..."):
            after = evaluate(client, eval_tasks, max_tokens=task.max_tokens, concurrency=task.concurrency)
        status = client.status()
    finally:
        try:
            client.stop()
        except Exception:  # noqa: BLE001
            pass
        handle.stop()
    summary = {
        "eval_before": {"mean": before.mean, "ci95": before.ci95, "n": before.n},
        "eval_after": {"mean": after.mean, "ci95": after.ci95, "n": after.n},
        "improvement": after.mean - before.mean,
        "eval_metrics_before": {k: {"mean": m, "ci95": c} for k, (m, c) in before.metrics.items()},
        "eval_metrics_after": {k: {"mean": m, "ci95": c} for k, (m, c) in after.metrics.items()},
        "demonstrations": n_demos,
        "eval_midway": {str(k): {"mean": v.mean, "ci95": v.ci95, "n": v.n,
                                 **{m: {"mean": a, "ci95": b} for m, (a, b) in v.metrics.items()}}
                        for k, v in midway.items()},
        "global_step": status["global_step"],
        "replicas": status.get("replicas"),
        "train_episodes": len(rewards),
        "wall_time_s": time.time() - t_start,
        "checkpoint": ckpt.get("trainer", {}).get("path") if isinstance(ckpt.get("trainer"), dict) else None,
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    table = Table(title="swarmkit run summary")
    table.add_column("metric")
    table.add_column("value")
    table.add_row("eval reward before", str(before))
    table.add_row("eval reward after", str(after))
    for key, (m, c) in after.metrics.items():
        b_m, b_c = before.metrics.get(key, (float("nan"), 0.0))
        table.add_row(f"eval {key}", f"{b_m:.3f} ± {b_c:.3f} -> {m:.3f} ± {c:.3f}")
    if n_demos:
        table.add_row("demonstrations (warm start)", str(n_demos))
    table.add_row("optimizer steps", str(summary["global_step"]))
    table.add_row("training episodes", str(summary["train_episodes"]))
    table.add_row("wall time", f"{summary['wall_time_s']:.0f} s")
    table.add_row("run folder", str(run_dir))
    console.print(table)
    return 0
