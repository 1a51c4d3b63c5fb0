"""What every framework example shares: the command line, the train loop and the eval pass.

An example only writes ``run_episode(base_url, api_key, task, *, temperature, seed)
-> (final_text, valid_tool_calls, tool_calls, turns)`` in its framework's own way;
:func:`main` registers episodes with :class:`swarmkit.client.SwarmClient`, runs the
agent against each episode's ``base_url``/``api_key``, grades it with
``swarmkit.tasks.calc_agent.grade`` and reports the reward.

    python examples/frameworks/<framework>.py --url http://127.0.0.1:8000 --token ADMIN --episodes 64
    python examples/frameworks/<framework>.py --url http://127.0.0.1:8000 --eval 24 --episodes 0
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from swarmkit.client import SwarmClient
from swarmkit.tasks import Outcome, Task, make_tasks
from swarmkit.tasks.calc_agent import grade

__all__ = ["evaluate", "main", "play", "train"]

#: run_episode(base_url, api_key, task, *, temperature, seed) -> (final_text, valid_tool_calls, tool_calls, turns)
RunEpisode = Callable[..., tuple[str, int, int, int]]


def play(client: SwarmClient, run_episode: RunEpisode, task: Task, *, eval: bool, temperature: float,
         seed: int | None) -> Outcome:
    """One registered episode: run the agent, grade it, report the reward."""
    with client.episode(task_id=task.task_id, eval=eval, meta={"task_family": task.family}) as ep:
        outcome = grade(task, *run_episode(ep.base_url, ep.api_key, task, temperature=temperature, seed=seed))
        ep.report(outcome.reward)
    return outcome


def train(client: SwarmClient, run_episode: RunEpisode, episodes: int, *, group: int = 4,
          temperature: float = 1.0, seed: int = 0, concurrency: int = 1) -> list[Outcome]:
    """``episodes`` training episodes, ``group`` rollouts of each task (GRPO compares a task's rollouts)."""
    tasks = make_tasks("calc_agent", max(1, episodes // group + 1), seed=seed, split="train")

    def one(k: int) -> Outcome:
        out = play(client, run_episode, tasks[k // group], eval=False, temperature=temperature, seed=None)
        step = (client.status() if client.token else client.health())["global_step"]
        print(f"episode {k + 1:4d}  {tasks[k // group].task_id:14s} reward {out.reward:.2f}  "
              f"turns {out.metrics['turns']:.0f}  step {step}", flush=True)
        return out

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(episodes)))


def evaluate(client: SwarmClient, run_episode: RunEpisode, n: int, seed: int = 0,
             concurrency: int = 1) -> dict[str, float]:
    """``n`` greedy eval episodes (never trained): mean reward, accuracy and valid-tool-call rate."""
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda t: play(client, run_episode, t, eval=True, temperature=0.0, seed=seed),
                             make_tasks("calc_agent", n, seed=seed, split="eval")))
    return {key: statistics.fmean(o.metrics[key] for o in outs) for key in ("correct", "valid_tool_call")} | {
        "reward": statistics.fmean(o.reward for o in outs)}


def main(run_episode: RunEpisode, name: str, argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=f"calc_agent in {name}, trained on a swarm server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the swarm server")
    p.add_argument("--token", default=os.environ.get("SWARMKIT_ADMIN_TOKEN"),
                   help="admin token, to read the server's status (default $SWARMKIT_ADMIN_TOKEN; optional)")
    p.add_argument("--episodes", type=int, default=32, help="training episodes")
    p.add_argument("--group", type=int, default=4, help="rollouts of each task in a row")
    p.add_argument("--eval", type=int, default=0, metavar="N", help="then N greedy eval episodes")
    p.add_argument("--concurrency", type=int, default=4, help="episodes run at once")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    with SwarmClient(args.url, token=args.token) as client:
        if args.episodes:
            outs = train(client, run_episode, args.episodes, group=args.group, temperature=args.temperature,
                         seed=args.seed, concurrency=args.concurrency)
            print(f"{name}: {len(outs)} episodes, mean reward {statistics.fmean(o.reward for o in outs):.3f}")
        if args.eval:
            m = evaluate(client, run_episode, args.eval, seed=args.seed, concurrency=args.concurrency)
            print(f"{name} eval ({args.eval} tasks): accuracy {m['correct']:.3f}  "
                  f"valid tool calls {m['valid_tool_call']:.3f}  reward {m['reward']:.3f}")
