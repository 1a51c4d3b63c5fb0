"""The request models of the control API's bodies: the episode routes (register, report, prepare, abort,
demonstration), the client routes (ready, heartbeat) and the controller's configure.

Their field errors are 422 ``invalid_field`` (a missing field: ``missing_field``), as the control API
answers them; what needs the server or the episode (the reward against the episode's roles, the
size of ``meta``, a primary on the operator's peers, the demonstration rendered with the template)
is checked by the route, after the caller is authorized.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from swarmkit.config.compose import request_form
from swarmkit.server.schema.jsonschema import (
    Schema,
    array,
    integer,
    nullable,
    number,
    obj,
    ref,
    string,
)
from swarmkit.server.schema.openai import MESSAGES, TOOLS
from swarmkit.server.schema.spec import (
    Custom,
    FieldError,
    Flag,
    Number,
    Object,
    Passed,
    RequestModel,
    Text,
    invalid,
    spec,
)
from swarmkit.swarm.presence import BEAT_RANGE_S

MAX_ROLES = 64
MAX_ID_LEN = 256
#: the longest client id (a body's client_id, or the X-Swarm-Client header)
MAX_CLIENT_ID = 128
CLIENT_ID_MESSAGE = f"'client_id' must be a string of at most {MAX_CLIENT_ID} characters"
#: how the control API answers a field's error
CONTROL_FIELD_ERROR = (422, "invalid_field")

CLIENT_ID = Text(None, "instead of the X-Swarm-Client header", max_length=MAX_CLIENT_ID, null_absent=False,
                 message=CLIENT_ID_MESSAGE)


class ControlRequest(RequestModel):
    """A body of the control API (field errors: 422)."""

    field_error: ClassVar[tuple[int, str]] = CONTROL_FIELD_ERROR


# --------------------------------------------------------------------------- POST /api/v1/episodes
def _task_id(body: dict[str, Any], parsed: dict[str, Any]) -> str:
    task_id = body["task_id"]  # present: the field is required
    if isinstance(task_id, int) and not isinstance(task_id, bool):
        task_id = str(task_id)
    if not isinstance(task_id, str) or not task_id or len(task_id) > MAX_ID_LEN:
        raise invalid(f"'task_id' must be a non-empty string of at most {MAX_ID_LEN} characters", "task_id")
    return task_id


def _roles(body: dict[str, Any], parsed: dict[str, Any]) -> list[str] | None:
    roles = body.get("roles")
    if roles is None:
        return None
    if (not isinstance(roles, list) or not roles or len(roles) > MAX_ROLES
            or not all(isinstance(r, str) and r and len(r) <= MAX_ID_LEN for r in roles)):
        raise invalid(f"'roles' must be a non-empty list of at most {MAX_ROLES} non-empty strings", "roles")
    if len(set(roles)) != len(roles):
        raise invalid("'roles' must not repeat a role", "roles")
    return roles


@dataclass
class RegisterRequest(ControlRequest):
    """``POST /api/v1/episodes``: register an episode."""

    endpoint = "/api/v1/episodes"

    task_id: str = spec(Custom(_task_id, {"anyOf": [string(min_length=1, max_length=MAX_ID_LEN), integer()],
                                          "description": "the task (an integer is read as its text)"},
                               required=True))
    eval: bool = spec(Flag(null_absent=False))
    timeout_s: float | None = spec(Number(None, None, None, "seconds until the server aborts it (default "
                                          "server.episode_timeout_s)", message="'timeout_s' must be a number of seconds"))
    roles: list[str] | None = spec(Custom(_roles, array(string(min_length=1, max_length=MAX_ID_LEN), min_items=1,
                                                        max_items=MAX_ROLES,
                                                        description="one key per role (no repeats)")))
    meta: dict[str, Any] = spec(Object("at most server.max_meta_bytes as JSON", empty=True, null_absent=False))
    client_id: str | None = spec(CLIENT_ID)
    adapter: str | None = spec(Text(None, "the LoRA adapter the episode samples with and trains, on a server with "
                                    "model.adapters (else its first call's 'model' field names it)",
                                    max_length=MAX_ID_LEN))


# --------------------------------------------------------------------------- ending an episode
_REWARD_MISSING = "missing required field 'reward' (a number, or an object role -> number)"


def _primary(body: dict[str, Any], parsed: dict[str, Any]) -> dict[str, str] | None:
    """``primary``: the episode whose commit decides this one (its url is checked against the server's
    peers by the route)."""
    value = body.get("primary")
    if value is None:
        return None
    keys = ("url", "episode_id", "api_key")
    if not isinstance(value, dict) or set(value) != set(keys) or not all(
            isinstance(value[k], str) and 0 < len(value[k]) <= 2048 for k in keys):
        raise invalid("'primary' must be an object with the strings url, episode_id and api_key (the "
                      "episode whose commit decides this one)", "primary")
    if not value["url"].startswith(("http://", "https://")):
        raise invalid("'primary.url' must be an http(s) URL of the primary's server", "primary.url")
    return {k: value[k] for k in keys}


_PRIMARY: Schema = obj({"url": string(min_length=1, max_length=2048, pattern="^https?://"),
                        "episode_id": string(min_length=1, max_length=2048),
                        "api_key": string(min_length=1, max_length=2048)}, ("url", "episode_id", "api_key"),
                       closed=True, description="the episode whose commit decides this one (absent on the primary)")


_CALL_REWARD: Schema = obj(
    {"call": integer(0, description="the call's index in the episode (timeline meta 'call')"),
     "turn": integer(0, description="the call's place among its role's calls (instead of 'call')"),
     "role": string(description="whose turn (with 'turn', in an episode with roles)"),
     "choice": integer(0, description="which choice, for a call that returned several"),
     "reward": number(description="the call's own reward (finite)"),
     "advantages": array(number(), description="the expert option: one advantage per token the call generated")},
    closed=True, description="one recorded call and its own reward or per-token advantages")
_CALL_REWARDS: Schema = array(_CALL_REWARD, description="per-call rewards (an algorithm with per-turn credit, "
                              "e.g. algo=turn_grpo, trains with them; see docs/training.md)")


@dataclass
class ReportRequest(ControlRequest):
    """``POST /api/v1/episodes/{id}/report``: the reward (checked against the episode's roles by the route)."""

    endpoint = "/api/v1/episodes/{episode_id}/report"

    reward: Any = spec(Passed(ref("Reward"), required=True, null_absent=False, missing=_REWARD_MISSING))
    meta: dict[str, Any] | None = spec(Object())
    call_rewards: list[dict[str, Any]] | None = spec(Passed(nullable(_CALL_REWARDS)))


@dataclass
class PrepareRequest(ReportRequest):
    """``POST /api/v1/episodes/{id}/prepare``: a report that waits for ``commit``."""

    endpoint = "/api/v1/episodes/{episode_id}/prepare"

    primary: dict[str, str] | None = spec(Custom(_primary, nullable(_PRIMARY)))


@dataclass
class AbortRequest(ControlRequest):
    """``POST /api/v1/episodes/{id}/abort`` (the body is optional)."""

    endpoint = "/api/v1/episodes/{episode_id}/abort"

    reason: str = spec(Text("aborted by the client", "why (its first 1000 characters are kept)",
                            null_absent=False, message="'reason' must be a string"))


@dataclass
class DemonstrationRequest(RequestModel):
    """``POST /api/v1/episodes/{id}/demonstration``: a conversation ending with the assistant turns to learn
    (its field errors are 400, as a chat's; each message is checked with the template, by the route)."""

    endpoint = "/api/v1/episodes/{episode_id}/demonstration"

    messages: list[Any] = spec(MESSAGES)
    tools: list[dict[str, Any]] | None = spec(TOOLS)


# --------------------------------------------------------------------------- the client routes
@dataclass
class ReadyRequest(ControlRequest):
    """``POST /api/v1/clients/ready``: a client's vote for the batching policy."""

    endpoint = "/api/v1/clients/ready"

    client_id: str | None = spec(CLIENT_ID)
    ready: bool = spec(Flag(required=True, missing="'ready' must be true or false", missing_code="invalid_value"))


@dataclass
class HeartbeatRequest(ControlRequest):
    """``POST /api/v1/clients/heartbeat`` (the body is optional; the client id is the header's)."""

    endpoint = "/api/v1/clients/heartbeat"

    interval_s: float | None = spec(Number(
        *BEAT_RANGE_S, None, "the seconds between this client's beats (missing three, it counts as gone)",
        message=f"'interval_s' must be a number of seconds in [{BEAT_RANGE_S[0]:g}, {BEAT_RANGE_S[1]:g}]"))


# --------------------------------------------------------------------------- POST /api/v1/admin/configure
_FORMS = ("config", "overrides", "yaml")


@dataclass
class ConfigureRequest(ControlRequest):
    """``POST /api/v1/admin/configure``: exactly one of ``config``, ``overrides`` or ``yaml`` (the rule is the
    config layer's :func:`~swarmkit.config.compose.request_form`, which composing the config applies too;
    the config itself is validated by the training schemas when it is composed)."""

    endpoint = "/api/v1/admin/configure"

    config: dict[str, Any] | None = spec(Passed({"type": "object", "description": "a full or partial training "
                                                 "config (laid over the packaged defaults)"}))
    overrides: list[str] | None = spec(Passed(array(string(), description="Hydra overrides, as on the command line")))
    yaml: str | None = spec(Passed(string("the text of a YAML config")))

    def check(self) -> None:
        try:
            request_form({name: getattr(self, name) for name in _FORMS})
        except ValueError as exc:
            message, field = exc.args
            raise FieldError(400, message, "missing_field" if field == "config" else "invalid_value",
                             param=field) from None

    @classmethod
    def openapi_body(cls) -> Schema:
        return {**super().openapi_body(), "oneOf": [{"required": [name]} for name in _FORMS],
                "description": "exactly one of config, overrides or yaml"}


# --------------------------------------------------------------------------- POST /api/v1/admin/adapters
def _adapter_lr(body: dict[str, Any], parsed: dict[str, Any]) -> float | str | None:
    lr = body.get("lr")
    if lr is None or lr == "auto":
        return lr
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not math.isfinite(lr) or lr <= 0:
        raise invalid(f"'lr' must be a number > 0 or \"auto\", got {lr!r}", "lr")
    return float(lr)


@dataclass
class AddAdapterRequest(ControlRequest):
    """``POST /api/v1/admin/adapters``: one more LoRA adapter over the base, trained and served from now on: an
    entry of ``model.adapters`` (whose rules the server applies to the name and the batching keys)."""

    endpoint = "/api/v1/admin/adapters"

    name: str = spec(Text(None, "the adapter's name (a request's 'model' field names it)", min_length=1,
                          max_length=64, required=True))
    lr: float | str | None = spec(Custom(_adapter_lr, {"anyOf": [number(description="> 0"), {"const": "auto"}],
                                                       "description": "its learning rate (default optim.lr)"}))
    batching: dict[str, Any] | None = spec(Object("batching keys for its batches alone, laid over the batching "
                                                  "group, e.g. {\"batch_size\": 2}"))

    def entry(self) -> str | dict[str, Any]:
        """The ``model.adapters`` entry it describes (its name alone when it sets nothing else)."""
        if self.lr is None and not self.batching:
            return self.name
        out: dict[str, Any] = {"name": self.name}
        if self.lr is not None:
            out["lr"] = self.lr
        if self.batching:
            out["batching"] = self.batching
        return out
