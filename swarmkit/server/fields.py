"""Which request fields each inference endpoint reads: nothing is accepted silently.

Every field of a request is one of

- **honoured**: it changes the generation as the protocol says;
- **refused**: it would change the generation in a way this server cannot honour,
  so a value other than its no-op gets a 400 naming it (checked by the endpoint);
- **ignored**: harmless metadata (``user``, ``metadata``, ``store``...), listed
  in docs/server_api.md;
- **unknown**: anything else. By default the call goes through, the server logs
  the names once and answers with the header ``X-Swarm-Ignored-Fields``; with
  ``server.strict_fields: true`` it is a 400.
"""

from __future__ import annotations

import logging
from urllib.parse import quote

from swarmkit.errors import ApiError
from swarmkit.server.schema.anthropic import CountTokensRequest, MessagesRequest
from swarmkit.server.schema.openai import ChatRequest, CompletionsRequest
from swarmkit.server.schema.responses import ResponsesRequest
from swarmkit.server.schema.spec import FieldTable

log = logging.getLogger("swarmkit.server")

IGNORED_HEADER = "X-Swarm-Ignored-Fields"


#: derived from the request models (swarmkit/server/schema/): one declaration per field
CHAT = ChatRequest.table()
COMPLETIONS = CompletionsRequest.table()
MESSAGES = MessagesRequest.table()
COUNT_TOKENS = CountTokensRequest.table()
RESPONSES = ResponsesRequest.table()


def unknown_fields(body: dict[str, object], table: FieldTable, *, strict: bool) -> list[str]:
    """The names in ``body`` that ``table`` does not know (sorted); a 400 in strict mode.

    A name starting with ``x_`` or ``x-`` is never unknown (private client metadata).
    """
    unknown = sorted(k for k in body if k not in table.known and k not in table.ignored
                     and not k.startswith(("x_", "x-")))
    if not unknown:
        return []
    if strict:
        raise ApiError(400, f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                       f"for {table.endpoint} (server.strict_fields is on; docs/server_api.md lists the fields)",
                       "unknown_field", param=unknown[0])
    _log_once(table.endpoint, unknown)
    return unknown


#: unknown names already logged, per endpoint; at most _MAX_LOGGED (clients can make up any number)
_logged: set[tuple[str, str]] = set()
_MAX_LOGGED = 1000
#: the longest X-Swarm-Ignored-Fields value (clients parse response headers with size limits)
MAX_HEADER_CHARS = 1024


def quoted(name: str) -> str:
    """A field name as it appears in the header and the log: percent-encoded UTF-8 outside letters,
    digits and ``_.-~`` (a name may hold any character; an HTTP header value may not)."""
    return quote(name, safe="")


def _log_once(endpoint: str, names: list[str]) -> None:
    new = [n for n in names if (endpoint, n) not in _logged][:_MAX_LOGGED - len(_logged)]
    if new:
        _logged.update((endpoint, n) for n in new)
        log.warning("%s: ignoring unknown request field(s) %s (answered in the %s header; server.strict_fields: "
                    "true refuses them)%s", endpoint, ", ".join(map(quoted, new)), IGNORED_HEADER,
                    "; further new names are not logged" if len(_logged) >= _MAX_LOGGED else "")


def ignored_header(unknown: list[str]) -> dict[str, str]:
    """The response header naming the unknown fields, comma-separated and percent-encoded (:func:`quoted`);
    names past :data:`MAX_HEADER_CHARS` are counted as ``+N more``. Empty when there are none."""
    if not unknown:
        return {}
    names: list[str] = []
    size = 0
    for name in map(quoted, unknown):
        if size + len(name) + 1 > MAX_HEADER_CHARS:
            names.append(f"+{len(unknown) - len(names)} more")
            break
        names.append(name)
        size += len(name) + 1
    return {IGNORED_HEADER: ",".join(names)}


#: a non-streamed answer whose calls of ``strict`` tools break their schema names the problems here
STRICT_HEADER = "X-Swarm-Strict-Violations"
_strict_logged: set[str] = set()


def strict_header(endpoint: str, violations: list[list[str]]) -> dict[str, str]:
    """The response header of the strict-tool and ``response_format`` violations of each choice (``choices[i]:
    ...`` when there are several), ``; ``-separated and percent-encoded, cut to :data:`MAX_HEADER_CHARS`; logged
    once per endpoint. Empty when every answer conforms."""
    lines = [f"choices[{i}].{v}" if len(violations) > 1 else v for i, vs in enumerate(violations) for v in vs]
    if not lines:
        return {}
    if endpoint not in _strict_logged:
        _strict_logged.add(endpoint)
        log.warning("%s: an answer breaks the schema its request asked for (%s); it is answered as generated and "
                    "reported in the %s header and the timeline's meta.strict_violations (a strict tool on an "
                    "engine that does not constrain calls, server.strict_tools, a token limit that cut the answer, "
                    "or a grammar that let through what JSON refuses; further violations are not logged)",
                    endpoint, lines[0], STRICT_HEADER)
    value = quote("; ".join(lines), safe=" ()[]'\":;,.=<>_-/")
    if len(value) > MAX_HEADER_CHARS:
        cut = value[: MAX_HEADER_CHARS - 3]
        escape = cut.rfind("%", len(cut) - 2)  # never cut inside a %XX escape
        value = (cut[:escape] if escape >= 0 else cut) + "..."
    return {STRICT_HEADER: value}
