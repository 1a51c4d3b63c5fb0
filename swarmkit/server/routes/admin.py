"""The controller (admin) API: configure, start, stop, restart, status, checkpoint, resume_training,
adapters (add one at run time).

Every endpoint here except ``/`` and ``/api/v1/health`` needs the admin token
(``Authorization: Bearer <token>``): 401 without it, 403 with a wrong one.

``POST /api/v1/admin/configure`` takes one of

- ``{"config": {...}}``: a full or partial training config (a partial one is
  laid over the packaged defaults; a component group given with a ``name``
  selects that option first, like ``backend=vllm`` on the command line);
- ``{"overrides": ["model.path=builtin:tiny", "backend=hf", ...]}``: Hydra
  overrides, composed exactly as the command line does;
- ``{"yaml": "<text of a YAML config>"}``: like ``config``.

The body is read by :class:`~swarmkit.server.schema.control.ConfigureRequest`; the
config is validated by the same schemas as the command line; every problem is listed
in one 422 answer. ``server.host/port/run_dir/admin_token``
always stay those of the running process.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkit.config.compose import config_from_request
from swarmkit.config.validate import to_dict
from swarmkit.errors import ApiError, ConfigError
from swarmkit.server.requests import bearer, read_json
from swarmkit.server.schema.control import AddAdapterRequest, ConfigureRequest
from swarmkit.swarm.auth import redacted
from swarmkit.training.trainer import checkpoint_path

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.swarm.server import SwarmServer

#: Hydra's GlobalHydra is process-wide: one composition at a time
_compose_lock = threading.Lock()


def _server(request: Request) -> SwarmServer:
    return request.app.state.swarm


def _admin(request: Request) -> SwarmServer:
    srv = _server(request)
    srv.check_admin(bearer(request))
    # controller calls do not make a sampling client "active" (batching C4/C5)
    return srv


async def root(request: Request) -> Response:
    srv = _server(request)
    return JSONResponse({"name": "swarmkit", "state": str(srv.state.state), "openai_base_url": "/v1",
                         "docs": "docs/server_api.md"})


async def health(request: Request) -> Response:
    """State only; no token needed (for load balancers and waiting clients). ``error``: what stops the server
    from serving (``"the inference engine failed"``, ``"boot failed"``: the head of the status's
    ``last_error``, whose cause only the admin status shows: an exception's text can hold paths), else null."""
    srv = _server(request)
    last = "the inference engine failed" if srv.inference.failure() is not None else srv.state.last_error
    return JSONResponse({"state": str(srv.state.state), "global_step": srv.global_step,
                         "error": last.split(":")[0] if last else None})


async def status(request: Request) -> Response:
    return JSONResponse(_admin(request).status())


# --------------------------------------------------------------------------- configure
def _build_locked(body: dict[str, Any], server_cfg: dict[str, Any]) -> Any:
    with _compose_lock:
        try:
            return config_from_request(body, server_cfg)
        except ConfigError as exc:
            raise ApiError(422, str(exc), "invalid_config") from None
        except Exception as exc:  # noqa: BLE001 - Hydra raises many kinds of errors for bad input
            raise ApiError(422, f"could not compose the config: {type(exc).__name__}: {exc}",
                           "invalid_config") from None


async def configure(request: Request) -> Response:
    srv = _admin(request)
    body = await read_json(request)
    ConfigureRequest.parse(body)
    cfg = await anyio.to_thread.run_sync(_build_locked, body, vars(srv.server_cfg))
    srv.set_config(cfg)
    state = srv.state.state
    note = None if str(state) == "OFFLINE" else "the server is running: the new config applies at the next restart"
    return JSONResponse({"state": str(state), "config": redacted(to_dict(cfg)), "note": note})


async def start(request: Request) -> Response:
    srv = _admin(request)
    srv.start()
    return JSONResponse({"state": str(srv.state.state)}, status_code=202)


async def stop(request: Request) -> Response:
    srv = _admin(request)
    await srv.stop("stopped by the controller")
    return JSONResponse({"state": str(srv.state.state)})


async def restart(request: Request) -> Response:
    srv = _admin(request)
    await srv.stop("restarted by the controller")
    srv.start()
    return JSONResponse({"state": str(srv.state.state)}, status_code=202)


async def resume_training(request: Request) -> Response:
    """Training goes on after the collapse alarm paused it (``trainer.collapse.action=pause``):
    ``{"resumed": true|false, "global_step": N}``; the alarm's counts start over."""
    srv = _admin(request)
    return JSONResponse(srv.resume_training())


async def add_adapter(request: Request) -> Response:
    """One more LoRA adapter over the base of a server started with ``model.adapters``, trained and served from
    now on without a restart (:meth:`SwarmServer.add_adapter`): ``{"adapter", "adapters", "global_step",
    "note"}``."""
    srv = _admin(request)
    req = AddAdapterRequest.parse(await read_json(request))
    return JSONResponse(await srv.add_adapter(req.entry()))


async def checkpoint(request: Request) -> Response:
    """Save the server's state under ``<run_dir>/checkpoints/step_<global step, 8 digits>``.

    The trainer (when the server has one) saves weights, optimizer and pool
    position into that folder first; then the config and the status are
    written beside them, so one call makes one folder.
    """
    srv = _admin(request)
    if srv.run_dir is None:
        raise ApiError(409, "this server has no run_dir to write checkpoints to (server.run_dir)", "no_run_dir")
    run_dir = srv.run_dir
    # the cycle names the folder after the step it saves (a step under way finishes first)
    trainer = await srv.checkpoint(lambda step: checkpoint_path(run_dir, step))
    step = int(trainer["global_step"]) if trainer is not None else srv.global_step
    folder = Path(trainer["path"]) if trainer is not None else checkpoint_path(run_dir, step)
    info: dict[str, Any] = {"path": str(folder), "global_step": step, "time": time.time()}
    folder.mkdir(parents=True, exist_ok=True)
    if srv.config is not None:
        (folder / "config.json").write_text(json.dumps(redacted(to_dict(srv.config)), indent=2))
    (folder / "status.json").write_text(json.dumps(srv.status(), indent=2, default=str))
    info["weights"] = trainer is not None
    if trainer is not None:
        info["trainer"] = trainer
    else:
        info["note"] = "no trainer is wired in: only config and status were saved"
    return JSONResponse(info)
