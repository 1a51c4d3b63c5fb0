"""The script file of the ``scripted`` backend: parsed and checked once, then matched per call.

A script is YAML (or JSON, which YAML reads too)::

    rules:                       # tried first, in order; the first that matches answers
      - when: {contains: "weather"}        # or {regex: "..."}: searched in the new messages
        reply: {tool_calls: [{name: get_weather, arguments: {city: Paris}}]}
    replies:                     # otherwise: the k-th answer of a conversation is replies[k]
      - "Hello!"                 #   (k = assistant turns already in the prompt; the last one repeats)
      - {content: "Let me add.", tool_calls: [{name: add, arguments: {a: 1, b: 2}}]}

A bare list is ``replies``. A reply is a string (the message content) or a mapping with
``content`` and/or ``tool_calls`` (each ``name`` and ``arguments``, a mapping or a JSON string);
tool calls are written in the served model's tool-call format, so the server parses them back
into OpenAI ``tool_calls``. Every problem is a :class:`ScriptError` naming the file and the
entry (``rules[1].reply.tool_calls[0]: 'name' is missing``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmkit.timelines.toolcalls import CLOSE, OPEN

TOP_KEYS = ("replies", "rules")
REPLY_KEYS = ("content", "tool_calls")
RULE_KEYS = ("when", "reply")
WHEN_KEYS = ("contains", "regex")


class ScriptError(ValueError):
    """A script file that cannot be used: the message names the file and the entry."""


@dataclass(frozen=True)
class Rule:
    """Answer ``reply`` when ``pattern`` is found in the messages since the model last spoke."""

    pattern: re.Pattern[str]
    reply: str


@dataclass(frozen=True)
class Script:
    """A parsed script: ``rules`` first, then ``replies`` by turn."""

    rules: tuple[Rule, ...]
    replies: tuple[str, ...]

    def answer(self, new_text: str, turn: int) -> str:
        """The reply text for a call whose new messages read ``new_text``, at assistant turn ``turn``.

        :raises LookupError: no rule matches and the script has no ``replies``.
        """
        for rule in self.rules:
            if rule.pattern.search(new_text):
                return rule.reply
        if not self.replies:
            raise LookupError(f"no rule of the script matches (and it has no 'replies'); the new messages "
                              f"were: {new_text[-200:]!r}")
        return self.replies[min(turn, len(self.replies) - 1)]


def _tool_call(value: Any, where: str) -> str:
    if not isinstance(value, dict):
        raise ScriptError(f"{where}: expected a mapping with 'name' and 'arguments', got {type(value).__name__}")
    unknown = sorted(set(value) - {"name", "arguments"})
    if unknown:
        raise ScriptError(f"{where}: unknown key '{unknown[0]}' (a tool call has 'name' and 'arguments')")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ScriptError(f"{where}: 'name' is missing (a non-empty string)")
    args = value.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise ScriptError(f"{where}.arguments: not valid JSON ({exc})") from None
    if not isinstance(args, dict):
        raise ScriptError(f"{where}.arguments: expected a mapping (or a JSON object string), got "
                          f"{type(args).__name__}")
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CLOSE}"


def reply_text(value: Any, where: str) -> str:
    """The generated text of one reply entry (content, then its tool calls in the model's format)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise ScriptError(f"{where}: expected a string or a mapping with 'content' and/or 'tool_calls', "
                          f"got {type(value).__name__}")
    unknown = sorted(set(value) - set(REPLY_KEYS))
    if unknown:
        raise ScriptError(f"{where}: unknown key '{unknown[0]}' (a reply has {', '.join(REPLY_KEYS)})")
    if not any(k in value for k in REPLY_KEYS):
        raise ScriptError(f"{where}: empty reply (give 'content' and/or 'tool_calls')")
    content = value.get("content", "")
    if not isinstance(content, str):
        raise ScriptError(f"{where}.content: expected a string, got {type(content).__name__}")
    calls = value.get("tool_calls", [])
    if not isinstance(calls, list):
        raise ScriptError(f"{where}.tool_calls: expected a list, got {type(calls).__name__}")
    parts = [content] if content else []
    parts += [_tool_call(c, f"{where}.tool_calls[{i}]") for i, c in enumerate(calls)]
    return "\n".join(parts)


