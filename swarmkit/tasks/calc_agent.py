"""``calc_agent``: arithmetic word problems that need a calculator tool (multi-turn, client side).

Each problem multiplies a 3-digit by a 2-digit number, or adds / subtracts two
4-digit numbers, in a one-sentence story ("A warehouse stores 347 crates with 86
bottles in each crate..."): operands too large for a 135M model to do in its
head, easy with the ``calculator`` tool. An episode is up to ``max_turns``
chat calls with ``tools=[CALCULATOR_TOOL]``: the agent calls the calculator, the
client runs it (:func:`calculator`, a small evaluator of its own that never calls
``ast`` or ``compile``, so it is safe and deterministic from any thread) and sends the result back
as a ``tool`` message, and the agent ends with ``<answer>N</answer>``.

Reward (:func:`grade`): 1.0 for the right answer, plus ``TOOL_CREDIT`` (0.1)
when the episode made at least one well-formed calculator call (a JSON object
with an ``expression`` the calculator evaluates) — a small shaping term that
rewards the tool format before answers are right. Metrics per episode:
``correct``, ``valid_tool_call``, ``tool_calls``, ``turns``.

:func:`demonstration` writes the ideal conversation of a problem (one tool
call, its result, the answer) for the supervised warm start. The same
problems, tool and grading drive the framework examples (examples/frameworks/).
Needs only httpx.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import operator
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from swarmkit.tasks.base import Outcome, Task, run_tool_loop

__all__ = ["CALCULATOR_TOOL", "SYSTEM_PROMPT", "TOOL_CREDIT", "calculator", "call_calculator", "demonstration", "grade", "load_agent",
           "make_calc_tasks", "parse_answer", "run_calc_episode", "run_tool_call"]

#: an agent in another framework: (base_url, api_key, task, *, temperature, seed, max_tokens, max_turns)
#: -> (final_text, valid_tool_calls, tool_calls, turns), as examples/frameworks/*.py write it
AgentFn = Callable[..., tuple[str, int, int, int]]

TOOL_CREDIT = 0.1

SYSTEM_PROMPT = "Compute with the calculator tool, then reply <answer>N</answer>."

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate arithmetic, e.g. 347 * 86",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}

_STORIES = [
    ("*", "A warehouse stores {a} crates with {b} bottles in each crate. How many bottles are there?"),
    ("*", "A train travels {a} km every day for {b} days. How many km does it travel in total?"),
    ("*", "A school orders {a} boxes of pencils with {b} pencils per box. How many pencils is that?"),
    ("+", "A library had {a} books and received {b} more. How many books does it have now?"),
    ("+", "A city planted {a} trees last year and {b} trees this year. How many trees were planted?"),
    ("-", "A farm harvested {a} kg of apples and sold {b} kg. How many kg are left?"),
    ("-", "A stadium has {a} seats and {b} are taken. How many seats are free?"),
]
_ANSWER_RE = re.compile(r"<answer>\s*(-?[\d,]+)\s*</answer>")
#: the calculator's binary operators: symbol -> (precedence, right-associative, function)
_BINOPS: dict[str, tuple[int, bool, Callable[[Any, Any], Any]]] = {
    "+": (1, False, operator.add), "-": (1, False, operator.sub),
    "*": (2, False, operator.mul), "/": (2, False, operator.truediv),
    "//": (2, False, operator.floordiv), "%": (2, False, operator.mod),
    "**": (4, True, operator.pow),
}
_UNARY_PRECEDENCE = 3  # binds tighter than * and looser than **: -2**2 == -4, as in Python
_TOKEN_RE = re.compile(r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|(\*\*|//|[-+*/%()]))")
_MAX_NESTING = 32
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10**30


def make_calc_tasks(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    """``n`` problems of ``split`` (train and eval draw from disjoint seeds)."""
    rng = random.Random(f"calc-{split}-{seed}")
    system = str(options.get("system", SYSTEM_PROMPT))
    tasks = []
    for i in range(n):
        op, story = _STORIES[rng.randrange(len(_STORIES))]
        if op == "*":
            a, b = rng.randint(101, 999), rng.randint(11, 99)
        else:
            a, b = sorted((rng.randint(1000, 9999), rng.randint(1000, 9999)), reverse=op == "-")
        value = {"*": a * b, "+": a + b, "-": a - b}[op]
        tasks.append(Task(
            task_id=f"calc-{split}-{i}",
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": story.format(a=a, b=b)}],
            answer=str(value), family="calc_agent",
            meta={"expression": f"{a} {op} {b}", "max_turns": int(options.get("max_turns", 3)),
                  "agent": str(options.get("agent", ""))},
        ))
    return tasks


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN_RE.match(text, pos)
        if m is None or m.end() == pos:
            if not text[pos:].strip():
                break
            raise ValueError(f"unexpected {text[pos:].strip()[:10]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


class _Parser:
    """Precedence climbing over :func:`_tokens`: numbers, unary + -, + - * / // % ** and parentheses,
    with Python's precedence and associativity; nesting, exponents and magnitudes are bounded."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise ValueError("incomplete expression")
        self.pos += 1
        return tok

    def expression(self, min_precedence: int = 1) -> int | float:
        left = self.unary()
        while (op := self.peek()) in _BINOPS:
            precedence, right_assoc, fn = _BINOPS[op]
            if precedence < min_precedence:
                break
            self.pos += 1
            right = self.expression(precedence if right_assoc else precedence + 1)
            if op == "**" and (abs(right) > _MAX_EXPONENT or abs(left) > _MAX_MAGNITUDE):
                raise ValueError("exponent too large")
            left = fn(left, right)
            if isinstance(left, complex):
                raise ValueError("complex result")
            if abs(left) > _MAX_MAGNITUDE:
                raise ValueError("result too large")
        return left

    def unary(self) -> int | float:
        if self.peek() in ("-", "+"):
            sign = -1 if self.take() == "-" else 1
            return sign * self.expression(_UNARY_PRECEDENCE)
        return self.atom()

    def atom(self) -> int | float:
        tok = self.take()
        if tok == "(":
            self.depth += 1
            if self.depth > _MAX_NESTING:
                raise ValueError("too deeply nested")
            value = self.expression()
            if self.take() != ")":
                raise ValueError("expected ')'")
            self.depth -= 1
            return value
        if tok[0].isdigit() or tok[0] == ".":
            return float(tok) if any(c in tok for c in ".eE") else int(tok)
        raise ValueError(f"unexpected {tok!r}")


