"""The swarm server's core, without HTTP: life cycle, episodes, inference calls, status.

:class:`SwarmServer` holds what every endpoint shares (``app.state.swarm``,
never module globals). What happens to an accepted episode is the job of its
:class:`Cycle`, passed in the constructor: the training cycle
(:class:`swarmkit.swarm.cycle.TrainingCycle`: journal, batching policy,
trainer) or :class:`MemoryCycle` (kept in memory; tests and demos). The
cycle drives the state machine through :meth:`SwarmServer.enter_rolling_post`,
:meth:`SwarmServer.drain`, :meth:`SwarmServer.enter_weight_syncing` and
:meth:`SwarmServer.resume_rolling`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import logging
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from swarmkit.config.plain import as_dict, with_adapters
from swarmkit.config.schema import (
    REPLICA_KEYS,
    AdapterSpec,
    ModelConfig,
    ReplicaConfig,
    ServerConfig,
)
from swarmkit.config.validate import adapter_batching
from swarmkit.contract import GenerationOutput, InferenceBackend, PromptScores, SamplingParams
from swarmkit.contract.backend import ROUTING_KEY
from swarmkit.errors import ApiError, ConfigError, busy
from swarmkit.plugins import get_hooks, get_registry, load_component
from swarmkit.swarm.atomic import resolve_prepared
from swarmkit.swarm.auth import AdminAuth, ClientAuth, redacted
from swarmkit.swarm.episodes import (
    ABORTED,
    COMMITTING,
    FINISHED,
    PREPARED,
    RUNNING,
    Episode,
    EpisodeRegistry,
)
from swarmkit.swarm.families import EvalTally
from swarmkit.swarm.gateway import InferenceGateway
from swarmkit.swarm.presence import ClientTracker
from swarmkit.swarm.replicas import ReplicaSet, build_replicas, check_replicable
from swarmkit.swarm.state import SERVING_STATES, ServerState, StateMachine
from swarmkit.timelines.render import TokenText
from swarmkit.timelines.strict_tools import check_mode
from swarmkit.timelines.track import ContextTracker

#: the deepest a registration's or report's ``meta`` may nest (deeper ones broke every reader of the episode)
MAX_META_DEPTH = 32


def _depth(value: Any, limit: int = MAX_META_DEPTH + 1) -> int:
    """Nesting depth of JSON-like ``value`` (lists and dicts), counted up to ``limit``, iteratively."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            if d >= limit:
                return d
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


log = logging.getLogger("swarmkit.server")

#: a drain that lasts this long is logged at INFO (what it waits for); a shorter one only at DEBUG
SLOW_DRAIN_S = 10.0
#: the run dir's record of state moves: one ``{"time", "state"}`` JSON line per move
STATES_FILE = "states.jsonl"

SLOW_STOP_S = 20.0
"""A stop that takes longer logs every thread's stack (a hung engine shows where it hangs)."""

BackendFactory = Callable[[Any], InferenceBackend]