def _rule(value: Any, where: str) -> Rule:
    if not isinstance(value, dict):
        raise ScriptError(f"{where}: expected a mapping with 'when' and 'reply', got {type(value).__name__}")
    unknown = sorted(set(value) - set(RULE_KEYS))
    if unknown:
        raise ScriptError(f"{where}: unknown key '{unknown[0]}' (a rule has 'when' and 'reply')")
    for key in RULE_KEYS:
        if key not in value:
            raise ScriptError(f"{where}: '{key}' is missing")
    when = value["when"]
    if not isinstance(when, dict) or len(when) != 1 or next(iter(when)) not in WHEN_KEYS:
        raise ScriptError(f"{where}.when: expected one of {{contains: TEXT}} or {{regex: PATTERN}}, got {when!r}")
    kind, pattern = next(iter(when.items()))
    if not isinstance(pattern, str) or not pattern:
        raise ScriptError(f"{where}.when.{kind}: expected a non-empty string, got {pattern!r}")
    try:
        compiled = re.compile(re.escape(pattern) if kind == "contains" else pattern)
    except re.error as exc:
        raise ScriptError(f"{where}.when.regex: not a valid regular expression ({exc})") from None
    return Rule(compiled, reply_text(value["reply"], f"{where}.reply"))


def parse_script(data: Any) -> Script:
    """A :class:`Script` from the loaded YAML/JSON value (a list of replies, or a mapping)."""
    if isinstance(data, list):
        data = {"replies": data}
    if not isinstance(data, dict):
        raise ScriptError(f"expected a mapping with 'replies' and/or 'rules' (or a list of replies), got "
                          f"{type(data).__name__}")
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise ScriptError(f"unknown key '{unknown[0]}' (a script has {', '.join(TOP_KEYS)})")
    replies, rules = data.get("replies") or [], data.get("rules") or []
    if not isinstance(replies, list):
        raise ScriptError(f"replies: expected a list, got {type(replies).__name__}")
    if not isinstance(rules, list):
        raise ScriptError(f"rules: expected a list, got {type(rules).__name__}")
    if not replies and not rules:
        raise ScriptError("the script has no replies and no rules")
    return Script(rules=tuple(_rule(r, f"rules[{i}]") for i, r in enumerate(rules)),
                  replies=tuple(reply_text(r, f"replies[{i}]") for i, r in enumerate(replies)))


def load_script(path: str | Path) -> Script:
    """Read and check the script file at ``path``.

    :raises ScriptError: the file is missing, is not YAML/JSON, or an entry is wrong (named in the message).
    """
    import yaml

    p = Path(path).expanduser()
    if not str(path):
        raise ScriptError("no script given: backend.script=PATH (a YAML or JSON file; docs/backends.md)")
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScriptError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ScriptError(f"{p}: not valid YAML/JSON{at}: {getattr(exc, 'problem', None) or exc}") from None
    try:
        return parse_script(data)
    except ScriptError as exc:
        raise ScriptError(f"{p}: {exc}") from None


def since_model_spoke(prompt: str, assistant_header: str, turn_end: str, user_header: str) -> tuple[str, int]:
    """The text of the messages since the model last spoke, and how many assistant turns came before.

    ``prompt`` is a rendered chat prompt that ends with ``assistant_header`` (the generation prompt).
    After the last earlier assistant turn (its header, then up to its ``turn_end``) come the new
    messages (user, tool results); with no assistant turn yet, the text after the last ``user_header``.
    An empty marker (a template the probes could not read) gives the whole prompt.
    """
    body = prompt[: len(prompt) - len(assistant_header)] if assistant_header and prompt.endswith(
        assistant_header) else prompt
    if not assistant_header or not turn_end:
        return body, 0
    turns = body.count(assistant_header)
    last = body.rfind(assistant_header)
    if last >= 0:
        end = body.find(turn_end, last + len(assistant_header))
        return (body[end + len(turn_end):] if end >= 0 else ""), turns
    if user_header:
        at = body.rfind(user_header)
        if at >= 0:
            return body[at + len(user_header):], 0
    return body, 0
