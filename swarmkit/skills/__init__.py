"""Skills for coding agents, shipped in the package: ``swarmkit/skills/<name>/SKILL.md``.

A skill is one Markdown file with a front matter (``name``, ``description``)
that tells a coding agent how to do one job with swarmkit (write a swarm
client, train a black-box agent, configure the server, run a research
campaign). Every command and code block in them is run by
``tests/test_skills.py`` against a tiny-model server. ``python -m swarmkit
skills`` lists, shows and copies them (:mod:`swarmkit.apps.skills`).

Pure Python (layer 0): files only, nothing else of swarmkit.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_DEST", "SKILLS_DIR", "Skill", "SkillError", "copy_skills", "get_skill", "list_skills",
           "parse_front_matter"]

#: where the SKILL.md files live (one folder per skill)
SKILLS_DIR = Path(__file__).resolve().parent
#: where ``copy_skills`` puts them by default, relative to the project: the folder Claude Code reads
DEFAULT_DEST = Path(".claude") / "skills"

_FRONT = re.compile(r"\A---\n(.*?)\n---\n", re.S)


class SkillError(ValueError):
    """An unknown skill, a malformed SKILL.md, or a copy that would overwrite."""


@dataclass(frozen=True)
class Skill:
    """One shipped skill: its folder name, front matter and file."""

    name: str
    description: str
    path: Path

    @property
    def text(self) -> str:
        """The whole SKILL.md (front matter included)."""
        return self.path.read_text(encoding="utf-8")

    @property
    def body(self) -> str:
        """The SKILL.md without its front matter."""
        return _FRONT.sub("", self.text, count=1)


def parse_front_matter(text: str) -> dict[str, str]:
    """The ``key: value`` lines between the leading ``---`` lines (values unquoted; no nesting)."""
    m = _FRONT.match(text)
    if m is None:
        raise SkillError("no front matter (a '---' block with name and description) at the top")
    out: dict[str, str] = {}
    for line in m.group(1).splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition(":")
        if not sep:
            raise SkillError(f"front matter line without 'key: value': {line!r}")
        out[key.strip()] = value.strip().strip("\"'")
    return out


def _load(folder: Path) -> Skill:
    path = folder / "SKILL.md"
    meta = parse_front_matter(path.read_text(encoding="utf-8"))
    missing = [k for k in ("name", "description") if not meta.get(k)]
    if missing:
        raise SkillError(f"{path}: front matter lacks {', '.join(missing)}")
    if meta["name"] != folder.name:
        raise SkillError(f"{path}: name {meta['name']!r} differs from its folder {folder.name!r}")
    return Skill(meta["name"], meta["description"], path)


def list_skills() -> list[Skill]:
    """Every shipped skill, by name."""
    return [_load(p.parent) for p in sorted(SKILLS_DIR.glob("*/SKILL.md"))]


def get_skill(name: str) -> Skill:
    """The skill ``name``; :class:`SkillError` naming the shipped ones when there is none."""
    folder = SKILLS_DIR / name
    if "/" in name or name.startswith(".") or not (folder / "SKILL.md").is_file():
        names = ", ".join(s.name for s in list_skills())
        raise SkillError(f"no skill {name!r}; the skills are: {names}")
    return _load(folder)


def copy_skills(names: list[str] | None, dest: Path | str = DEFAULT_DEST, *, force: bool = False) -> list[Path]:
    """Copy skills (all when ``names`` is empty) into ``dest/<name>/SKILL.md``; the files written.

    Nothing is written when any target exists and ``force`` is false (:class:`SkillError` names them).
    """
    skills = [get_skill(n) for n in names] if names else list_skills()
    targets = [(s, Path(dest) / s.name / "SKILL.md") for s in skills]
    existing = [str(t) for _, t in targets if t.exists()]
    if existing and not force:
        raise SkillError(f"{', '.join(existing)} already exist(s); pass --force to overwrite")
    for skill, target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(skill.path, target)
    return [t for _, t in targets]
