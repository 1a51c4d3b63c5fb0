"""Ending an episode that spans several servers: all of them keep it, or none does.

A multi-server episode (one game with civilians on server A and spies on
server B, say) is one registered episode per server. The client SDK's
``swarm_episode`` ends it in two phases, in one fixed order of the episodes
(by server URL, then adapter); the first is the **primary**:

1. ``prepare`` every episode: the reward is stored, the episode takes no more
   calls and is not in the pool yet. Each non-primary episode is told where
   the primary is (its URL, id and key).
2. ``commit`` the primary, then the others. The primary's commit is the
   decision: once it is committed, the multi-server episode is committed.

A client that dies anywhere in between leaves prepared episodes behind. Each
server resolves its own at the episode's deadline (or when a drain runs out),
with :func:`resolve_prepared`:

- the primary, never committed: it aborts itself (the decision is "drop");
- a non-primary asks its primary to abort. If the primary answers that it is
  already finished (committed), the non-primary commits; if the abort
  succeeds, or the primary was already aborted or is gone, it aborts.

The abort request is the check: a primary cannot be committed by a late client
after it agreed to abort, and cannot be aborted after it committed, so every
server reaches the primary's outcome. A primary that cannot be reached is
asked again until ``grace_s`` after the deadline; then the episode is dropped
and a warning is logged (the one case that can split the outcome: the primary
committed and stayed unreachable for that long).
"""

from __future__ import annotations

import logging
from typing import Literal

import httpx

from swarmkit.swarm.episodes import Episode

log = logging.getLogger(__name__)

Decision = Literal["commit", "abort", "wait"]


async def ask_primary(primary: dict[str, str], episode_id: str, http: httpx.AsyncClient) -> Decision:
    """Ask the primary episode to abort; what this prepared episode must do given its answer.

    ``commit``: the primary was committed. ``abort``: it is aborted now (by this
    request or before), expired or unknown. ``wait``: unreachable, or its commit is
    being written (ask again).
    """
    url = f"{primary['url'].rstrip('/')}/api/v1/episodes/{primary['episode_id']}"
    headers = {"Authorization": f"Bearer {primary['api_key']}"}
    try:
        resp = await http.post(f"{url}/abort", headers=headers,
                               json={"reason": f"a peer episode ({episode_id}) was never committed"})
        if resp.status_code in (200, 404, 410):
            return "abort"
        if resp.status_code == 409:
            code = _error_code(resp)
            if code in ("episode_committing", "calls_in_flight"):
                return "wait"
            status = await http.get(url, headers=headers)
            if status.status_code == 200:
                return "commit" if status.json().get("status") == "finished" else "abort"
            return "abort" if status.status_code in (404, 410) else "wait"
        if resp.status_code in (401, 403):  # the primary's server no longer knows its key: long ended
            return "abort"
    except (httpx.HTTPError, ValueError) as exc:
        log.info("the primary of prepared episode %s is unreachable: %s", episode_id, exc)
    return "wait"


def _error_code(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error") or {}
    except ValueError:
        return ""
    return str(err.get("code") or "")


async def resolve_prepared(ep: Episode, http: httpx.AsyncClient) -> Decision:
    """The outcome of a prepared episode whose client went away (see the module text)."""
    if ep.primary is None:
        return "abort"
    return await ask_primary(ep.primary, ep.id, http)