def _evaluate(text: str) -> int | float:
    parser = _Parser(_tokens(text))
    value = parser.expression()
    if parser.peek() is not None:
        raise ValueError(f"unexpected {parser.peek()!r}")
    return value


def calculator(expression: str) -> str:
    """Evaluate ``expression`` (numbers, + - * / // % **, parentheses); an ``error: ...`` string when it cannot.

    A tokenizer and a precedence-climbing parser of its own (no ``ast``, no ``compile``): CPython
    3.11's AST constructor keeps its recursion depth in per-interpreter state, so ``ast.parse`` run
    from several threads at once can fail with ``SystemError: AST constructor recursion depth
    mismatch`` — the calculator runs in client worker threads."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > 200:
        return "error: expected a short arithmetic expression"
    try:
        value = _evaluate(expression.replace(",", "").replace("x", "*").strip())
    except (ValueError, ZeroDivisionError, OverflowError) as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def call_calculator(**arguments: Any) -> str:
    """The calculator as a framework's tool function: any keyword arguments, an ``error: ...``
    result (never an exception) when they are not ``expression=...`` — a model's malformed
    call is the model's mistake to see, as in :func:`run_calc_episode`."""
    return run_tool_call("calculator", arguments)[0]


def run_tool_call(name: str, arguments: str | dict[str, Any]) -> tuple[str, bool]:
    """(the tool's result text, whether the call was well formed)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator", False
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return "error: arguments are not JSON", False
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return "error: expected {\"expression\": \"...\"}", False
    result = calculator(args["expression"])
    return result, not result.startswith("error")


def parse_answer(text: str) -> str | None:
    """The number in the last ``<answer>N</answer>`` of ``text`` (commas dropped)."""
    found = _ANSWER_RE.findall(text or "")
    return found[-1].replace(",", "") if found else None


def grade(task: Task, final_text: str, valid_tool_calls: int, tool_calls: int = 0, turns: int = 0) -> Outcome:
    """The reward and metrics of an episode that ended with ``final_text``."""
    correct = parse_answer(final_text) == task.answer
    valid = valid_tool_calls > 0
    return Outcome(
        reward=float(correct) + (TOOL_CREDIT if valid else 0.0), completion=final_text,
        metrics={"correct": float(correct), "valid_tool_call": float(valid), "tool_calls": float(tool_calls),
                 "turns": float(turns)},
    )


def run_calc_episode(http: httpx.Client, base_url: str, api_key: str, task: Task, *, max_tokens: int = 48,
                     temperature: float = 1.0, max_turns: int = 3, seed: int | None = None) -> Outcome:
    """The agent loop over the raw OpenAI chat protocol (:func:`~swarmkit.tasks.base.run_tool_loop`), graded."""
    loop = run_tool_loop(http, base_url, api_key, task, tool=CALCULATOR_TOOL, run_tool=run_tool_call,
                         max_turns=max_turns, max_tokens=max_tokens, temperature=temperature, seed=seed)
    outcome = grade(task, loop.final, sum(ok for _, ok in loop.results), len(loop.results), loop.turns)
    outcome.messages = loop.messages
    return outcome


@functools.cache
def load_agent(spec: str) -> AgentFn:
    """The ``run_episode`` function named by ``task.options.agent``: ``path/to/file.py``
    (its ``run_episode``), ``path/to/file.py:func`` or ``package.module:func``."""
    target, _, name = spec.partition(":")
    name = name or "run_episode"
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise ValueError(f"task.options.agent: no file {target!r}")
        module_spec = importlib.util.spec_from_file_location(f"swarmkit_agent_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"task.options.agent: {spec!r} has no function {name!r}")
    return fn  # type: ignore[no-any-return]


def demonstration(task: Task) -> dict[str, Any]:
    """The ideal conversation of ``task`` (``messages`` + ``tools``) for ``POST .../demonstration``."""
    expression = str(task.meta["expression"])
    call = {"id": "call_demo", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})}}
    messages = [*task.messages,
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_demo", "content": calculator(expression)},
                {"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]
    return {"messages": messages, "tools": [CALCULATOR_TOOL]}
