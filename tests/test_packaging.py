"""Packaging: every package folder is listed in pyproject, so a non-editable install is complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    mapping = cfg["package-dir"]
    found = set()
    for name, folder in mapping.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_packaged_configs_are_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*/*.yaml" in cfg["swarmkit.conf"]


def _data_folders() -> set[str]:
    """The importable names of folders under a package that hold files but no __init__.py."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for name, folder in cfg["package-dir"].items():
        base = ROOT / folder
        for sub in base.rglob("*"):
            rel = sub.relative_to(base)
            if (not sub.is_dir() or (sub / "__init__.py").exists() or "__pycache__" in rel.parts
                    or not all(p.isidentifier() for p in rel.parts) or not any(sub.rglob("*.*"))):
                continue
            found.add(".".join([name, *rel.parts]))
    return found


def test_data_folders_are_listed_as_packages():
    """setuptools warns about a folder Python can import but `packages` does not name (issue 36:
    five such warnings on every install), and may leave its files out of a future wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {"swarmkit.conf.model", "swarmkit.server.dashboard.static"} <= _data_folders()
    assert _data_folders() <= listed, f"add to [tool.setuptools] packages: {sorted(_data_folders() - listed)}"


def test_building_a_wheel_prints_no_setuptools_warning(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".pp", ".cache", "runs", "outputs", "build", "dist", "*.egg-info", "__pycache__",
        ".pytest_cache", ".mypy_cache", ".ruff_cache", "node_modules"))
    out = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta as b; b.build_wheel({str(tmp_path / 'dist')!r})"],
        cwd=src, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    log = out.stdout + out.stderr
    assert "absent from the `packages` configuration" not in log
    assert "Warning" not in log, [line for line in log.splitlines() if "Warning" in line][:5]
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist()
    for data in ["swarmkit/conf/config.yaml", "swarmkit/conf/model/tiny.yaml", "swarmkit/server/dashboard/static/app.js",
                 "swarmkit/skills/write-swarm-client/SKILL.md", "swarmkit/apps/templates/new_task/task.py.tmpl"]:
        assert data in names, data
