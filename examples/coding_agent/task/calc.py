"""A one-function task for the coding-agent recipe: ``add`` has a bug that ``test_calc.py`` catches."""


def add(a: int, b: int) -> int:
    """The sum of ``a`` and ``b``."""
    return a - b
