"""The swarm server: one :class:`SwarmServer` behind a Starlette app.

``create_app(...)`` builds the app with a lifespan (reaper task, clean
shutdown), explicit routes and a pure ASGI body-size limit. Everything the
endpoints share lives on the :class:`SwarmServer` object
(``app.state.swarm``), never in module globals.

Seams for the sample pool / trainer cycle (issue 5):

- ``on_episode_accepted(episode)`` (sync or async): called for every finished
  training episode *before* its reporter gets the success answer; raising
  makes the report fail with 503 (the client retries) and leaves the episode
  running.
- ``pool_status()`` → dict shown as ``status()["pool"]``.
- :meth:`SwarmServer.enter_rolling_post`, :meth:`SwarmServer.drain`,
  :meth:`SwarmServer.enter_weight_syncing`, :meth:`SwarmServer.resume_rolling`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import secrets
import stat
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkit.clients import ClientTracker
from swarmkit.interfaces import GenerationOutput, InferenceBackend, SamplingParams
from swarmkit.server.episodes import Episode, EpisodeRegistry
from swarmkit.server.errors import EXCEPTION_HANDLERS, ApiError, busy, error_body
from swarmkit.server.state import SERVING_STATES, ServerState, StateMachine
from swarmkit.server.tracker import ContextTracker

log = logging.getLogger("swarmkit.server")

ENV_ADMIN_TOKEN = "SWARMKIT_ADMIN_TOKEN"
ADMIN_TOKEN_FILE = "admin_token"

BackendFactory = Callable[[Any], InferenceBackend]
AcceptHook = Callable[[Episode], Awaitable[None] | None]


# --------------------------------------------------------------------------- admin token
def resolve_admin_token(configured: str | None, run_dir: str | os.PathLike | None) -> tuple[str, str]:
    """The admin token and where it came from.

    Order: ``server.admin_token`` → ``$SWARMKIT_ADMIN_TOKEN`` → a new random
    token written to ``<run_dir>/admin_token`` with mode 0600. Returns
    ``(token, source)`` where source is ``"config"``, ``"env"`` or the file path.
    """
    if configured:
        return str(configured), "config"
    env = os.environ.get(ENV_ADMIN_TOKEN)
    if env:
        return env, "env"
    token = secrets.token_urlsafe(32)
    if run_dir is None:
        return token, "generated (not written: no run_dir)"
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ADMIN_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    try:
        os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token, str(path)


def pool_record(ep: Episode) -> Any:
    """The :class:`swarmkit.pool.EpisodeRecord` of a finished training episode.

    For wiring the pool: ``on_episode_accepted=lambda ep: pool.add(pool_record(ep))``.
    The reward is the role → reward dict for episodes with roles, else the float;
    ``task_family`` comes from the episode's ``meta["task_family"]``.
    """
    from swarmkit.pool import EpisodeRecord

    return EpisodeRecord(
        episode_id=ep.id,
        task_id=ep.task_id,
        client_id=ep.client_id,
        reward=dict(ep.rewards) if ep.roles else float(ep.reward if ep.reward is not None else 0.0),
        timelines=[tl.to_dict() for tl in ep.timelines],
        policy_version=ep.policy_version,
        task_family=str(ep.meta.get("task_family", "")),
        meta={"roles": ep.roles, "n_calls": ep.n_calls, **{k: v for k, v in ep.meta.items() if k != "task_family"}},
    )


# --------------------------------------------------------------------------- middleware
class BodySizeLimit:
    """Pure ASGI middleware: 413 for request bodies over ``max_bytes``.

    A declared ``Content-Length`` over the limit is refused before reading; a
    chunked body is counted as it arrives and refused once it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._refuse(send, 400, "invalid Content-Length header", "invalid_header")
                    return
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._refuse(send, 413, self._message(declared), "body_too_large")
                return
            await self.app(scope, receive, send)
            return
        # no Content-Length: read and count the body, then replay it
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(send, 413, self._message(size), "body_too_large")
                return
            chunks.append(body)
            more = message.get("more_body", False)
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)

    def _message(self, size: int) -> str:
        return f"request body of {size} bytes is over this server's limit of {self.max_bytes} bytes " \
               "(server.max_body_bytes)"

    async def _refuse(self, send: Send, status: int, message: str, code: str) -> None:
        import json

        payload = json.dumps(error_body(status, message, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    queue = list(messages)

    async def replay() -> Message:
        if queue:
            return queue.pop(0)
        return await receive()

    return replay


# --------------------------------------------------------------------------- the server
def _plain(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, Mapping):
        return dict(cfg)
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    import dataclasses

    if dataclasses.is_dataclass(cfg):
        return dataclasses.asdict(cfg)  # type: ignore[arg-type]
    raise TypeError(f"expected a mapping or config, got {type(cfg).__name__}")


class SwarmServer:
    """State shared by every endpoint of one server process.

    :param server_cfg: the ``server`` config group (host, port, run_dir,
        admin_token, episode_timeout_s, drain_timeout_s, max_body_bytes).
    :param config: a validated training config to start with (optional; a
        controller can send one later).
    :param backend_factory: builds the inference backend from the training
        config; default: the registry's ``backend`` component.
    :param on_episode_accepted: the pool hook (see the module docstring).
    :param pool_status: returns the ``pool`` part of the status.
    :param checkpoint_fn: ``(server, path) -> dict`` saving trainer state.
    :param renderer_factory: ``tokenizer -> renderer``; default
        :class:`swarmkit.chat.ChatRenderer`.
    """

    def __init__(
        self,
        server_cfg: Any = None,
        *,
        config: Any = None,
        backend_factory: BackendFactory | None = None,
        on_episode_accepted: AcceptHook | None = None,
        pool_status: Callable[[], dict[str, Any]] | None = None,
        checkpoint_fn: Callable[[SwarmServer, str], Any] | None = None,
        admin_token: str | None = None,
        client_window_s: float = 60.0,
        renderer_factory: Callable[[Any], Any] | None = None,
    ):
        scfg = _plain(server_cfg)
        self.host: str = scfg.get("host", "127.0.0.1")
        self.port: int = int(scfg.get("port", 8000))
        run_dir = scfg.get("run_dir")
        self.run_dir: Path | None = Path(run_dir) if run_dir and run_dir != "auto" else None
        self.episode_timeout_s = float(scfg.get("episode_timeout_s", 600.0))
        self.drain_timeout_s = float(scfg.get("drain_timeout_s", 60.0))
        self.max_body_bytes = int(scfg.get("max_body_bytes", 8_000_000))
        self.server_cfg = scfg
        self.admin_token, self.admin_token_source = resolve_admin_token(
            admin_token or scfg.get("admin_token"), self.run_dir
        )
        self.state = StateMachine()
        self.episodes = EpisodeRegistry(default_timeout_s=self.episode_timeout_s, on_end=self._on_episode_end)
        self.clients = ClientTracker(active_window_s=client_window_s)
        self.config: Any = config
        self.backend_factory = backend_factory
        self.on_episode_accepted = on_episode_accepted
        self.pool_status = pool_status
        self.checkpoint_fn = checkpoint_fn
        self.renderer_factory = renderer_factory
        self.on_client_ready: Callable[[str, bool], None] | None = None
        #: awaited at the end of BOOTING with the server (e.g. build the trainer); raising fails the boot
        #: the training cycle driving this server, when one is wired in
        self.cycle: Any = None
        self.after_boot: Callable[[SwarmServer], Awaitable[None]] | None = None
        #: awaited when the server stops (e.g. final checkpoint, free the trainer)
        self.before_stop: Callable[[SwarmServer], Awaitable[None]] | None = None
        self.backend: InferenceBackend | None = None
        self.renderer: Any = None
        self.tracker: ContextTracker | None = None
        self.global_step = 0
        self.started_at: float | None = None
        self.created_at = time.time()
        self.model_name = "swarmkit"
        self.max_context: int | None = None
        self.accepted: list[Episode] = []  # without a pool hook: accepted episodes, in memory
        self._boot_task: asyncio.Task | None = None
        self._reaper: asyncio.Task | None = None
        self._lock = asyncio.Lock()
        self._config_lock = asyncio.Lock()
        self.reaper_interval_s = 0.25
        self._token_text: Any = None

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        if self.backend is None:
            raise busy("no model is loaded (server is OFFLINE); configure and start it", 2.0, "server_offline")
        return self.backend.tokenizer

    @property
    def policy_version(self) -> int:
        if self.backend is not None:
            return int(getattr(self.backend, "policy_version", self.global_step))
        return self.global_step

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # ------------------------------------------------------------------ auth
    def check_admin(self, token: str | None) -> None:
        """401 without a token, 403 with a wrong one."""
        if not token:
            raise ApiError(401, "missing admin token: send 'Authorization: Bearer <admin token>' (see the server's "
                           "start-up message for where the token is)", "missing_admin_token")
        if not secrets.compare_digest(token.encode(), self.admin_token.encode()):
            raise ApiError(403, "wrong admin token", "wrong_admin_token")

    def is_admin(self, token: str | None) -> bool:
        return bool(token) and secrets.compare_digest(token.encode(), self.admin_token.encode())

    def authorize_any(self, token: str | None) -> None:
        """Admin token or any known episode key (``GET /v1/models``)."""
        if self.is_admin(token):
            return
        self.episodes.by_key(token)

    async def authorize_call(self, key: str | None) -> tuple[Episode, str | None]:
        """The running episode (and role) of an inference call's key."""
        ep, role = self.episodes.by_key(key)
        self.episodes.check_open(ep)
        if ep.client_id:
            self.clients.touch(ep.client_id)
        state = self.state.state
        if state not in SERVING_STATES and state is not ServerState.WEIGHT_SYNCING:
            raise busy(f"the server is {state}: no model is being served", 2.0, "server_offline")
        return ep, role

    def touch_client(self, client_id: str | None) -> None:
        if client_id:
            self.clients.touch(client_id[:128])

    # ------------------------------------------------------------------ inference
    def room_for(self, prompt_len: int) -> int:
        """Tokens left for generation after a prompt; 400 if none."""
        limit = self.max_context
        if not limit:
            return 1 << 20
        room = limit - prompt_len
        if room <= 0:
            raise ApiError(400, f"this prompt has {prompt_len} tokens; the model's context is {limit} tokens "
                           "(model.max_context)", "context_length_exceeded", param="messages")
        return room

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
        ep.in_flight += 1

    def end_call(self, ep: Episode) -> None:
        ep.in_flight -= 1

    async def generate(self, ep: Episode, prompt_ids: list[int], params: SamplingParams) -> list[GenerationOutput]:
        """Generate for an episode's call; 410/409 if it ended meanwhile."""
        self.begin_call(ep)
        try:
            await self.wait_serving(ep)
            backend = self.backend
            if backend is None:
                raise busy("the server stopped", 2.0, "server_offline")
            try:
                outputs = await backend.generate(prompt_ids, params)
            except ApiError:
                raise
            except ValueError as exc:
                raise ApiError(400, f"the backend refused this request: {exc}", "invalid_request") from None
        finally:
            self.end_call(ep)
        self.episodes.check_open(ep)
        return outputs

    # ------------------------------------------------------------------ life cycle
    def set_config(self, cfg: Any) -> None:
        self.config = cfg

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
        backend = None
        try:
            backend = await asyncio.to_thread(self._make_backend, cfg)
            await backend.start()
            if self.renderer_factory is not None:
                self.renderer = self.renderer_factory(backend.tokenizer)
            else:
                from swarmkit.chat import ChatRenderer

                self.renderer = ChatRenderer(backend.tokenizer)
            self.tracker = ContextTracker(self.renderer)
            self.backend = backend
            model = _plain(cfg.get("model") if hasattr(cfg, "get") else None)
            self.model_name = str(model.get("name") or "swarmkit")
            self.max_context = getattr(backend, "max_context", None) or model.get("max_context")
            scfg = _plain(cfg.get("server")) if hasattr(cfg, "get") else {}
            if scfg.get("episode_timeout_s"):
                self.episode_timeout_s = float(scfg["episode_timeout_s"])
                self.episodes.default_timeout_s = self.episode_timeout_s
            if scfg.get("drain_timeout_s"):
                self.drain_timeout_s = float(scfg["drain_timeout_s"])
            if self.after_boot is not None:
                await self.after_boot(self)
            self.started_at = time.time()
            self.state.transition(ServerState.ROLLING)
            try:
                from swarmkit.plugins import get_hooks

                get_hooks().run_start(_plain(cfg), str(self.run_dir or ""))
            except Exception:  # noqa: BLE001
                log.exception("on_run_start hooks failed")
        except asyncio.CancelledError:
            await self._close_backend(backend)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed boot is reported in the status
            log.exception("boot failed")
            await self._close_backend(backend)
            self.backend = None
            if self.state.state is ServerState.BOOTING:
                self.state.transition(ServerState.OFFLINE, error=f"boot failed: {type(exc).__name__}: {exc}")

    def _make_backend(self, cfg: Any) -> InferenceBackend:
        if self.backend_factory is not None:
            return self.backend_factory(cfg)
        from swarmkit.plugins import get_registry

        cls = get_registry().get("backend", str(cfg.backend.name)).load()
        return cls(config=_plain(cfg.backend), model=_plain(cfg.model))

    async def _close_backend(self, backend: InferenceBackend | None) -> None:
        if backend is None:
            return
        try:
            await backend.close()
        except Exception:  # noqa: BLE001
            log.exception("closing the backend failed")

    async def stop(self, reason: str = "server stopped") -> None:
        """Any state → OFFLINE: abort running episodes, free the engine."""
        if self._boot_task is not None and not self._boot_task.done():
            self._boot_task.cancel()
            try:
                await self._boot_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._boot_task = None
        self.episodes.abort_all(reason)
        if self.before_stop is not None and self.state.state is not ServerState.OFFLINE:
            try:
                await self.before_stop(self)
            except Exception:  # noqa: BLE001 - stopping must always succeed
                log.exception("before_stop hook failed")
        backend, self.backend = self.backend, None
        await self._close_backend(backend)
        if self.state.state is not ServerState.OFFLINE:
            self.state.transition(ServerState.OFFLINE)
            try:
                from swarmkit.plugins import get_hooks

                get_hooks().run_end({"global_step": self.global_step, "reason": reason,
                                     "episodes": dict(self.episodes.counts)})
            except Exception:  # noqa: BLE001
                log.exception("on_run_end hooks failed")

    # ------------------------------------------------------------------ pool cycle seams
    def enter_rolling_post(self) -> None:
        """ROLLING → ROLLING_POST: new episodes get 503 + Retry-After."""
        self.state.transition(ServerState.ROLLING_POST)
        self.clients.reset_ready()

    async def drain(self, timeout_s: float | None = None, *, include_eval: bool = True) -> int:
        """Wait for running episodes to end, then abort the rest; returns how many were aborted."""
        deadline = time.time() + (self.drain_timeout_s if timeout_s is None else timeout_s)
        while time.time() < deadline:
            left = [e for e in self.episodes.running() if include_eval or not e.eval]
            if not left:
                return 0
            await asyncio.sleep(0.05)
        left = [e for e in self.episodes.running() if include_eval or not e.eval]
        for ep in left:
            self.episodes.abort(ep, "drain deadline")
        return len(left)

    def enter_weight_syncing(self) -> None:
        self.state.transition(ServerState.WEIGHT_SYNCING)

    def resume_rolling(self, global_step: int | None = None) -> None:
        if global_step is not None:
            self.global_step = int(global_step)
        self.state.transition(ServerState.ROLLING)

    # ------------------------------------------------------------------ episodes
    def _on_episode_end(self, ep: Episode) -> None:
        try:
            from swarmkit.plugins import get_hooks

            get_hooks().episode_finished(ep.hook_payload())
        except Exception:  # noqa: BLE001
            log.exception("on_episode_finished hooks failed")

    async def accept(self, ep: Episode) -> None:
        """Hand a finished training episode to the pool (before answering its reporter)."""
        if self.on_episode_accepted is None:
            self.accepted.append(ep)
            return
        result = self.on_episode_accepted(ep)
        if inspect.isawaitable(result):
            await result

    def pool_info(self) -> dict[str, Any]:
        if self.pool_status is not None:
            try:
                return dict(self.pool_status())
            except Exception as exc:  # noqa: BLE001
                return {"error": f"{type(exc).__name__}: {exc}"}
        return {"episodes": len(self.accepted), "tasks": len({e.task_id for e in self.accepted})}

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
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("reaper failed")

    async def startup(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        if self.config is not None and self.server_cfg.get("autostart"):
            self.start()

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            try:
                await self._reaper
            except asyncio.CancelledError:
                pass
        await self.stop("server shut down")


def create_app(swarm: SwarmServer | None = None, **kwargs: Any) -> Starlette:
    """The Starlette app of one swarm server.

    :param swarm: a ready :class:`SwarmServer`; otherwise one is built from
        ``kwargs`` (see its parameters).
    """
    from swarmkit.server import controller, episode_api, openai_api

    srv = swarm if swarm is not None else SwarmServer(**kwargs)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        await srv.startup()
        try:
            yield
        finally:
            await srv.shutdown()

    routes = [
        Route("/", controller.root, methods=["GET"]),
        Route("/v1/models", openai_api.list_models, methods=["GET"]),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/api/v1/health", controller.health, methods=["GET"]),
        Route("/api/v1/status", controller.status, methods=["GET"]),
        Route("/api/v1/admin/configure", controller.configure, methods=["POST"]),
        Route("/api/v1/admin/start", controller.start, methods=["POST"]),
        Route("/api/v1/admin/stop", controller.stop, methods=["POST"]),
        Route("/api/v1/admin/restart", controller.restart, methods=["POST"]),
        Route("/api/v1/admin/checkpoint", controller.checkpoint, methods=["POST"]),
        Route("/api/v1/episodes", episode_api.register, methods=["POST"]),
        Route("/api/v1/episodes", episode_api.list_episodes, methods=["GET"]),
        Route("/api/v1/episodes/{episode_id}", episode_api.get_episode, methods=["GET"]),
        Route("/api/v1/episodes/{episode_id}/report", episode_api.report, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/abort", episode_api.abort, methods=["POST"]),
        Route("/api/v1/episodes/{episode_id}/timelines", episode_api.timelines, methods=["GET"]),
        Route("/api/v1/clients/ready", episode_api.client_ready, methods=["POST"]),
        Route("/api/v1/clients/heartbeat", episode_api.client_heartbeat, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)  # type: ignore[arg-type]
    app.state.swarm = srv
    app.add_middleware(BodySizeLimit, max_bytes=srv.max_body_bytes)
    return app
