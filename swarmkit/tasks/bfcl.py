"""``bfcl``: BFCL multi-turn tool use, executed against the benchmark's simulated APIs, scored by its checker.

The data (``BFCL_v4_multi_turn_base.json`` and its ground truth), the tool
documentation and the simulated APIs (``eval_checker/multi_turn_eval/
func_source_code/``: a file system, a trading bot, a travel API...) are plain
files of the ``bfcl-eval`` package, which declares heavy pinned dependencies
(``numpy==1.26.4``, ``sentence-transformers``, several model SDKs) that none of
these files import. So it is installed **without its dependencies**
(``pip install --no-deps bfcl-eval==2026.3.23``); the multi-turn categories need
only ``mpmath`` (installed with torch's ``sympy``). Imported only when the task is used.

An item is one BFCL entry. The held-out split is fixed by the entry's id (CRC-32
of the id mod 5 == 0: 36 of the 200 ``multi_turn_base`` entries), whatever the
task seed; train and demo items come from the other 164. An episode plays the
entry's user turns in order (``task.options.user_turns``: only the first N;
0 = all): each turn, the agent is called with the involved classes' tools
(``task.options.tools``: ``all``, BFCL's setting, or ``needed``: only the
functions the turn's ground truth calls, an easier variant for small models;
``task.options.brief``: drop the class boilerplate from each description) up to
``task.options.max_steps`` times (default 4); its tool calls run against the
episode's own instances of the simulated APIs (the benchmark's
``execute_multi_turn_func_call``) and the results go back as ``tool`` messages;
a reply without a tool call ends the turn.

Reward: the benchmark's own ``multi_turn_checker`` (state and response checks
after every turn, against the ground truth executed from the same initial
state) on the first k turns, for k = 1, 2, ...: the reward is the share of the
episode's turns that pass before the first failure (1.0 = the whole entry passes,
BFCL's accuracy), plus ``task.options.tool_credit`` (default 0) when the episode
made a well-formed call. Metrics: ``correct`` (the whole entry passed),
``turns_passed``, ``valid_tool_call``, ``tool_calls``, ``turns`` (chat calls).

Safety: the benchmark executes call strings with ``eval``; the strings this
module builds are a tool name from the entry's own tools and keyword arguments
written with ``repr`` of JSON values, so nothing the model writes is ever code.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import json
import keyword
import random
import uuid
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from swarmkit.tasks.base import Outcome, Task, chat_tool_turn

__all__ = ["CATEGORIES", "SYSTEM_PROMPT", "call_string", "demonstration", "eval_split", "grade_calls",
           "make_bfcl_tasks", "run_bfcl_episode"]

_INSTALL = ("task=bfcl needs bfcl-eval's data and simulated APIs: pip install --no-deps bfcl-eval==2026.3.23 "
            "(without its pinned dependencies; see docs/environments.md)")
#: the categories this task plays (the others need BFCL's handling of held-out functions or memory backends)
CATEGORIES = ("multi_turn_base", "multi_turn_long_context")
SYSTEM_PROMPT = ("Do what the user asks by calling the tools, one after another as needed. "
                 "When the request is done, reply briefly without a tool call.")
_BOILERPLATE = "Tool description: "
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer", "bool": "boolean",
          "str": "string", "list": "array"}
_EXEC = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils"
_CHECK = "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker"
_CONFIG = "bfcl_eval.constants.executable_backend_config"


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"{_INSTALL} ({exc})") from exc


@functools.cache
def _data_dir() -> Path:
    spec = importlib.util.find_spec("bfcl_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(_INSTALL)
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@functools.cache
def _entries(category: str) -> tuple[tuple[dict[str, Any], list[list[str]]], ...]:
    """(entry, ground truth per turn) of every entry of ``category``, in file order."""
    if category not in CATEGORIES:
        raise ValueError(f"task.options.category: {category!r} is not played; one of {', '.join(CATEGORIES)}")
    data = _data_dir()
    entries = _read_jsonl(data / f"BFCL_v4_{category}.json")
    truth = {row["id"]: row["ground_truth"] for row in _read_jsonl(data / "possible_answer" / f"BFCL_v4_{category}.json")}
    return tuple((e, truth[e["id"]]) for e in entries)


@functools.cache
def _func_docs(class_name: str) -> tuple[dict[str, Any], ...]:
    mapping = _module(_CONFIG).MULTI_TURN_FUNC_DOC_FILE_MAPPING
    return tuple(_read_jsonl(_data_dir() / "multi_turn_func_doc" / mapping[class_name]))


def eval_split(entry_id: str) -> bool:
    """Whether entry ``entry_id`` is held out (fixed by its id, never by the task seed)."""
    return zlib.crc32(entry_id.encode()) % 5 == 0


def _schema(node: Any) -> Any:
    """BFCL's parameter schema as JSON Schema (``dict`` -> ``object``, ``float`` -> ``number``, ``any`` -> untyped)."""
    if isinstance(node, list):
        return [_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type" and isinstance(value, str):
            if value == "any":
                continue
            out[key] = _TYPES.get(value, value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _schema(v) for name, v in value.items()}
        else:
            out[key] = _schema(value)
    return out


def _tool(doc: dict[str, Any], brief: bool) -> dict[str, Any]:
    description = str(doc.get("description", ""))
    if brief and _BOILERPLATE in description:
        description = description.split(_BOILERPLATE, 1)[1]
    return {"type": "function", "function": {"name": doc["name"], "description": description,
                                             "parameters": _schema(doc["parameters"])}}


def _called(call: str) -> str:
    node = ast.parse(call, mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError(f"not a plain call: {call!r}")
    return node.func.id


def make_bfcl_tasks(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    """``n`` items of ``split``: eval items are the held-out entries (at most all of them, shuffled by
    ``seed``); train and demo items cycle through the rest in a seeded order."""
    category = str(options.get("category", "multi_turn_base"))
    user_turns = int(options.get("user_turns", 0))
    tools_mode = str(options.get("tools", "all"))
    if tools_mode not in ("all", "needed"):
        raise ValueError(f"task.options.tools: {tools_mode!r}; one of all, needed")
    if user_turns < 0:
        raise ValueError("task.options.user_turns must be 0 (all) or positive")
    brief = bool(options.get("brief", False))
    system = str(options.get("system", SYSTEM_PROMPT))
    held_out = split == "eval"
    pool = [(e, gt) for e, gt in _entries(category) if eval_split(e["id"]) == held_out]
    random.Random(f"bfcl-{split}-{seed}").shuffle(pool)
    count = min(n, len(pool)) if held_out else n
    tasks = []
    for i in range(count):
        entry, truth = pool[i % len(pool)]
        k = min(user_turns or len(truth), len(truth))
        turns, truth = [list(t) for t in entry["question"][:k]], [list(t) for t in truth[:k]]
        docs = [d for c in entry["involved_classes"] for d in _func_docs(c)]
        if tools_mode == "needed":
            names = {_called(c) for turn in truth for c in turn}
            docs = [d for d in docs if d["name"] in names]
        tasks.append(Task(
            task_id=f"bfcl-{split}-{i}", family="bfcl", answer="",
            messages=[{"role": "system", "content": system}] if system else [],
            meta={"entry": entry, "turns": turns, "ground_truth": truth,
                  "tools": [_tool(d, brief) for d in docs],
                  "max_steps": int(options.get("max_steps", 4)),
                  "tool_credit": float(options.get("tool_credit", 0.0))},
        ))
    return tasks


def _literal(value: Any) -> bool:
    if isinstance(value, bool | int | str) or value is None:
        return True
    if isinstance(value, float):
        return value == value and abs(value) != float("inf")
    if isinstance(value, list):
        return all(_literal(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _literal(v) for k, v in value.items())
    return False


def call_string(name: str, arguments: str | dict[str, Any], allowed: set[str]) -> str:
    """The benchmark's call string of one tool call, ``name(key=value, ...)``; ``ValueError`` (the reason)
    for an unknown tool or arguments that are not a JSON object of plain keys and values. The string is
    safe to ``eval``: a known name and ``repr`` of JSON values."""
    if name not in allowed:
        raise ValueError(f"unknown tool {name!r}")
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise ValueError("arguments are not JSON") from None
    if args is None:
        args = {}
    if not isinstance(args, dict) or not _literal(args):
        raise ValueError("arguments must be a JSON object")
    bad = [k for k in args if not k.isidentifier() or keyword.iskeyword(k)]
    if bad:
        raise ValueError(f"bad argument name {bad[0]!r}")
    return f"{name}({', '.join(f'{k}={v!r}' for k, v in args.items())})"


@contextmanager
def _instances() -> Iterator[str]:
    """A name prefix for one episode's simulated-API instances; the benchmark keeps them in its module's
    globals (by model name and entry id), so they are dropped on exit."""
    prefix = f"swarmkit_{uuid.uuid4().hex}"
    try:
        yield prefix
    finally:
        space = vars(_module(_EXEC))
        for key in [k for k in list(space) if k.startswith(prefix)]:
            space.pop(key, None)


def _execute(calls: list[str], entry: dict[str, Any], model_name: str) -> list[str]:
    results, _ = _module(_EXEC).execute_multi_turn_func_call(
        func_call_list=calls, initial_config=entry["initial_config"], involved_classes=entry["involved_classes"],
        model_name=model_name, test_entry_id=entry["id"], long_context="long_context" in entry["id"])
    return [str(r) for r in results]


def grade_calls(task: Task, decoded: list[list[list[str]]], prefix: str) -> tuple[int, bool]:
    """(how many leading turns pass the benchmark's checker, whether all do) for ``decoded``: per turn, per
    step, the call strings the agent made."""
    checker = _module(_CHECK).multi_turn_checker
    truth, entry = task.meta["ground_truth"], task.meta["entry"]
    passed, run = 0, uuid.uuid4().hex[:8]  # the checker's instances are cached by name: new names each call
    for k in range(1, len(truth) + 1):
        result = checker(decoded[:k], truth[:k], entry, entry["id"].rsplit("_", 1)[0], f"{prefix}_{run}_check{k}")
        if not result["valid"]:
            break
        passed = k
    return passed, passed == len(truth)


def run_bfcl_episode(http: httpx.Client, base_url: str, api_key: str, task: Task, *, max_tokens: int,
                     temperature: float, seed: int | None = None) -> Outcome:
    """Play the entry's user turns against the endpoint, executing the agent's calls; grade with the checker."""
    entry, tools = task.meta["entry"], task.meta["tools"]
    allowed = {t["function"]["name"] for t in tools}
    messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
    decoded: list[list[list[str]]] = []
    n_calls = n_valid = chats = 0
    with _instances() as prefix:
        def run_calls(calls: list[dict[str, Any]]) -> list[str]:
            """The reply's calls as the benchmark's call strings, the valid ones executed together."""
            nonlocal n_calls, n_valid
            strings: list[str | None] = []
            errors: list[str] = []
            for c in calls:
                fn = c.get("function") or {}
                try:
                    strings.append(call_string(str(fn.get("name")), fn.get("arguments") or "{}", allowed))
                    errors.append("")
                except ValueError as exc:
                    strings.append(None)
                    errors.append(f"Error: {exc}")
            valid = [s for s in strings if s is not None]
            results = iter(_execute(valid, entry, prefix))
            n_calls += len(calls)
            n_valid += len(valid)
            if valid:
                decoded[-1].append(valid)  # this turn's steps
            return [next(results) if s is not None else error for s, error in zip(strings, errors, strict=True)]

        for turn in task.meta["turns"]:
            messages.extend(dict(m) for m in turn)
            decoded.append([])
            _, used = chat_tool_turn(http, base_url, api_key, messages, tools=tools, run_calls=run_calls,
                                     max_steps=int(task.meta["max_steps"]), max_tokens=max_tokens,
                                     temperature=temperature, seed=seed)
            chats += used
        passed, correct = grade_calls(task, decoded, prefix)
    turns = len(task.meta["ground_truth"])
    reward = passed / turns + (float(task.meta["tool_credit"]) if n_valid else 0.0)
    final = next((str(m.get("content") or "") for m in reversed(messages) if m["role"] == "assistant"), "")
    return Outcome(reward, final, {"correct": float(correct), "turns_passed": passed / turns,
                                   "valid_tool_call": float(n_valid > 0), "tool_calls": float(n_calls),
                                   "turns": float(chats)}, messages)


def _keywords(call: str, entry: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ground-truth call string as (name, keyword arguments): positional arguments get the simulated
    method's parameter names."""
    node = ast.parse(call, mode="eval").body
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    name = node.func.id
    paths = _module(_CONFIG).CLASS_FILE_PATH_MAPPING
    params: list[str] = []
    for cls in entry["involved_classes"]:
        method = getattr(getattr(_module(paths[cls]), cls), name, None)
        if method is not None:
            params = [p for p in inspect.signature(method).parameters if p != "self"]
            break
    args = {params[i]: ast.literal_eval(a) for i, a in enumerate(node.args)}
    args.update({kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg})
    return name, args


def demonstration(task: Task) -> dict[str, Any]:
    """The ground truth as a conversation (``messages`` + ``tools``) for ``POST .../demonstration``: per turn,
    the user's request, one assistant message with the turn's calls, their results from the simulated APIs,
    and a short closing reply."""
    entry = task.meta["entry"]
    messages: list[dict[str, Any]] = [dict(m) for m in task.messages]
    with _instances() as prefix:
        for t, (turn, truth) in enumerate(zip(task.meta["turns"], task.meta["ground_truth"], strict=True)):
            messages.extend(copy.deepcopy(turn))
            if not truth:
                messages.append({"role": "assistant", "content": "I cannot do that with these tools."})
                continue
            calls = []
            for j, call in enumerate(truth):
                name, args = _keywords(call, entry)
                calls.append({"id": f"call_{t}_{j}", "type": "function",
                              "function": {"name": name, "arguments": json.dumps(args)}})
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            for c, result in zip(calls, _execute(list(truth), entry, prefix), strict=True):
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": result})
            messages.append({"role": "assistant", "content": "Done."})
    return {"messages": messages, "tools": task.meta["tools"]}
