"""The calc_agent calculator: right, bounded and deterministic when many threads call it at once.

It used ``ast.parse``, and CPython 3.11's AST constructor keeps its recursion depth in
per-interpreter state: two threads parsing at once could fail with ``SystemError: AST
constructor recursion depth mismatch`` (seen once in tests/test_frameworks.py, where agent
frameworks call the tool from worker threads). The calculator now parses by itself."""

from __future__ import annotations

import gc
import random
import re
import threading

import pytest

from swarmkit.tasks import calc_agent, multi_calc
from swarmkit.tasks.calc_agent import calculator


def _expression(rng: random.Random, depth: int = 0) -> str:
    if depth > 3 or rng.random() < 0.3:
        n = str(rng.randint(0, 9999))
        return f"-{n}" if rng.random() < 0.1 else n
    op = rng.choice(["+", "-", "*", "/", "//", "%", "+", "*"])
    text = f"{_expression(rng, depth + 1)} {op} {_expression(rng, depth + 1)}"
    return f"({text})" if rng.random() < 0.5 else text


def _reference(expression: str) -> str:
    try:
        value = eval(expression, {"__builtins__": {}})  # the test's oracle: Python itself, in this thread only
    except ZeroDivisionError as exc:
        return f"error: {exc}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


@pytest.mark.parametrize("module", [calc_agent, multi_calc], ids=["calc_agent", "multi_calc"])
def test_the_calculators_do_not_use_ast_or_compile(module):
    source = open(module.__file__).read()
    assert "import ast" not in source and not re.search(r"(?<!re\.)\bcompile\(|\beval\(", source)


@pytest.mark.parametrize("expression,expected", [
    ("347 * 86", "29842"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-2**2", "-4"), ("2 ** 3 ** 2", "512"),
    ("2**-1", "0.5"), ("7/2", "3.5"), ("7//2", "3"), ("-7 % 3", "2"), ("1,000 + 5", "1005"), ("3 x 4", "12"),
    ("-(3-5)*2", "4"), (".5+1.5", "2"), ("1e3*2", "2000"), ("1/0", "error: division by zero"),
])
def test_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize("expression", [
    "", "1+", "abc", "__import__('os')", "2**100", "10**40", "9" * 40 + "**9", "(" * 40 + "1" + ")" * 40,
    "1 2", "()", "2 +* 3", "1" * 201, "(1", "1)",
])
def test_rejected_with_an_error_string(expression):
    assert calculator(expression).startswith("error: ")


class _Cyclic:
    """Garbage that only the cycle collector frees, with a finalizer that runs Python code: a
    collection in the middle of a C routine lets another thread run there (how the race showed)."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        [i for i in range(2)]  # noqa: B018 - Python bytecode in a finalizer


def test_many_threads_at_once_agree_with_python():
    rng = random.Random(36)
    expressions = [_expression(rng) for _ in range(2000)]
    expressions += [" + ".join([f"({rng.randint(1, 99)} * {rng.randint(1, 99)} - 3)"] * 12) for _ in range(1000)]
    expressions = [e for e in expressions if len(e) <= 200]
    expected = [_reference(e) for e in expressions]
    results: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(16)

    def work(i: int) -> None:
        try:
            start.wait()
            order = list(range(len(expressions)))
            random.Random(i).shuffle(order)
            out = [""] * len(expressions)
            for j in order:
                _Cyclic()
                out[j] = calculator(expressions[j])
            results[i] = out
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    thresholds = gc.get_threshold()
    gc.set_threshold(50, 1, 1)  # frequent collections: finalizers run often, in every thread
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        gc.set_threshold(*thresholds)
    assert not errors, errors[:3]
    for out in results.values():
        mismatches = [(e, r, x) for e, r, x in zip(expressions, out, expected, strict=True) if r != x]
        assert not mismatches, mismatches[:5]