def log_thread_stacks(why: str) -> None:
    """Log the stack of every thread of this process at WARNING (a diagnosis of a hang)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"{why}; the threads are at:"]
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)))
    log.warning("%s", "\n".join(parts))


class Cycle(Protocol):
    """What a server hands accepted episodes to, and asks at boot, stop, status and checkpoint.

    The cycle owns training progress: ``global_step`` and ``training_finished`` are written by the
    cycle only; the server reads them (its status, admission and run-end hooks).
    """

    #: training steps applied and served
    global_step: int
    #: why no further step trains (training episodes are then refused); None while training goes on
    training_finished: str | None

    @property
    def active_window_s(self) -> float | None:
        """How long a client counts as active after it was last heard (the batching policy's); None:
        the server's default."""

    def attach(self, server: SwarmServer) -> None:
        """Called once by the server's constructor."""

    def accept(self, ep: Episode) -> Awaitable[None] | None:
        """Take a finished training episode; raise to refuse it (the reporter retries)."""

    def status(self) -> dict[str, Any]:
        """The ``pool`` part of the server's status."""

    def checkpoint(self, folder_for: Callable[[int], Path]) -> dict[str, Any] | None | Awaitable[dict[str, Any] | None]:
        """Save trainer state into ``folder_for(step)``, ``step`` being the one it is saved at
        (``{"path", "global_step"}``); None when there is none."""

    def waiting(self) -> list[Any]:
        """The accepted episodes waiting for a step (``task_id``, ``task_family``, ``reward``)."""

    def record_eval(self, metrics: dict[str, float]) -> None:
        """Record an eval round's rewards (``eval_reward/<family>``...) at the current step."""

    def resume_training(self) -> dict[str, Any]:
        """Training goes on after the collapse alarm paused it (``{"resumed": bool, "global_step"}``)."""

    def pacing(self, task_id: str | None = None) -> tuple[str, float] | None:
        """Why a new training episode of ``task_id`` must wait and about how long (asynchronous
        training's staleness bound); None: admit it."""

    async def after_boot(self) -> None:
        """The model is loaded: build the trainer, start the loop (raising fails the boot)."""

    async def before_stop(self) -> None:
        """The server stops: stop the loop, free the trainer."""

    async def add_adapter(self, spec: AdapterSpec, policy: Any, backend: InferenceBackend) -> None:
        """Train and serve adapter ``spec`` too from now on (``backend`` serves it; ``policy``: its own batching
        policy, None = the shared one); raising leaves everything as it was."""


class MemoryCycle:
    """Keeps accepted episodes in memory and never trains (tests, demos, eval-only servers).

    :param on_accept: called with each accepted episode (raise to refuse it).
    """

    active_window_s = None

    def __init__(self, on_accept: Callable[[Episode], Any] | None = None):
        self.on_accept = on_accept
        self.accepted: list[Episode] = []
        self.global_step = 0
        self.training_finished: str | None = None

    def attach(self, server: SwarmServer) -> None:
        pass

    def accept(self, ep: Episode) -> Awaitable[None] | None:
        result = self.on_accept(ep) if self.on_accept is not None else None
        self.accepted.append(ep)
        return result

    def status(self) -> dict[str, Any]:
        return {"episodes": len(self.accepted), "tasks": len({e.task_id for e in self.accepted})}

    def checkpoint(self, folder_for: Callable[[int], Path]) -> None:
        return None

    def waiting(self) -> list[Any]:
        return []

    def record_eval(self, metrics: dict[str, float]) -> None:
        pass

    def resume_training(self) -> dict[str, Any]:
        return {"resumed": False, "global_step": 0}

    def pacing(self, task_id: str | None = None) -> tuple[str, float] | None:
        return None

    async def after_boot(self) -> None:
        pass

    async def before_stop(self) -> None:
        pass

    async def add_adapter(self, spec: AdapterSpec, policy: Any, backend: InferenceBackend) -> None:
        await backend.add_adapter(spec.name)


class SwarmServer:
    """State shared by every endpoint of one server process.

    :param server_cfg: the ``server`` config group (host, port, run_dir,
        admin_token, episode_timeout_s, drain_timeout_s, max_body_bytes).
    :param config: a validated training config to start with (optional; a
        controller can send one later).
    :param backend_factory: builds the inference backend from the training
        config; default: the registry's ``backend`` component.
    :param cycle: what happens to accepted episodes (see :class:`Cycle`);
        default: :class:`MemoryCycle` (kept in memory, never trained).
    :param admin_token: overrides ``server.admin_token``.
    :param renderer_factory: ``tokenizer -> renderer``; default
        :class:`swarmkit.timelines.render.ChatRenderer`.
    """

    def __init__(
        self,
        server_cfg: Any = None,
        *,
        config: Any = None,
        backend_factory: BackendFactory | None = None,
        cycle: Cycle | None = None,
        admin_token: str | None = None,
        renderer_factory: Callable[[Any], Any] | None = None,
    ):
        scfg = ServerConfig(**as_dict(server_cfg))
        self.server_cfg = scfg
        self.host: str = scfg.host
        self.port: int = int(scfg.port)
        self.run_dir: Path | None = Path(scfg.run_dir) if scfg.run_dir and scfg.run_dir != "auto" else None
        self._apply_limits(scfg)
        #: how calls of strict tools are kept to their schema once booted (constrain or check; server.strict_tools)
        self.strict_tools = "check"
        self._next_resolve: dict[str, float] = {}  # prepared episode id -> when to ask its primary again
        self.max_body_bytes = int(scfg.max_body_bytes)
        self.public_url: str | None = scfg.public_url.rstrip("/") if scfg.public_url else None
        self.auth = AdminAuth(admin_token or scfg.admin_token, self.run_dir)
        self.client_auth = ClientAuth(scfg.client_token)
        self.state = StateMachine()
        self.episodes = EpisodeRegistry(default_timeout_s=self.episode_timeout_s, on_end=self._on_episode_end)
        #: eval rewards per task family since the last training step (logged with the step)
        self.eval_tally = EvalTally()
        self.clients = ClientTracker()
        self.config: Any = config
        #: the config the running model was booted with (``config`` may be a newer one for the next start)
        self._booted_config: Any = None
        self._adapter_lock = asyncio.Lock()
        #: (algo name, its declared credit) once per-call rewards asked (check_call_rewards)
        self._algo_credit: tuple[str, str] | None = None
        self.backend_factory = backend_factory
        #: the pool + trainer (or a stand-in) that accepted episodes go to
        self.cycle: Cycle = cycle if cycle is not None else MemoryCycle()
        #: the served model: engine, renderers, tracker, per-token text, context limit (loaded at boot)
        self.inference = InferenceGateway(renderer_factory)
        #: when the training step under way began, and how long the last one took (for Retry-After)
        self.cycle_started = 0.0
        self.last_cycle_s: float | None = None
        self.started_at: float | None = None
        self.created_at = time.time()
        self._boot_task: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None
        self.reaper_interval_s = 0.25
        self.cycle.attach(self)
        if self.run_dir is not None:
            self.state.add_listener(self._record_state)

    def _record_state(self, old: ServerState, new: ServerState) -> None:
        """Append the move to ``<run_dir>/states.jsonl`` (the dashboard of a finished run reads it)."""
        assert self.run_dir is not None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / STATES_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": self.state.since, "state": str(new)}) + "\n")

    # ------------------------------------------------------------------ properties
    # what the routes read of the served model (the inference gateway owns it)
    @property
    def backend(self) -> InferenceBackend | None:
        return self.inference.backend

    @property
    def renderer(self) -> Any:
        return self.inference.renderer

    @property
    def tracker(self) -> ContextTracker | None:
        return self.inference.tracker

    @property
    def token_text(self) -> TokenText | None:
        return self.inference.token_text

    @property
    def max_context(self) -> int | None:
        return self.inference.max_context

    @property
    def model_name(self) -> str:
        return self.inference.model_name

    @property
    def adapters(self) -> list[str]:
        """The LoRA adapters served and trained over one base (``model.adapters``); [] = one model."""
        return self.inference.adapters

    def check_adapter(self, name: str | None) -> str | None:
        """An episode's adapter given at registration: one this server serves (422 otherwise)."""
        if name is None:
            return None
        if name not in self.adapters:
            served = f"its adapters are {self.adapters}" if self.adapters else "it serves one model (no model.adapters)"
            raise ApiError(422, f"adapter {name!r} is not served by this server; {served}", "invalid_field",
                           param="adapter")
        return name

    def adapter_for(self, ep: Episode, model: str | None) -> str | None:
        """The adapter a call of ``ep`` samples with: the episode's (bound at registration, or by the
        first call whose ``model`` names an adapter). Once the episode has one, a ``model`` that names
        no adapter (absent, the served model's name, or a framework's fixed name) samples with it, as a
        server of one model ignores the field; another adapter's name is 400 ``adapter_mismatch``. An
        episode without one: 404 ``model_not_found`` for a name that is no adapter, 400
        ``adapter_required`` when the call names none. None on a server of one model."""
        adapters = self.adapters
        if not adapters:
            return None
        if model is not None and model not in adapters and ep.adapter is None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here: this server trains the adapters {adapters} "
                           f"over {self.model_name!r}; name one in 'model' (or with 'adapter' at registration)",
                           "model_not_found", param="model")
        if model is not None and model in adapters:
            if ep.adapter is None:
                ep.adapter = model  # the episode's first call binds it: its samples train this adapter only
            elif ep.adapter != model:
                raise ApiError(400, f"this episode samples with adapter {ep.adapter!r}, not {model!r}: one episode "
                               "trains one adapter (register another episode for it)", "adapter_mismatch",
                               param="model")
        if ep.adapter is None:
            raise ApiError(400, f"this server trains several adapters {adapters}: name one in the request's "
                           "'model' field or with 'adapter' at registration", "adapter_required", param="model")
        return ep.adapter

    def renderer_for(self, template_kwargs: dict[str, Any] | None) -> Any:
        return self.inference.renderer_for(template_kwargs)

    def room_for(self, prompt_len: int) -> int:
        return self.inference.room_for(prompt_len)

    @property
    def global_step(self) -> int:
        """Training steps applied and served (the cycle's; read-only here)."""
        return int(self.cycle.global_step)

    @property
    def training_finished(self) -> str | None:
        """Why this server trains no more (the cycle's); training episodes are then refused."""
        return self.cycle.training_finished

    @property
    def tokenizer(self) -> Any:
        return self.inference.tokenizer

    @property
    def policy_version(self) -> int:
        return self.inference.policy_version(self.global_step)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_token(self) -> str:
        return self.auth.token

    @property
    def admin_token_source(self) -> str:
        return self.auth.source

    # ------------------------------------------------------------------ auth
    def check_admin(self, token: str | None) -> None:
        """401 without a token, 403 with a wrong one."""
        self.auth.check(token)

    def _apply_limits(self, scfg: ServerConfig) -> None:
        """The ``server`` settings a training config may change at boot: timeouts, drain, reward bound."""
        self.episode_timeout_s = float(scfg.episode_timeout_s)
        self.drain_timeout_s = float(scfg.drain_timeout_s)
        self.drain_idle_s = float(scfg.drain_idle_s)
        self.prepared_grace_s = float(scfg.prepared_grace_s)
        self.max_abs_reward = float(scfg.max_abs_reward)
        self.strict_fields = bool(scfg.strict_fields)
        self.strict_tools_setting = str(scfg.strict_tools)
        self.max_running_episodes = int(scfg.max_running_episodes)
        self.max_running_per_client = int(scfg.max_running_per_client)
        self.max_running_per_address = (int(scfg.max_running_per_address) if scfg.max_running_per_address is not None
                                        else max(1, self.max_running_episodes // 2))
        self.max_calls_per_episode = int(scfg.max_calls_per_episode)
        self.max_tokens_per_request = int(scfg.max_tokens_per_request)
        self.max_meta_bytes = int(scfg.max_meta_bytes)
        self.max_journal_bytes = int(scfg.max_journal_bytes)
        self.min_free_disk_bytes = int(scfg.min_free_disk_bytes)

    def check_client(self, token: str | None) -> None:
        """A sampling client's call (register, vote, heartbeat): the client token when one is set."""
        self.client_auth.check(token, self.auth)

    def is_admin(self, token: str | None) -> bool:
        return self.auth.is_admin(token)

    def authorize_any(self, token: str | None) -> None:
        """Admin token or any known episode key (``GET /v1/models``)."""
        if self.is_admin(token):
            return
        self.episodes.by_key(token)

    async def authorize_call(self, key: str | None) -> tuple[Episode, str | None]:
        """The running episode (and role) of an inference call's key."""
        ep, role = self.episodes.by_key(key)
        self.episodes.check_open(ep)
        if ep.n_calls >= self.max_calls_per_episode:
            raise ApiError(429, f"episode '{ep.id}' made {ep.n_calls} calls, this server's limit "
                           "(server.max_calls_per_episode); end it and register another", "too_many_calls")
        if ep.client_id:
            self.clients.touch(ep.client_id)
        state = self.state.state
        if state not in SERVING_STATES and state is not ServerState.WEIGHT_SYNCING:
            raise busy(f"the server is {state}: no model is being served", 2.0, "server_offline")
        return ep, role

    def admit_episode(self, task_id: str, *, is_eval: bool, client_id: str, address: str = "") -> None:
        """Whether a new episode may be registered now: 503 while no step is being rolled out (with
        Retry-After), 409 ``training_finished`` for a training episode past the step limit, 503
        ``staleness_bound`` while asynchronous training paces it, 429 past the running-episode quotas
        (in all, per client id, per registering ``address``).
        The one place of episode admission (an inference call's is :meth:`authorize_call`)."""
        state = self.state.state
        if state is not ServerState.ROLLING:
            if state in (ServerState.ROLLING_POST, ServerState.WEIGHT_SYNCING):
                raise busy(f"server busy ({state}: a training step is being prepared); retry later",
                           self.expected_busy_s())
            if state is ServerState.BOOTING:
                raise busy("server busy (BOOTING: loading the model); retry later", 2.0, "server_booting")
            raise busy("the server is OFFLINE (not configured or stopped); retry later", 2.0, "server_offline")
        if self.training_finished and not is_eval:
            raise ApiError(409, self.training_finished, "training_finished", param="eval")
        if not is_eval:
            paced = self.cycle.pacing(task_id)
            if paced is not None:
                raise busy(paced[0], paced[1], "staleness_bound")
        self.check_quota(client_id, address)

    def check_quota(self, client_id: str, address: str = "") -> None:
        """429 when a registration would pass the running-episode quotas."""
        if self.episodes.running_count() >= self.max_running_episodes:
            raise ApiError(429, f"{self.episodes.running_count()} episodes are running, this server's limit "
                           "(server.max_running_episodes); end some first", "too_many_episodes",
                           headers={"Retry-After": "1"})
        if self.episodes.running_count(client_id) >= self.max_running_per_client:
            raise ApiError(429, f"client '{client_id}' has {self.max_running_per_client} running episodes, the limit "
                           "per client (server.max_running_per_client); end some first", "too_many_episodes",
                           headers={"Retry-After": "1"})
        if address and self.episodes.running_count(address=address) >= self.max_running_per_address:
            raise ApiError(429, f"{self.max_running_per_address} running episodes were registered from this address, "
                           "the limit per address (server.max_running_per_address), whatever client ids it sends; "
                           "end some first", "too_many_episodes", headers={"Retry-After": "1"})

    def check_call_rewards(self, ep: Episode) -> None:
        """422 ``unsupported_field`` when per-call rewards of a training episode would go unused: this
        server trains with an algorithm whose credit is per episode (``grpo``, ``ppo``). Eval episodes and
        servers that do not train keep them (the dashboard shows them)."""
        if ep.eval or isinstance(self.cycle, MemoryCycle) or self.config is None:
            return
        name = str((as_dict(self.config).get("algo") or {}).get("name") or "")
        if not name:
            return
        if self._algo_credit is None or self._algo_credit[0] != name:
            from swarmkit.plugins import load_component

            self._algo_credit = (name, str(getattr(load_component("algo", name), "credit", "episode")))
        if self._algo_credit[1] != "turn":
            raise ApiError(422, f"'call_rewards' need an algorithm with per-turn credit (e.g. algo=turn_grpo); this "
                           f"server trains with algo={name}, which gives every token of an episode its one advantage",
                           "unsupported_field", param="call_rewards")

    def check_meta(self, meta: Any, param: str = "meta") -> None:
        """422 when a ``meta`` object is larger than ``server.max_meta_bytes`` as JSON, nested deeper than
        :data:`MAX_META_DEPTH`, or holds NaN or Infinity (which strict JSON readers, the dashboard's and the
        admin episode list's among them, cannot read back)."""
        if _depth(meta) > MAX_META_DEPTH:
            raise ApiError(422, f"'{param}' is nested deeper than {MAX_META_DEPTH} levels", "invalid_field",
                           param=param)
        try:
            text = json.dumps(meta, ensure_ascii=False, default=str, allow_nan=False)
        except ValueError:
            raise ApiError(422, f"'{param}' holds NaN or Infinity, which JSON cannot carry", "invalid_field",
                           param=param) from None
        size = len(text.encode())
        if size > self.max_meta_bytes:
            raise ApiError(422, f"'{param}' is {size} bytes as JSON, over this server's limit of "
                           f"{self.max_meta_bytes} (server.max_meta_bytes)", "invalid_field", param=param)

    def check_tokens(self, requested: int) -> None:
        """400 when one inference request asks for more tokens than ``server.max_tokens_per_request``."""
        if requested > self.max_tokens_per_request:
            raise ApiError(400, f"this request asks for up to {requested} tokens (n x max_tokens), over this "
                           f"server's limit of {self.max_tokens_per_request} (server.max_tokens_per_request)",
                           "too_many_tokens", param="max_tokens")

    def touch_client(self, client_id: str | None) -> None:
        if client_id:
            self.clients.touch(client_id[:128])

    # ------------------------------------------------------------------ inference calls
    async def wait_serving(self, ep: Episode) -> None:
        """Return when the model can be called (waits out WEIGHT_SYNCING)."""
        if self.state.state in SERVING_STATES:
            return
        if self.state.state is ServerState.WEIGHT_SYNCING:
            ok = await self.state.wait_for(SERVING_STATES, timeout=max(0.0, ep.deadline - time.time()))
            if ok and self.state.state in SERVING_STATES:
                self.episodes.check_open(ep)
                return
        self.episodes.check_open(ep)
        raise busy(f"the server is {self.state.state}: no model is being served", 2.0, "server_offline")

    def begin_call(self, ep: Episode) -> None:
        ROUTING_KEY.set(ep.id)  # the call's task (and the engine calls it awaits) carry its episode
        ep.in_flight += 1
        ep.last_active = time.time()

    def end_call(self, ep: Episode) -> None:
        ep.in_flight -= 1
        ep.last_active = time.time()

    async def generate(self, ep: Episode, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        """Generate for an episode's call; 410/409 if it ended meanwhile."""
        self.begin_call(ep)
        try:
            await self.wait_serving(ep)
            outputs = await self.inference.generate(prompt_ids, params)
        finally:
            self.end_call(ep)
        self.episodes.check_open(ep)
        return outputs

    async def score_prompt(self, ep: Episode, prompt_ids: list[int], top_logprobs: int = 0) -> PromptScores:
        """Score a prompt for an episode's call (``echo``): counted in flight like a generation and run on
        the served weights, but never recorded (a scoring call is not a sample of the policy)."""
        self.begin_call(ep)
        try:
            await self.wait_serving(ep)
            scores = await self.inference.score_prompt(prompt_ids, top_logprobs)
        finally:
            self.end_call(ep)
        self.episodes.check_open(ep)
        return scores

    # ------------------------------------------------------------------ life cycle
    def set_config(self, cfg: Any) -> None:
        self.config = cfg

    async def checkpoint(self, folder_for: Callable[[int], Path]) -> dict[str, Any] | None:
        """Trainer state saved by the cycle into ``folder_for(its step)`` (None: nothing to save)."""
        result = self.cycle.checkpoint(folder_for)
        if inspect.isawaitable(result):
            result = await result
        return result

    def resume_training(self) -> dict[str, Any]:
        """Training goes on after the collapse alarm paused it (the cycle owns the pause)."""
        return dict(self.cycle.resume_training())

    async def add_adapter(self, entry: Any) -> dict[str, Any]:
        """Adapter ``entry`` (a name, or ``{name, lr, batching}`` as in ``model.adapters``) trained and served
        over the base from now on, without a restart (``POST /api/v1/admin/adapters``): fresh, at step 0, as
        if ``model.adapters`` had listed it last. The running config lists it from then on (checkpoints,
        ``status``; a restart with ``trainer.resume`` brings it back with what it learned).

        :raises ApiError: 409 when the server is not running or serves one model (no ``model.adapters``);
            422 for an entry ``model.adapters`` would refuse, a name served already, or one adapter past
            ``model.max_adapters``.
        """
        async with self._adapter_lock:
            state = self.state.state
            backend = self.backend
            if state not in (*SERVING_STATES, ServerState.WEIGHT_SYNCING) or backend is None \
                    or self._booted_config is None:
                raise ApiError(409, f"the server is {state}: adapters are added while it runs (start it first)",
                               "not_running")
            if not self.adapters:
                raise ApiError(409, "this server serves one model: adapters are added to a server started with "
                               "model.adapters (docs/multi_model.md)", "no_adapters")
            full = as_dict(self._booted_config)
            model = ModelConfig.of(full.get("model"))
            entries = [*list(model.adapters), entry]
            try:
                spec = dataclasses.replace(model, adapters=entries).adapter_specs()[-1]
            except ValueError as exc:
                raise ApiError(422, str(exc), "invalid_adapter", param="name") from None
            if len(entries) > model.adapter_capacity():
                raise ApiError(422, f"no room for adapter {spec.name!r}: this server holds at most "
                               f"model.max_adapters={model.adapter_capacity()} ({', '.join(self.adapters)}); "
                               "restart it with a larger model.max_adapters", "invalid_adapter", param="name")
            policy = None
            if spec.batching:
                try:
                    merged = adapter_batching(dict(full.get("batching") or {}), spec, get_registry())
                except ConfigError as exc:
                    raise ApiError(422, str(exc), "invalid_adapter", param="batching") from None
                assert merged is not None
                policy = load_component("batching", str(merged["name"]))(**merged)
            try:
                await self.cycle.add_adapter(spec, policy, backend)
            except ValueError as exc:  # the engine's refusal (no room): nothing was added
                raise ApiError(422, str(exc), "invalid_adapter", param="name") from None
            self.inference.adapters.append(spec.name)
            staged = self.config is not self._booted_config
            self._booted_config = with_adapters(self._booted_config, entries)
            if not staged:
                self.config = self._booted_config
        log.info("adapter %s added by the controller; adapters now %s", spec.name, ", ".join(self.adapters))
        note = ("a config sent by configure since the start applies at the next restart and does not list it; "
                "add it there to keep it") if staged else None
        return {"adapter": spec.name, "adapters": list(self.adapters), "global_step": self.global_step,
                "note": note}

    def start(self) -> None:
        """OFFLINE → BOOTING; the boot runs as a task and ends in ROLLING or OFFLINE."""
        if self.config is None:
            raise ApiError(409, "the server has no configuration yet: POST /api/v1/admin/configure first",
                           "not_configured")
        if self.state.state is not ServerState.OFFLINE:
            raise ApiError(409, f"the server is already {self.state.state}; stop it first (or use restart)",
                           "already_started")
        self.state.transition(ServerState.BOOTING)
        self._boot_task = asyncio.get_running_loop().create_task(self._boot())

    async def _boot(self) -> None:
        cfg = self.config
        self._booted_config = cfg
        backend = None
        try:
            backend = await asyncio.to_thread(self._make_backend, cfg)
            await backend.start()
            full = as_dict(cfg)
            self.inference.load(backend, ModelConfig.of(full.get("model")))
            if "server" in full:  # the training config's timeouts apply from this boot on
                self._apply_limits(ServerConfig(**as_dict(full["server"])))
                self.episodes.default_timeout_s = self.episode_timeout_s
            self.strict_tools = check_mode(self.strict_tools_setting, backend)
            await self.cycle.after_boot()
            window = self.cycle.active_window_s
            if window is not None:  # one owner of "active": the batching policy's window is the tracker's
                self.clients.active_window_s = float(window)
            self.started_at = time.time()
            self.state.transition(ServerState.ROLLING)
            try:
                get_hooks().run_start(redacted(full), str(self.run_dir or ""))
            except Exception:  # noqa: BLE001
                log.exception("on_run_start hooks failed")
        except asyncio.CancelledError:
            await self._close_backend(backend)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed boot is reported in the status
            log.exception("boot failed")
            self.inference.unload()
            await self._close_backend(backend)
            if self.state.state is ServerState.BOOTING:
                self.state.transition(ServerState.OFFLINE, error=f"boot failed: {type(exc).__name__}: {exc}")

    def _make_backend(self, cfg: Any) -> InferenceBackend:
        if self.backend_factory is not None:
            return self.backend_factory(cfg)
        full = as_dict(cfg)
        component = get_registry().get("backend", str(full["backend"]["name"]))
        if component.experimental:
            log.warning("backend '%s' is experimental: %s", component.name, component.description)
        cls = component.load()
        own = {k: v for k, v in full["backend"].items() if k not in REPLICA_KEYS}
        replica = ReplicaConfig(**{k: v for k, v in full["backend"].items() if k in REPLICA_KEYS})
        if replica.replicas <= 1 and not replica.replica_devices:
            return cls(config=own, model=full["model"])
        check_replicable(cls, component.name, replica.replicas)
        return build_replicas(lambda c: cls(config=c, model=full["model"]), own, replica.replicas,
                              replica.replica_devices, replica.replica_sync_timeout_s)

    async def _close_backend(self, backend: InferenceBackend | None) -> None:
        if backend is None:
            return
        try:
            await backend.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the backend failed")

    async def stop(self, reason: str = "server stopped", *, error: str | None = None) -> None:
        """Any state → OFFLINE: abort running episodes, free the engine; ``error``: the ``last_error`` to report.

        A stop slower than :data:`SLOW_STOP_S` logs every thread's stack once (what it waits on).
        """
        t0 = time.perf_counter()
        was = self.state.state
        watchdog = asyncio.get_running_loop().call_later(SLOW_STOP_S, log_thread_stacks,
                                                         f"stopping the server takes over {SLOW_STOP_S:g} s")
        try:
            await self._stop(reason, error)
        finally:
            watchdog.cancel()
        # a server that was OFFLINE already (stopped by the controller, then shut down) had nothing to stop
        log.log(logging.DEBUG if was is ServerState.OFFLINE else logging.INFO,
                "server stopped in %.1f s (%s)", time.perf_counter() - t0, reason)

    async def _stop(self, reason: str, error: str | None = None) -> None:
        if self._boot_task is not None and not self._boot_task.done():
            self._boot_task.cancel()
            try:
                await self._boot_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._boot_task = None
        self.episodes.abort_all(reason)
        if self.state.state is not ServerState.OFFLINE:
            t = time.perf_counter()
            try:
                await self.cycle.before_stop()
            except Exception:  # noqa: BLE001 - stopping must always succeed
                log.exception("the cycle failed to stop")
            log.debug("stop: the cycle stopped in %.1f s", time.perf_counter() - t)
        backend = self.inference.unload()
        t = time.perf_counter()
        await self._close_backend(backend)
        log.debug("stop: the backend closed in %.1f s", time.perf_counter() - t)
        if self.state.state is not ServerState.OFFLINE:
            self.state.transition(ServerState.OFFLINE, error=error)
            try:
                get_hooks().run_end({"global_step": self.global_step, "reason": reason,
                                     "episodes": dict(self.episodes.counts)}, str(self.run_dir or ""))
            except Exception:  # noqa: BLE001
                log.exception("on_run_end hooks failed")

    # ------------------------------------------------------------------ pool cycle seams
    def enter_rolling_post(self) -> None:
        """ROLLING → ROLLING_POST: new episodes get 503 + Retry-After."""
        self.cycle_started = time.time()
        self.state.transition(ServerState.ROLLING_POST)
        self.clients.reset_ready()

    async def drain(self, timeout_s: float | None = None, *, include_eval: bool = True) -> int:
        """Wait for running episodes to end, then abort the rest; returns how many were aborted.

        An episode with no call in flight and none for ``server.drain_idle_s`` is aborted at once
        ("idle at drain"): a dead client's episode does not hold the step for the whole drain.
        """
        deadline = time.time() + (self.drain_timeout_s if timeout_s is None else timeout_s)
        idle_aborted = 0
        # a drain that takes a while says what it waits for: at DEBUG after 1 s (most drains of a
        # real model take seconds: the step line shows each one's time), once at INFO when it is slow
        started = time.time()
        announce = [(started + 1.0, logging.DEBUG), (started + SLOW_DRAIN_S, logging.INFO)]
        while time.time() < deadline:
            left = [e for e in self.episodes.running() if include_eval or not e.eval]
            if not left:
                return idle_aborted
            if announce and time.time() >= announce[0][0]:
                level = announce.pop(0)[1]
                names = ", ".join(f"{e.id} ({e.task_id}, {e.client_id or 'no client'})" for e in left[:3])
                more = f" and {len(left) - 3} more" if len(left) > 3 else ""
                log.log(level, "draining before the step for %.0fs: still waiting for %d running episode(s): %s%s; "
                        "new registrations answer 503 until then (idle ones are aborted after %gs, the rest in %.0fs)",
                        time.time() - started, len(left), names, more, self.drain_idle_s, deadline - time.time())
            now = time.time()
            for ep in left:  # a client that went quiet (dead, or stuck) does not hold the step
                if ep.running and self.abandoned(ep, now):
                    self.episodes.abort(ep, "idle at drain")
                    idle_aborted += 1
            await asyncio.sleep(0.05)
        left = [e for e in self.episodes.running() if include_eval or not e.eval]
        await self.resolve_prepared([e for e in left if e.status == PREPARED], final=True)
        for ep in left:
            self.episodes.abort(ep, "drain deadline")  # running ones (a resolved one has ended: no-op)
        return idle_aborted + sum(e.status == ABORTED for e in left)

    def abandoned(self, ep: Episode, now: float) -> bool:
        """Whether a step need not wait for ``ep``: no call in flight, and none for ``server.drain_idle_s``,
        or its client declared a heartbeat and missed three (the client process died: a SIGKILLed SDK
        client no longer holds a step for the whole idle window)."""
        idle = ep.idle_for(now)
        return idle > self.drain_idle_s or (idle > 0 and bool(ep.client_id) and self.clients.gone(ep.client_id, now))

    async def resolve_prepared(self, eps: list[Episode], *, final: bool) -> None:
        """Commit or drop prepared episodes whose client never committed (:mod:`swarmkit.swarm.atomic`).

        A primary that cannot be reached is asked again every 2 s until ``server.prepared_grace_s``
        after the deadline; ``final`` (a drain ran out) decides at once.
        """
        if not eps:
            return
        async with httpx.AsyncClient(timeout=5.0) as http:
            for ep in eps:
                now = time.time()
                if ep.status != PREPARED or (not final and self._next_resolve.get(ep.id, 0.0) > now):
                    continue
                decision = await resolve_prepared(ep, http)
                if ep.status != PREPARED:  # the client committed or aborted it meanwhile
                    decision = "done"
                elif decision == "wait" and not final and now < ep.deadline + self.prepared_grace_s:
                    self._next_resolve[ep.id] = now + 2.0
                    continue
                self._next_resolve.pop(ep.id, None)
                if decision == "commit":
                    try:
                        await self.commit(ep)
                        log.info("prepared episode %s committed: its primary was committed", ep.id)
                    except ApiError as exc:
                        log.warning("prepared episode %s could not be committed: %s", ep.id, exc.message)
                elif decision != "done":
                    why = "its primary was not committed" if decision == "abort" else "its primary was unreachable"
                    if decision == "wait":
                        log.warning("prepared episode %s dropped: %s (it may have been committed there)", ep.id, why)
                    self.episodes.abort(ep, f"not committed: {why}", reaped=True)

    def enter_weight_syncing(self) -> None:
        self.state.transition(ServerState.WEIGHT_SYNCING)

    def resume_rolling(self) -> None:
        """WEIGHT_SYNCING → ROLLING (the cycle has moved its step on)."""
        if self.cycle_started:
            self.last_cycle_s = time.time() - self.cycle_started
        self.state.transition(ServerState.ROLLING)

    def expected_busy_s(self, now: float | None = None) -> float:
        """How long a client should wait for the training step under way: the last step's length
        less the time this one has run (at least 50 ms; 1 s before any step has been timed)."""
        if self.last_cycle_s is None or not self.cycle_started:
            return 1.0
        now = time.time() if now is None else now
        return min(30.0, max(0.05, self.last_cycle_s - (now - self.cycle_started)))

    # ------------------------------------------------------------------ episodes
    def _on_episode_end(self, ep: Episode) -> None:
        if isinstance(self.backend, ReplicaSet):
            self.backend.forget(ep.id)
        if ep.eval and ep.status == FINISHED and ep.reward is not None:
            self.eval_tally.add(ep.meta.get("task_family"), ep.rewards or ep.reward)
        try:
            get_hooks().episode_finished(ep.hook_payload())
        except Exception:  # noqa: BLE001
            log.exception("on_episode_finished hooks failed")

    async def accept(self, ep: Episode) -> None:
        """Hand a finished training episode to the cycle (before answering its reporter).

        Raising makes the report fail with 503 (the client retries; 507 past the journal's quota) and leaves
        the episode running.
        """
        result = self.cycle.accept(ep)
        if inspect.isawaitable(result):
            await result

    async def commit(self, ep: Episode, *, on_failure: str = PREPARED) -> None:
        """PREPARED → FINISHED: a training episode goes to the pool (an eval one only ends).

        A pool that cannot store it answers 503 (the client retries) and leaves the
        episode ``on_failure`` (PREPARED, or RUNNING for a one-call report).
        """
        if not ep.eval and self.adapters and ep.adapter is None and ep.timelines:
            raise ApiError(422, f"this episode's calls named no adapter; this server trains {self.adapters} and "
                           "needs one per episode", "adapter_required", param="adapter")
        ep.status = COMMITTING
        accepted = False
        if not ep.eval and self.training_finished:
            ep.meta["not_accepted"] = self.training_finished  # registered before the limit: never trained
        elif not ep.eval:
            try:
                await self.accept(ep)
            except Exception as exc:  # noqa: BLE001 - the sample was not stored: let the client retry
                ep.status = on_failure
                if on_failure == RUNNING:
                    ep.reward, ep.rewards = None, {}
                if isinstance(exc, ApiError):
                    raise
                raise busy(f"the episode could not be stored in the sample pool ({type(exc).__name__}: {exc}); "
                           "retry", 1.0, "pool_unavailable") from None
            accepted = True
        self.episodes.finish(ep, ep.reward if ep.reward is not None else 0.0, ep.rewards, accepted)

    def record_eval(self) -> dict[str, float]:
        """End an eval round: its rewards per task family (since the last step or round) are recorded at
        the current step (an ``eval`` row of ``metrics.jsonl``), not with the next training step, which
        for the last round never comes. Returns them."""
        tally = self.eval_tally.take()
        if tally:
            self.cycle.record_eval(tally)
        return tally

    def waiting(self) -> list[Any]:
        """Accepted episodes waiting in the pool for a step (``task_id``, ``task_family``, ``reward``)."""
        return list(self.cycle.waiting())

    def pool_info(self) -> dict[str, Any]:
        try:
            return dict(self.cycle.status())
        except Exception as exc:  # noqa: BLE001 - the status must always answer
            return {"error": f"{type(exc).__name__}: {exc}"}

    def status(self) -> dict[str, Any]:
        running = self.episodes.running()
        counts = self.episodes.counts
        active = self.clients.active()
        return {
            "state": str(self.state.state),
            "since": self.state.since,
            "state_history": [str(st) for _, st in self.state.history[-40:]],
            "last_error": self.state.last_error,
            "global_step": self.global_step,
            "policy_version": self.policy_version,
            "configured": self.config is not None,
            "model": self.model_name if self.backend is not None else None,
            "training_finished": self.training_finished,
            "episodes": {
                "running": len(running),
                "running_train": sum(1 for e in running if not e.eval),
                "running_eval": sum(1 for e in running if e.eval),
                "registered": counts["registered"],
                "finished": counts["finished"],
                "eval_finished": counts["eval_finished"],
                "aborted": counts["aborted"],
                "reaped": counts["reaped"],
            },
            "pool": self.pool_info(),
            "clients": {"active": len(active), "ready": sum(1 for c in active.values() if c.ready)},
            "engine": self.inference.engine_stats(),
            "replicas": self.backend.replica_status() if isinstance(self.backend, ReplicaSet) else None,
            "calls": self.tracker.calls if self.tracker else 0,
            "tokens_generated": self.tracker.tokens_generated if self.tracker else 0,
            "uptime_s": time.time() - self.created_at,
        }

    # ------------------------------------------------------------------ reaper
    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.reaper_interval_s)
            try:
                reaped = self.episodes.reap()
                for ep in reaped:
                    log.info("episode %s (task %s) passed its deadline: aborted", ep.id, ep.task_id)
                await self.resolve_prepared(self.episodes.prepared_past_deadline(), final=False)
                self.clients.prune()
                await self.check_engine()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("reaper failed")

    async def check_engine(self) -> None:
        """A dead engine (:meth:`InferenceBackend.failure`) stops the server, its cause the ``last_error``: a
        main job exits non-zero with it, clients see OFFLINE, nothing waits on an engine that is gone."""
        if self.state.state in (ServerState.OFFLINE, ServerState.BOOTING):
            return
        why = self.inference.failure()
        if why is None:
            return
        log.error("the inference engine failed: %s; the server stops", why)
        await self.stop("the inference engine failed", error=f"the inference engine failed: {why}")

    async def startup(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        await self.stop("server shut down")
