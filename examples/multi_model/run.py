"""Heterogeneous multi-model training: N swarm servers, N different models, one client.

Each swarm server trains exactly one model. This script starts N servers
(separate ``python -m swarmkit mode=server`` processes on 127.0.0.1), gives
server k its own model (server 0: ``builtin:tiny``; server k >= 1: a tiny
Qwen2 built with seed k and 2 + k layers, or any ``--model-path``), and runs
ONE client whose episodes have N agent roles. Role k's agent talks only to
server k: the client registers one episode per server for the same task
(``roles=[role]``), hands each agent the ``base_url``/``api_key`` of its own
server, and reports each role's reward to that role's server. So every model
is trained on exactly the tokens it generated itself.

The episode (a relay): role ``a`` answers the task prompt; role ``b`` sees the
prompt and ``a``'s reply and answers; and so on. Each role's reply is scored
by the task's scorer (``swarmkit.tasks.score``) on its own text.

    python examples/multi_model/run.py                      # 2 servers on CPU, token_rule, 4 steps each
    python examples/multi_model/run.py --steps 8 --servers 3
    python examples/multi_model/run.py --device cuda        # server k on cuda:k (k mod #GPUs)
    python examples/multi_model/run.py client --route a=http://127.0.0.1:8001 --route b=http://127.0.0.1:8002

The ``client`` sub-command runs only the multi-model client against servers
that already run (any machine); the tests use it as a separate, killable
client process.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from swarmkit.apps.processes import ServerProc, boot_servers, launch_server, watch
from swarmkit.apps.task_client import EpisodeLoop
from swarmkit.client import SwarmClient
from swarmkit.tasks import Task, make_tasks, score

ROLE_NAMES = "abcdefghijklmnopqrstuvwxyz"
DEFAULT_TOKEN = "multi-model-demo-token"


# ----------------------------------------------------------------------------- models
#: random-init Qwen2 shapes (the ``builtin:tiny`` 512-token tokenizer): hidden, intermediate, heads, kv heads,
#: head dim, layers of server 0 (server k gets its own seed and a different depth)
SHAPES = {
    "tiny": (128, 256, 4, 2, 32, 2),
    "0.5b": (896, 4864, 14, 2, 64, 24),  # Qwen2.5-0.5B's trunk (small vocabulary): ~360 M parameters
}


def build_model(folder: Path, seed: int, layers: int = 2, shape: str = "tiny") -> Path:
    """A random Qwen2 of ``shape`` (the ``builtin:tiny`` tokenizer) with ``layers`` layers and ``seed``."""
    folder = Path(folder)
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from swarmkit.models import build_tiny_tokenizer

    hidden, inter, heads, kv, head_dim, _ = SHAPES[shape]
    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=int(layers), num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def model_paths(n: int, work: Path, given: Sequence[str] = (), shape: str = "tiny") -> list[str]:
    """``model.path`` of each of ``n`` servers: the given ones first, then built models.

    ``tiny``: server 0 gets ``builtin:tiny``, server k a 2 + k layer tiny Qwen2 with seed k.
    ``0.5b``: server k gets a random Qwen2.5-0.5B-shaped model with seed k and 24 - 4k layers (min 4).
    """
    paths = list(given)[:n]
    base = SHAPES[shape][5]
    for k in range(len(paths), n):
        if k == 0 and shape == "tiny":
            paths.append("builtin:tiny")
            continue
        layers = base + k if shape == "tiny" else max(4, base - 4 * k)
        paths.append(str(build_model(work / f"model_{shape}_{ROLE_NAMES[k]}", seed=k, layers=layers, shape=shape)))
    return paths


# ----------------------------------------------------------------------------- servers
def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def device_of(k: int, device: str, n_gpus: int | None = None) -> str:
    """Where server k runs: ``cpu``, or ``cuda:(k mod #GPUs)`` for ``--device cuda``."""
    if device in ("cpu", "auto") or device.startswith("cuda:"):
        return device
    if device != "cuda":
        raise ValueError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    n = gpu_count() if n_gpus is None else n_gpus
    if n < 1:
        raise RuntimeError("--device cuda: torch sees no GPU")
    return f"cuda:{k % n}"


def training_overrides(model_path: str, role: str, device: str, *, task: str, steps: int, batch_size: int,
                       rollouts: int, lr: float, episode_timeout_s: float, extra: Sequence[str] = ()) -> list[str]:
    """The config one server trains with (only the model, its name and the device differ)."""
    out = [
        "model=tiny", f"model.path={model_path}", f"model.name=model-{role}", f"task={task}",
        "batching=c2", f"batching.batch_size={batch_size}", f"batching.rollouts_per_task={rollouts}",
        f"optim.lr={lr}", f"trainer.total_steps={steps}", "trainer.checkpoint_every=0",
        f"server.episode_timeout_s={episode_timeout_s}", "server.drain_timeout_s=30",
    ]
    # both engines follow the same placement; "++": the packaged optim YAMLs have no device key
    out += [f"backend.device={device}", f"++optim.device={device}"]
    return out + list(extra)


# ----------------------------------------------------------------------------- the multi-model client
@dataclass
class MultiResult:
    task_id: str
    eval: bool
    rewards: dict[str, float]
    completions: dict[str, str]
    episode_ids: dict[str, str]
    urls: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def relay_messages(task: Task, role_index: int, replies: Sequence[str]) -> list[dict[str, Any]]:
    """What role k sees: the task prompt plus the earlier roles' replies."""
    messages = [dict(m) for m in task.messages]
    if role_index and replies:
        notes = "\n".join(f"agent {ROLE_NAMES[i]}: {r}" for i, r in enumerate(replies))
        messages.append({"role": "user", "content": f"Earlier answers:\n{notes}\nYour answer?"})
    return messages


def run_multi_episode(routes: dict[str, SwarmClient], task: Task, *, max_tokens: int, temperature: float,
                      eval: bool = False, http: httpx.Client | None = None,
                      timeout_s: float | None = None) -> MultiResult:
    """One multi-agent episode: one registered episode per server, one role each.

    Registration order is the routes' order on every thread (no lock-order
    inversion between two servers that drain at different times). An error
    aborts every episode still open (the SDK's ``episode`` context).
    """
    own = http is None
    http = http or httpx.Client(timeout=600.0)
    meta = {"task_family": task.family, "multi_model": True}
    try:
        with contextlib.ExitStack() as stack:
            eps = {role: stack.enter_context(c.episode(task.task_id, eval, roles=[role], timeout_s=timeout_s,
                                                       meta={**meta, "role": role}))
                   for role, c in routes.items()}
            replies: list[str] = []
            for k, (role, ep) in enumerate(eps.items()):
                resp = http.post(f"{ep.base_url}/chat/completions",
                                 headers={"Authorization": f"Bearer {ep.key_for(role)}"},
                                 json={"model": f"model-{role}", "messages": relay_messages(task, k, replies),
                                       "max_tokens": max_tokens, "temperature": temperature})
                resp.raise_for_status()
                replies.append(resp.json()["choices"][0]["message"].get("content") or "")
            rewards = {role: score(task, text) for role, text in zip(eps, replies, strict=True)}
            for role, ep in eps.items():
                ep.report({role: rewards[role]})  # each role's reward goes to its own server
            return MultiResult(task.task_id, eval, rewards, dict(zip(eps, replies, strict=True)),
                               {r: ep.episode_id for r, ep in eps.items()},
                               {r: c.url for r, c in routes.items()})
    finally:
        if own:
            http.close()


class MultiModelClient(EpisodeLoop):
    """Keeps ``concurrency`` multi-model episodes running until stopped (or ``max_episodes``)."""

    def __init__(self, routes: dict[str, SwarmClient], tasks: list[Task], *, rollouts_per_task: int,
                 max_tokens: int, temperature: float = 1.0, concurrency: int = 2, seed: int = 0,
                 max_episodes: int = 0, log_path: str | None = None, timeout_s: float | None = None):
        super().__init__(tasks, rollouts_per_task=rollouts_per_task, concurrency=concurrency, seed=seed,
                         max_episodes=max_episodes)
        self.routes = routes
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.timeout_s = timeout_s
        self.log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
        self.rewards: dict[str, list[float]] = {r: [] for r in routes}

    def run_one(self, task: Task, http: httpx.Client) -> MultiResult:
        return run_multi_episode(self.routes, task, max_tokens=self.max_tokens, temperature=self.temperature,
                                 http=http, timeout_s=self.timeout_s)

    def handle(self, result: MultiResult) -> None:
        for role, r in result.rewards.items():
            self.rewards[role].append(r)
        if self.log is not None:
            self.log.write(result.to_json() + "\n")


# ----------------------------------------------------------------------------- monitoring
# ----------------------------------------------------------------------------- commands
def cmd_all(args: argparse.Namespace) -> int:
    n = int(args.servers)
    if not 1 <= n <= len(ROLE_NAMES):
        raise SystemExit("--servers must be between 1 and 26")
    roles = list(ROLE_NAMES[:n])
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="swarmkit-multi-"))
    n_gpus = gpu_count() if args.device == "cuda" else None
    devices = [device_of(k, args.device, n_gpus) for k in range(n)]
    envs: list[dict[str, str]] = [{} for _ in range(n)]
    if args.isolate_gpus and args.device == "cuda":  # each process sees only its GPU, as cuda:0
        envs = [{"CUDA_VISIBLE_DEVICES": d.split(":")[1]} for d in devices]
        devices = ["cuda:0"] * n
    t0 = time.perf_counter()
    paths = model_paths(n, work, args.model_path, shape=args.shape)
    servers: list[ServerProc] = []
    try:
        for k, role in enumerate(roles):
            s = launch_server(role, work / f"server_{role}", token=args.token, device=devices[k], env=envs[k])
            s.model_path = paths[k]
            servers.append(s)
        overrides = {s.role: training_overrides(s.model_path, s.role, s.device, task=args.task, steps=args.steps,
                                                batch_size=args.batch_size, rollouts=args.rollouts, lr=args.lr,
                                                episode_timeout_s=args.episode_timeout_s, extra=args.override)
                     for s in servers}
        boot_servers(servers, overrides, timeout=args.timeout)
        t_ready = time.perf_counter()
        for s in servers:
            vis = envs[roles.index(s.role)].get("CUDA_VISIBLE_DEVICES")
            print(f"server {s.role}: {s.url}  model {s.model_path}  device {s.device}"
                  f"{f' (CUDA_VISIBLE_DEVICES={vis})' if vis else ''}  run dir {s.run_dir}")
        routes = {s.role: SwarmClient(s.url, retry_for=args.timeout, client_id="multi-model-client")
                  for s in servers}
        tasks = make_tasks(args.task, args.train_size)
        mc = MultiModelClient(routes, tasks, rollouts_per_task=args.rollouts, max_tokens=args.max_tokens,
                              concurrency=args.concurrency, log_path=args.episode_log).start()
        metrics = watch(servers, args.steps, args.timeout, mc)
        t_done = time.perf_counter()
        mc.stop()
        summary = {"servers": {}, "boot_s": t_ready - t0, "train_wall_s": t_done - t_ready,
                   "episodes": mc.finished, "failed_episodes": mc.failures}
        print(f"\n{'server':<8}{'device':<10}{'steps':>6}{'mean step s':>13}{'first reward':>14}{'last reward':>13}")
        for s in servers:
            rows = metrics[s.role]
            step_s = [float(r.get("cycle_time_s", 0.0)) for r in rows]
            rew = [float(r.get("reward_mean", float("nan"))) for r in rows]
            mean_s = sum(step_s) / max(1, len(step_s))
            summary["servers"][s.role] = {"url": s.url, "device": s.device, "model_path": s.model_path,
                                          "steps": rows, "mean_step_s": mean_s}
            print(f"{s.role:<8}{s.device:<10}{len(rows):>6}{mean_s:>13.3f}{rew[0]:>14.3f}{rew[-1]:>13.3f}")
        print(f"boot {summary['boot_s']:.1f} s, training {summary['train_wall_s']:.1f} s for {args.steps} steps "
              f"per server, {mc.finished} multi-model episodes ({mc.failures} failed)")
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        for s in servers:
            with contextlib.suppress(Exception):
                s.client(retry_for=5).stop()
            s.stop()


