"""Train LLM players of "Who is the Spy" through swarm servers (the paper's multi-agent case).

Every player is an LLM agent calling an OpenAI-compatible endpoint through the
``openai`` SDK; the game engine (``game.py``) runs here, on the client. One
game is one swarm episode with two roles, ``civilian`` and ``spy``: every
player of a role uses that role's key, each role gets its side's reward
(winners 1, losers 0, minus the copy penalty), and GRPO groups advantages per
(task, role): the rollouts of one word pair are compared role by role.

Two set-ups, one command each (CPU, the embedded SmolLM2 with LoRA)::

    python examples/who_is_spy/run.py shared        # one server, one model plays both sides
    python examples/who_is_spy/run.py adversarial   # civilians on server A, spies on server B
    python examples/who_is_spy/run.py adversarial --train spy   # train the spies against frozen civilians
    python examples/who_is_spy/run.py adapters      # one server, two LoRA adapters: civilians and spies

``adversarial`` routes the civilians to server A and the spies to server B
(two LoRAs of SmolLM2, or ``--model-a`` / ``--model-b``); each server learns
only from its own players' tokens. ``adapters`` does the same on one server:
one frozen base, the adapters ``civilians`` and ``spies`` (``model.adapters``),
each side's players sampling with and training their own. The side not trained is *frozen*: its part
of each game is an eval episode. A game spans both servers (or both
adapters) and is ended with :func:`swarmkit.client.swarm_episode`: both keep
it or neither does.

Before and after training, held-out word pairs are played with every part an
eval episode; the civilians' win rate (with a Wilson 95% interval), the rate
of withheld descriptions and the mean game length are printed and written to
``--out``. ``client`` runs only the game client against running servers
(``--route civilian=URL --route spy=URL``), e.g. beside another task's client.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from game import CIVILIAN, ROLES, SPY, GameConfig, deal, split_pairs  # noqa: E402
from players import OpenAISeat, Recorder, play, scripted_seat  # noqa: E402

from swarmkit.apps.processes import DEFAULT_TOKEN, ServerProc, boot_servers, launch_server, watch  # noqa: E402
from swarmkit.apps.task_client import EpisodeLoop  # noqa: E402
from swarmkit.client import SwarmClient, swarm_episode  # noqa: E402
from swarmkit.procs import peak_rss_bytes  # noqa: E402

FAMILY = "who_is_spy"
#: the ``adapters`` set-up: each side's LoRA adapter on the one server
ADAPTERS = {CIVILIAN: "civilians", SPY: "spies"}


@dataclass(frozen=True)
class SpyTask:
    """One word pair of one split: ``seed`` fixes the pair and which word the spies get."""

    task_id: str
    seed: int
    split: str


def make_spy_tasks(n: int, split: str = "train", seed: int = 0) -> list[SpyTask]:
    return [SpyTask(f"spy-{split}-{k}", seed * 100_003 + k * 7919 + (1 if split == "eval" else 0), split)
            for k in range(n)]


def pairs_of(split: str) -> tuple[tuple[str, str], ...]:
    train, held_out = split_pairs()
    return held_out if split == "eval" else train


@dataclass
class GameResult:
    task_id: str
    eval: bool
    winner: str
    rewards: dict[str, float]
    summary: dict[str, Any]
    calls: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def run_game(routes: dict[str, SwarmClient], task: SpyTask, *, config: GameConfig, eval: bool = False,
             frozen: Sequence[str] = (), max_tokens: int = 24, temperature: float = 1.0,
             http: httpx.Client | None = None, episode_seed: int | None = None,
             timeout_s: float | None = None, adapters: dict[str, str] | None = None) -> GameResult:
    """Play one game as one (multi-server) swarm episode and report each role's reward. ``adapters``:
    role → the LoRA adapter its players sample with and train (a server with ``model.adapters``)."""
    seed = random.randrange(1 << 30) if episode_seed is None else episode_seed
    game = deal(task.seed, seed, config, pairs_of(task.split))
    with swarm_episode(routes, task.task_id, eval=eval, frozen=frozen, timeout_s=timeout_s,
                       meta={"task_family": FAMILY}, adapters=adapters) as ep:
        seats = {role: OpenAISeat(ep.base_url(role), ep.key_for(role), model=f"{role}-model", max_tokens=max_tokens,
                                  temperature=temperature, http_client=http) for role in ROLES}
        rewards = play(game, seats)  # type: ignore[arg-type]
        ep.report(rewards)
    return GameResult(task.task_id, eval, str(game.winner), rewards, game.summary(),
                      sum(s.calls for s in seats.values()))


class GameClient(EpisodeLoop):
    """Keeps ``concurrency`` games running (each word pair ``rollouts_per_task`` times) until stopped."""

    def __init__(self, routes: dict[str, SwarmClient], tasks: list[SpyTask], *, config: GameConfig,
                 rollouts_per_task: int, frozen: Sequence[str] = (), max_tokens: int = 24, temperature: float = 1.0,
                 concurrency: int = 4, seed: int = 0, max_episodes: int = 0, log_path: str | None = None,
                 timeout_s: float | None = None, eval_every: int = 0, adapters: dict[str, str] | None = None):
        super().__init__(tasks, rollouts_per_task=rollouts_per_task, concurrency=concurrency,  # type: ignore[arg-type]
                         seed=seed, max_episodes=max_episodes, eval_every=eval_every)
        self._held_out = make_spy_tasks(64, "eval", seed)
        self._evals = 0
        self.routes, self.config, self.frozen = routes, config, list(frozen)
        self.max_tokens, self.temperature, self.timeout_s = max_tokens, temperature, timeout_s
        self.adapters = adapters
        self.log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
        self.results: list[GameResult] = []
        self._lock = threading.Lock()

    def run_one(self, task: Any, http: httpx.Client) -> GameResult:
        return run_game(self.routes, task, config=self.config, frozen=self.frozen, max_tokens=self.max_tokens,
                        temperature=self.temperature, http=http, timeout_s=self.timeout_s, adapters=self.adapters)

    def run_eval(self, http: httpx.Client) -> float:
        """One held-out game, every part an eval episode; 1 if the civilians won."""
        self._evals += 1
        task = self._held_out[self._evals % len(self._held_out)]
        result = run_game(self.routes, task, config=self.config, eval=True, max_tokens=self.max_tokens,
                          temperature=self.temperature, http=http, timeout_s=self.timeout_s, adapters=self.adapters)
        return float(result.winner == CIVILIAN)

    def handle(self, result: GameResult) -> None:
        with self._lock:
            self.results.append(result)
        if self.log is not None:
            self.log.write(result.to_json() + "\n")


# ----------------------------------------------------------------------------- supervised warm start
def demonstration_games(n: int, config: GameConfig, seed: int = 0, group_size: int = 1
                        ) -> list[tuple[str, dict[str, list[list[dict[str, str]]]]]]:
    """``n`` games of the scripted ``clue`` player on training word pairs, as (task id, role ->
    conversations): every prompt a player got with the answer it gave. Games come ``group_size``
    to a task id, so a batching policy that waits for N episodes per task releases them."""
    tasks = make_spy_tasks(max(1, -(-n // max(1, group_size))), "demo", seed)
    out = []
    for k in range(n):
        task = tasks[k // max(1, group_size)]
        game = deal(task.seed, seed * 7_919 + k, config, pairs_of("train"))
        seat = Recorder(scripted_seat("clue", seed=seed * 7_919 + k))
        play(game, {role: seat for role in ROLES})  # type: ignore[misc]
        out.append((task.task_id, seat.conversations))
    return out


def send_warm_start(routes: dict[str, SwarmClient], games: list[tuple[str, dict[str, list[list[dict[str, str]]]]]],
                    *, concurrency: int = 8, adapters: dict[str, str] | None = None) -> int:
    """Send each game as one (multi-server) demonstration episode: each role's turns go to the
    server (and adapter) that trains that role. Returns how many every server accepted."""

    def send(game: tuple[str, dict[str, list[list[dict[str, str]]]]]) -> bool:
        task_id, conversations = game
        with swarm_episode(routes, task_id, meta={"task_family": FAMILY}, adapters=adapters) as ep:
            for role, convs in conversations.items():
                for conv in convs:
                    ep.demonstrate(role, conv)
            answers = ep.report(dict.fromkeys(ROLES, 1.0))  # the reward is not used for demonstrated turns
        return all(a.get("accepted") for a in answers.values())

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(send, games))


# ----------------------------------------------------------------------------- evaluation
def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """Share k/n and its Wilson 95% interval (low, high)."""
    if n == 0:
        return math.nan, math.nan, math.nan
    p = k / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return p, max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class EvalSummary:
    games: int
    civilian_wins: int
    withheld_rate: float
    mean_rounds: float
    failed: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def civilian_win_rate(self) -> tuple[float, float, float]:
        return wilson(self.civilian_wins, self.games)

    def line(self) -> str:
        p, lo, hi = self.civilian_win_rate
        return (f"civilians win {p:.3f} [{lo:.3f}, {hi:.3f}] (spies {1 - p:.3f}) over {self.games} games; "
                f"withheld descriptions {self.withheld_rate:.3f}; {self.mean_rounds:.2f} rounds"
                + (f"; {self.failed} failed" if self.failed else ""))

    def to_dict(self) -> dict[str, Any]:
        p, lo, hi = self.civilian_win_rate
        return {"games": self.games, "civilian_win_rate": p, "ci95": [lo, hi], "withheld_rate": self.withheld_rate,
                "mean_rounds": self.mean_rounds, "failed": self.failed}


def evaluate_games(routes: dict[str, SwarmClient], tasks: list[SpyTask], *, config: GameConfig, max_tokens: int,
                   temperature: float, concurrency: int = 8, games_per_task: int = 1,
                   adapters: dict[str, str] | None = None) -> EvalSummary:
    """Held-out games with every part an eval episode (nothing trained), fixed seatings."""
    jobs = [(t, 10_000 + 31 * t.seed + k) for t in tasks for k in range(games_per_task)]

    def one(job: tuple[SpyTask, int], http: httpx.Client) -> GameResult | None:
        task, seat_seed = job
        try:
            return run_game(routes, task, config=config, eval=True, max_tokens=max_tokens, temperature=temperature,
                            http=http, episode_seed=seat_seed, adapters=adapters)
        except Exception as exc:  # noqa: BLE001 - a failed game is counted, not fatal
            print(f"  eval game {task.task_id} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None

    with httpx.Client(timeout=600.0) as http, ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda j: one(j, http), jobs))
    done = [r for r in results if r is not None]
    said = sum(len(r.summary["descriptions"]) for r in done)  # type: ignore[arg-type]
    withheld = sum(int(r.summary["withheld"]) for r in done)  # type: ignore[call-overload]
    return EvalSummary(
        games=len(done), civilian_wins=sum(r.winner == CIVILIAN for r in done),
        withheld_rate=withheld / said if said else math.nan,
        mean_rounds=sum(int(r.summary["rounds"]) for r in done) / max(1, len(done)),  # type: ignore[call-overload]
        failed=len(results) - len(done), results=[r.summary for r in done])


# ----------------------------------------------------------------------------- set-ups
def server_overrides(model: str, name: str, args: argparse.Namespace, *, total_steps: int | None = None,
                     adapters: Sequence[str] = ()) -> list[str]:
    """The config one server trains with (``--warm-start`` supervised steps, then ``--steps`` RL steps;
    ``total_steps`` over all its ``adapters`` when it trains several)."""
    total = args.warm_start + args.steps if total_steps is None else total_steps
    out = [*model_overrides(model), f"model.name={name}", "batching=c2", f"batching.batch_size={args.batch_size}",
           f"batching.rollouts_per_task={args.rollouts}", f"trainer.total_steps={total}",
           f"optim.sft_lr={args.sft_lr}",
           "trainer.checkpoint_every=0", f"server.episode_timeout_s={args.episode_timeout_s}",
           "server.drain_timeout_s=120", "server.drain_idle_s=120"]
    if args.lr is not None:
        out.append(f"optim.lr={args.lr}")
    if adapters:  # LoRA rank 8 (SmolLM2's default; the tiny model has none), one adapter per side
        out += ["model.lora_rank=8", f"model.adapters=[{','.join(adapters)}]"]
    return out + list(args.override)


def model_overrides(model: str) -> list[str]:
    if model in ("smollm2", "tiny"):
        return [f"model={model}"]
    return ["model=smollm2", f"model.path={model}"]


def cmd_train(args: argparse.Namespace) -> int:
    """``shared`` / ``adversarial`` / ``adapters``: start the server(s), evaluate, train, evaluate again."""
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="swarmkit-spy-"))
    two_policies = args.command in ("adversarial", "adapters")
    sides = {CIVILIAN: "a", SPY: "b"} if args.command == "adversarial" else {CIVILIAN: "a", SPY: "a"}
    adapters = dict(ADAPTERS) if args.command == "adapters" else None
    models = {"a": args.model_a or args.model, "b": args.model_b or args.model}
    trained = [CIVILIAN, SPY] if args.train == "both" or not two_policies else [args.train]
    frozen = [r for r in ROLES if r not in trained]
    # the steps each server counts: on the adapters' server, every adapter's warm start and the trained ones' RL
    warm_steps = args.warm_start * (len(ROLES) if adapters else 1)
    total_steps = warm_steps + args.steps * (len(trained) if adapters else 1)
    config = GameConfig(players=args.players, spies=args.spies, max_rounds=args.max_rounds)
    t0 = time.perf_counter()
    servers: dict[str, ServerProc] = {}
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still stops the servers (finally)
    try:
        for s in sorted(set(sides.values())):
            servers[s] = launch_server(s, work / f"server_{s}", token=args.token)
        # a frozen side's server (or adapter) never trains: its episodes are eval parts
        boot_servers(list(servers.values()),
                     {s: server_overrides(models[s], f"{s}-model", args, total_steps=total_steps,
                                          adapters=list(adapters.values()) if adapters else ()) for s in servers},
                     timeout=args.timeout)
        routes = {role: SwarmClient(servers[s].url, retry_for=args.timeout, client_id="spy-client")
                  for role, s in sides.items()}
        for s, proc in servers.items():
            roles = [r for r, x in sides.items() if x == s]
            shown = [f"{r} (adapter {adapters[r]}{', frozen' if r in frozen else ''})" for r in roles] if adapters \
                else roles
            print(f"server {s}: {proc.url}  model {models[s]}  roles {', '.join(shown)}"
                  f"{'  (frozen)' if not adapters and all(r in frozen for r in roles) else ''}  run dir {proc.run_dir}")
        held_out = make_spy_tasks(args.eval_games, "eval", args.seed)
        ev = {"max_tokens": args.max_tokens, "temperature": args.eval_temperature, "concurrency": args.concurrency,
              "adapters": adapters}
        before = evaluate_games(routes, held_out, config=config, **ev) if args.eval_before else None
        if before is not None:
            print(f"eval before training: {before.line()}", flush=True)
        warm = None
        if args.warm_start:
            group = args.rollouts
            games = demonstration_games(args.warm_start * args.batch_size * group, config, args.seed, group)
            t_warm = time.perf_counter()
            sent = send_warm_start(routes, games, concurrency=args.concurrency, adapters=adapters)
            print(f"warm start: {sent} demonstrated games of the scripted clue player "
                  f"({sum(len(c) for _, g in games for c in g.values())} conversations)", flush=True)
            watch(list(servers.values()), warm_steps, args.timeout)
            warm = evaluate_games(routes, held_out, config=config, **ev)
            print(f"eval after the warm start ({time.perf_counter() - t_warm:.0f} s): {warm.line()}", flush=True)
        client = GameClient(routes, make_spy_tasks(args.train_size, "train", args.seed), config=config,
                            rollouts_per_task=args.rollouts, frozen=frozen, max_tokens=args.max_tokens,
                            temperature=args.temperature, concurrency=args.concurrency, seed=args.seed,
                            log_path=args.episode_log, adapters=adapters).start()
        t_train = time.perf_counter()
        to_watch = [servers[sides[r]] for r in trained]
        metrics = watch(list({p.role: p for p in to_watch}.values()), total_steps, args.timeout, client)
        client.stop()
        train_s = time.perf_counter() - t_train
        after = evaluate_games(routes, held_out, config=config, **ev)
        print(f"eval after training:  {after.line()}")
        train_games = client.results
        summary = {
            "setup": args.command, "trained": trained, "frozen": frozen, "models": models,
            "eval_before": before.to_dict() if before else None, "eval_after_warm_start": warm.to_dict() if warm else None,
            "eval_after": after.to_dict(), "warm_start_steps": args.warm_start,
            "train_games": len(train_games), "failed_games": client.failures,
            "train_civilian_win_rate": wilson(sum(g.winner == CIVILIAN for g in train_games), len(train_games))[0],
            "steps": {s: rows for s, rows in metrics.items()}, "train_wall_s": train_s,
            "train_games_per_min": 60 * len(train_games) / train_s if train_s > 0 else None,
            "adapters": adapters, "wall_s": time.perf_counter() - t0,
            # the peak resident set of each server process (and its children): one base vs two models
            "server_peak_rss_bytes": {s: peak_rss_bytes(p.proc.pid) for s, p in servers.items()},
        }
        rss = sum(summary["server_peak_rss_bytes"].values())
        print(f"{len(train_games)} training games ({client.failures} failed) in {train_s:.0f} s; "
              f"total {summary['wall_s']:.0f} s; servers' peak memory {rss / 2**20:.0f} MiB")
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        for proc in servers.values():
            with contextlib.suppress(Exception):
                proc.client(retry_for=5).stop()
            proc.stop()
        signal.signal(signal.SIGTERM, previous)


def cmd_client(args: argparse.Namespace) -> int:
    routes: dict[str, SwarmClient] = {}
    for item in args.route:
        role, _, url = item.partition("=")
        if role not in ROLES or not url:
            raise SystemExit(f"--route takes civilian=URL or spy=URL, got {item!r}")
        routes[role] = SwarmClient(url, retry_for=args.retry_for, client_id=args.client_id)
    if set(routes) != set(ROLES):
        raise SystemExit("give a --route for both civilian and spy (the same URL for one shared model)")
    adapters: dict[str, str] = {}
    for item in args.adapter:
        role, _, name = item.partition("=")
        if role not in ROLES or not name:
            raise SystemExit(f"--adapter takes civilian=NAME or spy=NAME, got {item!r}")
        adapters[role] = name
    config = GameConfig(players=args.players, spies=args.spies, max_rounds=args.max_rounds)
    client = GameClient(routes, make_spy_tasks(args.train_size, "train", args.seed), config=config,
                        rollouts_per_task=args.rollouts, frozen=args.frozen, max_tokens=args.max_tokens,
                        temperature=args.temperature, concurrency=args.concurrency, seed=args.seed,
                        max_episodes=args.episodes, log_path=args.episode_log, timeout_s=args.timeout_s,
                        eval_every=args.eval_every, adapters=adapters or None)
    with contextlib.suppress(KeyboardInterrupt):
        client.run()
    wins = sum(g.winner == CIVILIAN for g in client.results)
    print(f"{client.finished} games ({client.failures} failed); civilians won {wins}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def game_args(q: argparse.ArgumentParser) -> None:
        q.add_argument("--players", type=int, default=4)
        q.add_argument("--spies", type=int, default=1)
        q.add_argument("--max-rounds", type=int, default=3)
        q.add_argument("--max-tokens", type=int, default=24, help="per description (votes get 8)")
        q.add_argument("--temperature", type=float, default=1.0, help="while training")
        q.add_argument("--train-size", type=int, default=24, help="training word-pair tasks")
        q.add_argument("--rollouts", type=int, default=4, help="games per task (batching.rollouts_per_task)")
        q.add_argument("--concurrency", type=int, default=4, help="games at once")
        q.add_argument("--seed", type=int, default=0)
        q.add_argument("--episode-log", default=None, help="append one JSON line per game")

    helps = {"shared": "one server, one model plays both sides",
             "adversarial": "civilians on server A, spies on server B",
             "adapters": "one server, two LoRA adapters of one base: civilians and spies"}
    for name, text in helps.items():
        t = sub.add_parser(name, help=text)
        game_args(t)
        t.add_argument("--model", default="smollm2", help="smollm2, tiny, or a local HF model folder")
        t.add_argument("--model-a", default=None, help="(adversarial) server A's model (civilians)")
        t.add_argument("--model-b", default=None, help="(adversarial) server B's model (spies)")
        t.add_argument("--train", default="civilian", choices=["civilian", "spy", "both"],
                       help="(adversarial, adapters) which side learns; the other is frozen")
        t.add_argument("--steps", type=int, default=8, help="training steps (of each trained server or adapter)")
        t.add_argument("--batch-size", type=int, default=2, help="word pairs per step (batching.batch_size)")
        t.add_argument("--lr", type=float, default=None, help="optim.lr (default: the packaged optim option)")
        t.add_argument("--warm-start", type=int, default=0, metavar="STEPS",
                       help="supervised steps first, each of batch-size x rollouts games of the scripted clue "
                            "player (demonstrations), then an eval")
        t.add_argument("--sft-lr", type=float, default=2e-3, help="optim.sft_lr (the warm start's steps)")
        t.add_argument("--eval-before", action=argparse.BooleanOptionalAction, default=True,
                       help="evaluate the untrained model first")
        t.add_argument("--eval-games", type=int, default=48, help="held-out games before and after")
        t.add_argument("--eval-temperature", type=float, default=0.7)
        t.add_argument("--episode-timeout-s", type=float, default=600.0)
        t.add_argument("--override", action="append", default=[], help="extra config override for every server")
        t.add_argument("--token", default=os.environ.get("SWARMKIT_ADMIN_TOKEN") or DEFAULT_TOKEN)
        t.add_argument("--work-dir", default=None, help="server run dirs (default: a temp folder)")
        t.add_argument("--timeout", type=float, default=7200.0)
        t.add_argument("--out", default=None, help="write the summary JSON here")
    c = sub.add_parser("client", help="only the game client, against running servers")
    game_args(c)
    c.add_argument("--route", action="append", required=True, help="civilian=URL and spy=URL")
    c.add_argument("--adapter", action="append", default=[],
                   help="civilian=NAME, spy=NAME: the role's LoRA adapter on a server with model.adapters")
    c.add_argument("--frozen", action="append", default=[], choices=list(ROLES), help="a role played, not trained")
    c.add_argument("--episodes", type=int, default=0, help="stop after this many games (0 = until killed)")
    c.add_argument("--timeout-s", type=float, default=None, help="episode deadline (default: the server's)")
    c.add_argument("--retry-for", type=float, default=600.0)
    c.add_argument("--client-id", default="spy-client")
    c.add_argument("--eval-every", type=int, default=0,
                   help="play one held-out eval game after every this many training games")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return cmd_client(args) if args.command == "client" else cmd_train(args)


if __name__ == "__main__":
    raise SystemExit(main())
