"""``python -m swarmkit skills``: list, show and copy the skills shipped for coding agents."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from swarmkit.skills import DEFAULT_DEST, SkillError, copy_skills, get_skill, list_skills

_EPILOG = f"""\
commands:
  list (the default)      the skills: name and what each is for
  show NAME               print a skill (its SKILL.md)
  copy [NAME ...]         copy skills (default: all) into DIR/<name>/SKILL.md
                          (default DIR: {DEFAULT_DEST}/, where Claude Code looks; refuses to
                          overwrite without --force)
  path NAME               print the path of a skill's SKILL.md in the installed package

The skills are tested: tests/test_skills.py runs every command and code block in them against a
tiny-model server. docs/skills.md says how a coding agent uses them."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarmkit skills", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The skills swarmkit ships for coding agents (SKILL.md files with a name and a "
                    "description in their front matter).", epilog=_EPILOG)
    p.add_argument("command", nargs="?", choices=["list", "show", "copy", "path"], default="list",
                   help="what to do (default: list)")
    p.add_argument("names", nargs="*", metavar="NAME", help="skill names (show, path: one; copy: any)")
    p.add_argument("--to", default=str(DEFAULT_DEST), metavar="DIR",
                   help=f"copy: the folder that receives <name>/SKILL.md (default {DEFAULT_DEST})")
    p.add_argument("--force", action="store_true", help="copy: overwrite existing files")
    return p


def main(args: Sequence[str]) -> int:
    """Run ``python -m swarmkit skills ARGS``; the exit status."""
    parser = _parser()
    ns = parser.parse_args(list(args))
    try:
        if ns.command == "list":
            if ns.names:
                parser.error("list takes no NAME")
            skills = list_skills()
            width = max(len(s.name) for s in skills)
            for s in skills:
                print(f"{s.name:<{width}}  {s.description}")
            return 0
        if ns.command in ("show", "path"):
            if len(ns.names) != 1:
                parser.error(f"{ns.command} takes one NAME")
            skill = get_skill(ns.names[0])
            print(skill.text if ns.command == "show" else skill.path, end="" if ns.command == "show" else "\n")
            return 0
        written = copy_skills(ns.names, Path(ns.to), force=ns.force)
        for path in written:
            print(f"wrote {path}")
        return 0
    except SkillError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
