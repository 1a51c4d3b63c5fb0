"""``"strict": true`` tools: constrain their calls while decoding, or check them once generated.

CrewAI sends ``strict: true`` with every tool; OpenAI's meaning is that a call's
arguments always match the tool's ``parameters`` schema. ``server.strict_tools``
chooses how this server keeps that promise:

- ``auto`` (the default): constrained where the engine can (it lists
  ``structural_tag`` in ``sampling_fields``: ``vllm``; ``hf`` with the ``grammar``
  extra installed), checked and reported elsewhere;
- ``constrain``: constrained, and a server whose engine cannot constrain does not
  start (the error names what to install or which backend to pick);
- ``check``: never constrained; every call of a strict tool is checked against the
  schema once generated and a violation is reported (the ``X-Swarm-Strict-Violations``
  header, the timeline's ``meta.strict_violations``), not refused.

A constrained call is checked too (the report stays empty unless the token limit cut
it or the engine's JSON-schema support is narrower than the schema).

The constraint (:func:`tool_call_tag`) is a structural tag in xgrammar's format: the
text is free until it writes the template's tool-call opening (``<tool_call>``),
then one call must follow as the chat template writes it (:meth:`ChatRenderer.tool_call_wrapping`)
with a name among the request's tools and arguments valid for that tool's schema
(any JSON object for a tool sent without ``strict``), then free text again. A
``tool_choice`` that prefills the opening (``required``, a named function) starts
the constraint inside that call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from swarmkit.errors import ConfigError

__all__ = ["MODES", "can_constrain", "check_mode", "tool_call_tag"]

#: the values of ``server.strict_tools``
MODES = ("auto", "constrain", "check")

#: the most whitespace characters in a row inside constrained arguments: templates write one at most
#: (``{"a": 1}``, as ``tojson`` does), and longer runs let a weak model spend its token budget on
#: spaces and newlines (measured: the tiny random model cut its calls at 64 tokens with 4)
MAX_WHITESPACE = 1

#: the arguments schema of a tool sent without ``strict`` (its calls are constrained to well-formed calls)
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def check_mode(mode: str, backend: Any) -> str:
    """The mode a server runs with (``constrain`` or ``check``) for ``server.strict_tools: mode``.

    :raises ConfigError: an unknown mode, or ``constrain`` on an engine that cannot constrain decoding
        (the engine's ``structural_tag_hint`` says why, if it has one).
    """
    if mode not in MODES:
        raise ConfigError([f"server.strict_tools must be one of {', '.join(MODES)}, got {mode!r}"])
    able = can_constrain(backend)
    if mode == "constrain" and not able:
        hint = getattr(backend, "structural_tag_hint", None) or "pick an engine that constrains decoding (backend=vllm)"
        raise ConfigError([f"server.strict_tools=constrain: the {type(backend).__name__} engine cannot constrain tool "
                           f"calls: {hint}; or set server.strict_tools=auto (constrain where the engine can, else "
                           "check and report) or check"])
    return "constrain" if mode != "check" and able else "check"


def can_constrain(backend: Any) -> bool:
    """Whether ``backend`` takes ``SamplingParams.structural_tag``."""
    return "structural_tag" in getattr(backend, "sampling_fields", frozenset())


def _args(schema: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": dict(schema) if schema is not None else ANY_OBJECT,
            "max_whitespace_cnt": MAX_WHITESPACE}


def tool_call_tag(wrapping: tuple[str, str, str], tools: Mapping[str, Mapping[str, Any] | None], *,
                  opened: str | None = None, parallel: bool = True) -> dict[str, Any]:
    """The structural tag (xgrammar's format) that forces tool calls into shape.

    :param wrapping: ``(prefix, between, suffix)`` of one call as the template writes it
        (:meth:`~swarmkit.timelines.render.ChatRenderer.tool_call_wrapping`); ``prefix`` starts with
        ``<tool_call>``, the trigger.
    :param tools: name -> arguments schema of every tool offered (None: any JSON object).
    :param opened: the prompt already holds the start of a call: ``""`` up to the name (``tool_choice:
        required``), a tool's name up to its arguments (a named ``tool_choice``); None: nothing opened.
    :param parallel: more calls may follow the first (``parallel_tool_calls``).
    """
    prefix, between, suffix = wrapping
    trigger = "<tool_call>" if prefix.startswith("<tool_call>") else prefix
    if not tools:
        raise ValueError("tool_call_tag needs at least one tool")
    free = {"type": "triggered_tags", "triggers": [trigger],
            "tags": [{"type": "tag", "begin": prefix + name + between, "content": _args(schema), "end": suffix}
                     for name, schema in tools.items()],
            "at_least_one": False, "stop_after_first": not parallel}
    if opened is None:
        return {"type": "structural_tag", "format": free}
    if opened == "":
        first: dict[str, Any] = {"type": "or", "elements": [
            {"type": "tag", "begin": name + between, "content": _args(schema), "end": suffix}
            for name, schema in tools.items()]}
    else:
        if opened not in tools:
            raise ValueError(f"the opened call names {opened!r}, which is not among the tools")
        first = {"type": "sequence", "elements": [_args(tools[opened]), {"type": "const_string", "value": suffix}]}
    elements = [first, free] if parallel else [first]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}