def cmd_client(args: argparse.Namespace) -> int:
    routes: dict[str, SwarmClient] = {}
    for item in args.route:
        role, _, url = item.partition("=")
        if not role or not url:
            raise SystemExit(f"--route takes ROLE=URL, got {item!r}")
        routes[role] = SwarmClient(url, retry_for=args.retry_for, client_id=args.client_id)
    tasks = make_tasks(args.task, args.train_size, options={"target": args.target} if args.target else None)
    mc = MultiModelClient(routes, tasks, rollouts_per_task=args.rollouts, max_tokens=args.max_tokens,
                          concurrency=args.concurrency, max_episodes=args.episodes, log_path=args.episode_log,
                          timeout_s=args.timeout_s)
    try:
        mc.run()
    except KeyboardInterrupt:
        mc.stop_event.set()
    print(f"{mc.finished} episodes, {mc.failures} failed; mean rewards "
          + ", ".join(f"{r}={sum(v) / max(1, len(v)):.3f}" for r, v in mc.rewards.items()))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command")
    p.add_argument("--servers", type=int, default=2, help="how many servers (= models = roles)")
    p.add_argument("--model-path", action="append", default=[],
                   help="model.path of server k, in order (repeat); the rest are built tiny models")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                   help="shape of the built random models (tiny: CPU; 0.5b: GPU)")
    p.add_argument("--device", default="cpu", help="cpu, cuda (server k on cuda:k mod #GPUs), cuda:N or auto")
    p.add_argument("--isolate-gpus", action="store_true",
                   help="with --device cuda: CUDA_VISIBLE_DEVICES=k for server k, which then uses cuda:0")
    p.add_argument("--steps", type=int, default=4, help="training steps per server")
    p.add_argument("--task", default="token_rule")
    p.add_argument("--train-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=2, help="batching.batch_size (tasks per step, C2)")
    p.add_argument("--rollouts", type=int, default=4, help="batching.rollouts_per_task")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--episode-timeout-s", type=float, default=120.0)
    p.add_argument("--override", action="append", default=[], help="extra config override for every server")
    p.add_argument("--token", default=os.environ.get("SWARMKIT_ADMIN_TOKEN") or DEFAULT_TOKEN)
    p.add_argument("--work-dir", default=None, help="models and server run dirs (default: a temp folder)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--episode-log", default=None, help="append one JSON line per episode")
    p.add_argument("--out", default=None, help="write the summary JSON here")
    c = sub.add_parser("client", help="only the multi-model client, against running servers")
    c.add_argument("--route", action="append", required=True, help="ROLE=URL (repeat; order = relay order)")
    c.add_argument("--task", default="token_rule")
    c.add_argument("--target", default=None, help="token_rule's target letter (edit the reward, hot-swap)")
    c.add_argument("--train-size", type=int, default=16)
    c.add_argument("--rollouts", type=int, default=4)
    c.add_argument("--max-tokens", type=int, default=6)
    c.add_argument("--concurrency", type=int, default=2)
    c.add_argument("--episodes", type=int, default=0, help="stop after this many (0 = run until killed)")
    c.add_argument("--timeout-s", type=float, default=None, help="episode deadline (default: the server's)")
    c.add_argument("--retry-for", type=float, default=300.0)
    c.add_argument("--client-id", default="multi-model-client")
    c.add_argument("--episode-log", default=None, help="append one JSON line per finished episode")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return cmd_client(args) if args.command == "client" else cmd_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
