"""The controller (admin) API: configure, start, stop, restart, status, checkpoint.

Every endpoint here except ``/`` and ``/api/v1/health`` needs the admin token
(``Authorization: Bearer <token>``): 401 without it, 403 with a wrong one.

``POST /api/v1/admin/configure`` takes one of

- ``{"config": {...}}``: a full or partial training config (a partial one is
  laid over the packaged defaults; a component group given with a ``name``
  selects that option first, like ``backend=vllm`` on the command line);
- ``{"overrides": ["model.path=builtin:tiny", "backend=hf", ...]}``: Hydra
  overrides, composed exactly as the command line does;
- ``{"yaml": "<text of a YAML config>"}``: like ``config``.

The config is validated by the same schemas as the command line; every
problem is listed in one 422 answer. ``server.host/port/run_dir/admin_token``
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

from swarmkit.server.errors import ApiError
from swarmkit.server.openai_api import bearer, read_json

if TYPE_CHECKING:  # pragma: no cover
    from swarmkit.server.app import SwarmServer

_PROCESS_KEYS = ("host", "port", "run_dir", "admin_token")
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
    """State only; no token needed (for load balancers and waiting clients)."""
    srv = _server(request)
    return JSONResponse({"state": str(srv.state.state), "global_step": srv.global_step})


async def status(request: Request) -> Response:
    return JSONResponse(_admin(request).status())


# --------------------------------------------------------------------------- configure
def build_config(body: dict[str, Any], server_cfg: dict[str, Any]) -> Any:
    """The validated training config a configure request describes (blocking: runs Hydra)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from swarmkit.cli import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.errors import ConfigError, SwarmkitError
    from swarmkit.plugins import get_registry
    from swarmkit.registry import KINDS

    given = [k for k in ("config", "overrides", "yaml") if body.get(k) is not None]
    if len(given) != 1:
        raise ApiError(422, "send exactly one of 'config' (an object), 'overrides' (a list of strings) or "
                       "'yaml' (text)", "missing_field", param="config")
    try:
        if given[0] == "overrides":
            overrides = body["overrides"]
            if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
                raise ApiError(422, "'overrides' must be a list of strings like \"model.path=builtin:tiny\"",
                               "invalid_field", param="overrides")
            cfg = compose(overrides)
            cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        else:
            if given[0] == "yaml":
                if not isinstance(body["yaml"], str):
                    raise ApiError(422, "'yaml' must be the text of a YAML document", "invalid_field", param="yaml")
                user = OmegaConf.to_container(OmegaConf.create(body["yaml"]), resolve=False)
            else:
                user = body["config"]
            if not isinstance(user, dict):
                raise ApiError(422, "the config must be a mapping", "invalid_field", param="config")
            user = dict(user)
            user.pop("hydra", None)
            selects = []
            for kind in (*KINDS, "model", "task"):
                node = user.get(kind)
                if isinstance(node, str):
                    selects.append(f"{kind}={node}")
                    user.pop(kind)
                elif isinstance(node, dict) and kind in KINDS and node.get("name"):
                    selects.append(f"{kind}={node['name']}")
            base = OmegaConf.create(OmegaConf.to_container(compose(selects), resolve=False))
            cfg = OmegaConf.merge(base, OmegaConf.create(user))
    except ApiError:
        raise
    except (OmegaConfBaseException, SwarmkitError, ValueError, KeyError) as exc:
        raise ApiError(422, f"could not compose the config: {type(exc).__name__}: {exc}", "invalid_config") from None
    except Exception as exc:  # noqa: BLE001 - Hydra raises many kinds of errors for bad overrides
        raise ApiError(422, f"could not compose the config: {type(exc).__name__}: {exc}", "invalid_config") from None
    cfg.pop("hydra", None)
    cfg.mode = "server"
    for key in _PROCESS_KEYS:
        if key in server_cfg and "server" in cfg:
            cfg.server[key] = server_cfg[key]
    try:
        return validate_config(cfg, get_registry())
    except ConfigError as exc:
        raise ApiError(422, str(exc), "invalid_config") from None


def _build_locked(body: dict[str, Any], server_cfg: dict[str, Any]) -> Any:
    with _compose_lock:
        return build_config(body, server_cfg)


async def configure(request: Request) -> Response:
    srv = _admin(request)
    body = await read_json(request)
    cfg = await anyio.to_thread.run_sync(_build_locked, body, srv.server_cfg)
    srv.set_config(cfg)
    from swarmkit.config.validate import to_dict

    state = srv.state.state
    note = None if str(state) == "OFFLINE" else "the server is running: the new config applies at the next restart"
    return JSONResponse({"state": str(state), "config": to_dict(cfg), "note": note})


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


async def checkpoint(request: Request) -> Response:
    """Save the server's state under ``<run_dir>/checkpoints/step_<n>``.

    Writes the config and the status; trainer state (weights, optimizer) is
    saved by ``checkpoint_fn`` once a trainer is wired in.
    """
    srv = _admin(request)
    if srv.run_dir is None:
        raise ApiError(409, "this server has no run_dir to write checkpoints to (server.run_dir)", "no_run_dir")
    folder = Path(srv.run_dir) / "checkpoints" / f"step_{srv.global_step}"
    folder.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"path": str(folder), "global_step": srv.global_step, "time": time.time()}
    if srv.config is not None:
        from swarmkit.config.validate import to_dict

        (folder / "config.json").write_text(json.dumps(to_dict(srv.config), indent=2))
    (folder / "status.json").write_text(json.dumps(srv.status(), indent=2, default=str))
    if srv.checkpoint_fn is not None:
        result = srv.checkpoint_fn(srv, str(folder))
        if hasattr(result, "__await__"):
            result = await result
        info["trainer"] = result
        info["weights"] = True
    else:
        info["weights"] = False
        info["note"] = "no trainer is wired in: only config and status were saved"
    return JSONResponse(info)
