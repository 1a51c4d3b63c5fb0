"""``multi_calc``: word problems that need two or three chained calculator calls (multi-turn, client side).

Each problem chains two or three operations on numbers too large for a 135M
model to handle in its head ("A warehouse stores 347 crates with 86 bottles in
each crate. 2519 bottles are shipped out. How many bottles are left?":
``347 * 86 = 29842``, then ``29842 - 2519``). The ``calculator`` tool of this
task evaluates **one operation per call** (``a op b`` with two numbers:
:func:`one_step_calculator`), so an agent must call it once per step, feeding
each result into the next call: a right answer through the tool takes
``steps`` calls (2 or 3, ``task.options.min_steps`` / ``max_steps``), over up to
``max_turns`` chat calls (default ``steps + 2``). The agent ends with
``<answer>N</answer>``.

Reward (:func:`grade`), ordered so that doing nothing never scores above an
honest attempt (docs/agents.md, "Designing the reward for GRPO"):

- 1.0 for the right final answer;
- ``STEP_CREDIT`` (0.15) × the share of the chain's intermediate values
  (including the final one) that a well-formed call produced: partial credit
  for progress, whatever the final reply;
- ``TOOL_CREDIT`` (0.05) when the episode made at least one well-formed call.

Shaping sums to at most 0.2, under the 1.0 gap between a right and a wrong
answer; nothing is ever negative, so no reply (or a malformed call) scores 0,
the bottom of the scale, and any well-formed attempt scores above it. The
order: right through the whole chain (1.2) > right by any route (≥ 1.0) >
whole chain computed but answered wrong (0.2) > part of the chain (> 0.05) >
a well-formed call off the chain (0.05) > nothing or a malformed call (0).
Metrics per episode: ``correct``, ``valid_tool_call``, ``chain`` (the share of
steps reached), ``tool_calls``, ``turns``, and the episode's :func:`outcome` as
``outcome/<kind>`` = 1.0 (one of :data:`OUTCOMES`: the server's per-step
``task/outcome/<kind>`` are the shares of the step's rollouts that ended so).

:func:`demonstration` writes the ideal conversation (one call per step, each
result fed into the next, the answer) for the supervised warm start.
``task.options.step_notes=true`` asks the agent (system prompt) and shows it
(demonstrations) to write ``Step k of n.`` before each call, so the count it
must keep is text in its context. Needs only httpx.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import httpx

from swarmkit.tasks.base import Outcome, Task, run_tool_loop
from swarmkit.tasks.calc_agent import calculator, parse_answer

__all__ = ["CALCULATOR_TOOL", "OUTCOMES", "STEP_CREDIT", "SYSTEM_PROMPT", "TOOL_CREDIT", "demonstration", "grade",
           "make_multi_tasks", "one_step_calculator", "outcome", "run_multi_episode", "run_tool_call"]

TOOL_CREDIT = 0.05
STEP_CREDIT = 0.15

SYSTEM_PROMPT = ("The calculator does one operation per call (a op b). Call it once per step, "
                 "use each result in the next call, then reply <answer>N</answer>.")
#: appended to the system prompt with ``task.options.step_notes``
STEP_NOTES_PROMPT = " Before each call, write which step it is: Step k of n."

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate ONE operation on two numbers, e.g. 347 * 86",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}

#: (operations, story); the operands are a, b, c (and d) in order, the chain is ((a op1 b) op2 c) op3 d
_STORIES: list[tuple[str, str]] = [
    ("*-", "A warehouse stores {a} crates with {b} bottles in each crate. {c} bottles are shipped out. "
           "How many bottles are left?"),
    ("*+", "A school orders {a} boxes with {b} pencils in each box, and {c} loose pencils. "
           "How many pencils is that?"),
    ("*-", "A farm has {a} rows of {b} apple trees. {c} trees are cut down. How many trees remain?"),
    ("+*", "A shop sells {a} shirts on Monday and {b} on Tuesday, at {c} dollars each. "
           "How many dollars does it earn?"),
    ("-*", "A stadium has {a} seats and {b} are broken. Each working seat is sold for {c} dollars. "
           "How many dollars is that?"),
    ("*-+", "A bakery bakes {a} trays of {b} rolls. It sells {c} rolls and then bakes {d} more. "
            "How many rolls does it have?"),
    ("*+-", "A library has {a} shelves of {b} books. It receives {c} books and lends out {d}. "
            "How many books are on its shelves?"),
    ("+*-", "A train carries {a} passengers in the morning and {b} in the evening, every day for {c} days. "
            "{d} tickets were refunded. How many tickets were kept?"),
]
_NUM = r"[-+]?\s*(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
#: one operation on two (optionally signed) numbers: ``a op b``
_ONE_STEP_RE = re.compile(rf"\s*{_NUM}\s*(?://|[-+*/%])\s*{_NUM}\s*")
_NUMBER_RE = re.compile(r"\d")
_BAD_CHAR_RE = re.compile(r"[^\d\s.eE+\-*/%()]")
_OPS = {"+": lambda x, y: x + y, "-": lambda x, y: x - y, "*": lambda x, y: x * y}


def _operand(rng: random.Random, op: str, running: int) -> int:
    """The right operand of ``running op x``: every intermediate value stays positive and large."""
    if op == "*":
        return rng.randint(11, 99)
    if op == "-":
        return rng.randint(max(1, running // 10), max(2, running // 2))
    return rng.randint(1000, 9999)


def make_multi_tasks(n: int, seed: int, split: str, options: dict[str, Any]) -> list[Task]:
    """``n`` problems of ``split`` (train, eval and demo items draw from disjoint seeds)."""
    rng = random.Random(f"multi-{split}-{seed}")
    step_notes = bool(options.get("step_notes", False))
    system = str(options.get("system", SYSTEM_PROMPT + (STEP_NOTES_PROMPT if step_notes else "")))
    lo, hi = int(options.get("min_steps", 2)), int(options.get("max_steps", 3))
    stories = [s for s in _STORIES if lo <= len(s[0]) <= hi]
    if not stories:
        raise ValueError(f"multi_calc: no story with {lo}..{hi} steps (the stories have 2 or 3)")
    tasks = []
    for i in range(n):
        ops, story = stories[rng.randrange(len(stories))]
        running = rng.randint(101, 999) if ops[0] == "*" else rng.randint(1000, 9999)
        numbers, steps = [running], []
        for op in ops:
            x = _operand(rng, op, running)
            steps.append(f"{running} {op} {x}")
            numbers.append(x)
            running = _OPS[op](running, x)
        names = dict(zip("abcd", numbers, strict=False))
        values = [int(calculator(s)) for s in steps]
        tasks.append(Task(
            task_id=f"multi-{split}-{i}",
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": story.format(**names)}],
            answer=str(running), family="multi_calc",
            meta={"steps": steps, "values": values, "group": f"{len(steps)} steps", "step_notes": step_notes,
                  "max_turns": int(options.get("max_turns", len(steps) + 2))},
        ))
    return tasks


def one_step_calculator(expression: str) -> str:
    """Evaluate ``a op b`` (two numbers, one of + - * / // %); an ``error: ...`` string for anything else,
    a longer expression included (this task's tool does one step per call). A pattern match, then
    :func:`~swarmkit.tasks.calc_agent.calculator`: no ``ast``, so it is safe from any thread."""
    if not isinstance(expression, str) or not expression.strip() or len(expression) > 60:
        return "error: expected one operation on two numbers, e.g. 347 * 86"
    text = expression.replace(",", "").replace("x", "*").strip()
    if not _ONE_STEP_RE.fullmatch(text):
        if not _NUMBER_RE.search(text) or _BAD_CHAR_RE.search(text):
            return "error: expected one operation on two numbers, e.g. 347 * 86"
        return "error: one operation per call (a op b); call again for the next step"
    return calculator(text)


def run_tool_call(name: str, arguments: str | dict[str, Any]) -> tuple[str, bool]:
    """(the tool's result text, whether the call was well formed: a JSON ``expression`` it evaluated)."""
    if name != "calculator":
        return f"error: unknown tool {name!r}; the only tool is calculator", False
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return "error: arguments are not JSON", False
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return "error: expected {\"expression\": \"...\"}", False
    result = one_step_calculator(args["expression"])
    return result, not result.startswith("error")


#: how an episode ended, in the order :func:`outcome` tests them
OUTCOMES = ("right", "overshoot", "chain_wrong", "stopped_early", "partial", "off_chain", "malformed", "no_call")


def outcome(correct: bool, values: list[str], results: list[str], tool_calls: int) -> str:
    """How an episode ended: ``right`` (the right answer); ``overshoot`` (the whole chain computed, then
    another well-formed call after its last value, e.g. ``6769 * 4913``); ``chain_wrong`` (the whole chain,
    then a wrong answer); ``stopped_early`` (the chain's first steps in order, every call on it, then no
    more calls: one call too few, overshoot's mirror); ``partial`` (part of the chain: a wrong operand or
    operator on the way);
    ``off_chain`` (well-formed calls, none on the chain); ``malformed`` (calls, none well-formed);
    ``no_call``. ``values`` are the chain's intermediate values, ``results`` the well-formed calls'
    results in order."""
    if correct:
        return "right"
    if results and all(v in results for v in values):
        return "overshoot" if len(results) > results.index(values[-1]) + 1 else "chain_wrong"
    if results and results == values[:len(results)]:
        return "stopped_early"
    if any(v in results for v in values):
        return "partial"
    if results:
        return "off_chain"
    return "malformed" if tool_calls > 0 else "no_call"


def grade(task: Task, final_text: str, results: list[str], tool_calls: int = 0, turns: int = 0) -> Outcome:
    """The reward and metrics of an episode that ended with ``final_text``, whose well-formed calls returned
    ``results`` (their result texts, in order)."""
    correct = parse_answer(final_text) == task.answer
    values = [str(v) for v in task.meta["values"]]
    reached = sum(v in results for v in values) / len(values)
    valid = bool(results)
    reward = float(correct) + STEP_CREDIT * reached + (TOOL_CREDIT if valid else 0.0)
    kind = outcome(correct, values, results, max(tool_calls, len(results)))
    return Outcome(
        reward=reward, completion=final_text,
        metrics={"correct": float(correct), "valid_tool_call": float(valid), "chain": reached,
                 "tool_calls": float(tool_calls), "turns": float(turns),
                 **{f"outcome/{k}": float(k == kind) for k in OUTCOMES}},
    )


def run_multi_episode(http: httpx.Client, base_url: str, api_key: str, task: Task, *, max_tokens: int = 48,
                      temperature: float = 1.0, max_turns: int | None = None, seed: int | None = None) -> Outcome:
    """The agent loop over the raw OpenAI chat protocol (:func:`~swarmkit.tasks.base.run_tool_loop`), graded."""
    loop = run_tool_loop(http, base_url, api_key, task, tool=CALCULATOR_TOOL, run_tool=run_tool_call,
                         max_turns=max_turns or int(task.meta.get("max_turns", 4)), max_tokens=max_tokens,
                         temperature=temperature, seed=seed)
    outcome = grade(task, loop.final, [r for r, ok in loop.results if ok], len(loop.results), loop.turns)
    outcome.messages = loop.messages
    return outcome


def demonstration(task: Task) -> dict[str, Any]:
    """The ideal conversation of ``task`` (``messages`` + ``tools``) for ``POST .../demonstration``:
    one call per step, each result used by the next, then the answer. With ``step_notes`` (the task option)
    each call comes after a ``Step k of n.`` note: the count the agent must keep becomes text it can read."""
    messages = list(task.messages)
    steps = task.meta["steps"]
    for k, step in enumerate(steps):
        call_id = f"call_demo_{k}"
        call = {"id": call_id, "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": step})}}
        note = f"Step {k + 1} of {len(steps)}." if task.meta.get("step_notes") else None
        messages += [{"role": "assistant", "content": note, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call_id, "content": one_step_calculator(step)}]
    messages.append({"role": "assistant", "content": f"<answer>{task.answer}</answer>"})
    return {"messages": messages, "tools": [CALCULATOR_TOOL]}
