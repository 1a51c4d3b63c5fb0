"""``python -m swarmkit new-task NAME``: write a swarm client package that trains out of the box.

The package (``NAME/``): ``task.py`` (mock items, the reward, a train / eval
split), ``agent.py`` (an ``openai`` SDK agent with a tool, run against an
episode's ``base_url`` / ``api_key``), ``client.py`` (configures the server,
evaluates, trains, evaluates again) and ``README.md`` (the run commands). The
templates are ``swarmkit/apps/templates/new_task/*.tmpl``; ``__NAME__`` in them
becomes the package name. ``tests/test_new_task.py`` trains a generated
package on the tiny model.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FILES", "TEMPLATES", "NewTaskError", "main", "render", "write_task"]

TEMPLATES = Path(__file__).resolve().parent / "templates" / "new_task"
#: the files of a generated package, each from ``<file>.tmpl``
FILES = ("__init__.py", "task.py", "agent.py", "client.py", "README.md")

_EPILOG = """\
NAME/ then holds:
  task.py     mock items (train and held-out eval split) and the reward: replace them with yours
  agent.py    an openai SDK tool loop (function calling) against the episode's base_url / api_key
  client.py   configures an OFFLINE server (the tiny model by default), evaluates, trains, evaluates
  README.md   the run commands

Run it from DIR:
  export SWARMKIT_ADMIN_TOKEN=$(python -c "import secrets; print(secrets.token_urlsafe(24))")
  python -m swarmkit mode=server server.port=8000 server.run_dir=runs/NAME > server.log 2>&1 &
  python -m NAME.client --url http://127.0.0.1:8000 --steps 20 --summary summary.json

The skill 'write-swarm-client' (python -m swarmkit skills show write-swarm-client) walks a coding
agent through adapting it."""


class NewTaskError(ValueError):
    """A name that cannot be a package, or a folder that already exists."""


def check_name(name: str, importable: bool = True) -> None:
    """Raise :class:`NewTaskError` unless ``name`` can be a package name (and, with ``importable``,
    is not the name of a module Python would import instead)."""
    if not name.isidentifier() or not name.isascii():
        raise NewTaskError(f"{name!r} is not a valid Python package name (letters, digits and _, "
                           "not starting with a digit), e.g. my_game")
    if keyword.iskeyword(name):
        raise NewTaskError(f"{name!r} is a Python keyword; pick another name")
    if not importable:
        return
    if name in sys.stdlib_module_names or name == "swarmkit" or importlib.util.find_spec(name) is not None:
        raise NewTaskError(f"a module named {name!r} is already importable here (python -m {name}.client "
                           "would be ambiguous); pick another name")


def render(template: str, name: str) -> str:
    """A template's text with ``__NAME__`` replaced by ``name``."""
    return template.replace("__NAME__", name)


def write_task(name: str, parent: Path | str = ".") -> Path:
    """Write the package ``parent/name/``; returns its folder. Never overwrites."""
    check_name(name, importable=False)
    target = Path(parent) / name
    if target.exists():
        raise NewTaskError(f"{target} already exists; pick another name or --dir")
    check_name(name)
    target.mkdir(parents=True)
    for file in FILES:
        text = (TEMPLATES / f"{file}.tmpl").read_text(encoding="utf-8")
        (target / file).write_text(render(text, name), encoding="utf-8")
    return target


def main(args: Sequence[str]) -> int:
    """Run ``python -m swarmkit new-task ARGS``; the exit status."""
    p = argparse.ArgumentParser(
        prog="python -m swarmkit new-task", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write a swarm client package NAME/ (task with mock data and reward, an openai SDK agent "
                    "with a tool, the client loop, a README) that trains on the tiny model as it is.",
        epilog=_EPILOG)
    p.add_argument("name", metavar="NAME", help="the package name (a Python identifier, e.g. my_game)")
    p.add_argument("--dir", default=".", metavar="DIR", help="where NAME/ is written (default: .)")
    ns = p.parse_args(list(args))
    try:
        target = write_task(ns.name, ns.dir)
    except (NewTaskError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {target}/ ({', '.join(FILES)})")
    print(f"next: read {target / 'README.md'}; run the client from {Path(ns.dir)}/ with python -m {ns.name}.client")
    return 0
