"""The one atomic write (swarmkit.runfiles) and the process helpers (swarmkit.procs).

A reader sees the old file or the new one, never half of one; a failure mid-write
leaves the old file and no temporary file behind.
"""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys

import pytest

from swarmkit.procs import die_with_parent, free_port, is_loopback, port_free
from swarmkit.runfiles import replacing, staged_dir, write_bytes, write_json, write_text


def test_writes_replace_the_file_and_leave_nothing_beside(tmp_path):
    path = tmp_path / "sub" / "state.json"  # the folder is created
    write_json(path, {"a": 1})
    write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    write_text(tmp_path / "t.txt", "héllo")
    assert (tmp_path / "t.txt").read_text(encoding="utf-8") == "héllo"
    write_bytes(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["b.bin", "state.json", "sub", "t.txt"]


def test_a_failure_mid_write_leaves_the_old_file_and_no_temporary_file(tmp_path):
    path = tmp_path / "state.json"
    write_json(path, {"old": True})
    with pytest.raises(RuntimeError, match="disk full"), replacing(path) as tmp, open(tmp, "w") as f:
        f.write('{"new": ')  # half written, then the writer fails
        raise RuntimeError("disk full")
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    # a value JSON cannot hold fails before anything is written
    with pytest.raises(ValueError):
        write_json(path, {"x": float("nan")}, allow_nan=False)
    with pytest.raises(TypeError):
        write_json(path, {"x": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    write_json(path, {"x": object()}, default=lambda o: "obj")
    assert json.loads(path.read_text()) == {"x": "obj"}


def test_a_secret_is_never_readable_by_others(tmp_path):
    path = tmp_path / "key"
    seen: list[int] = []
    with replacing(path, mode=0o600) as tmp:
        seen.append(stat.S_IMODE(tmp.stat().st_mode))  # already private before a byte is written
        tmp.write_text("secret")
    assert seen == [0o600]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "secret"


def test_a_reader_sees_the_old_file_until_the_rename(tmp_path):
    path = tmp_path / "f"
    write_text(path, "old")
    with replacing(path) as tmp:
        tmp.write_text("new")
        assert path.read_text() == "old"
    assert path.read_text() == "new"


def test_staged_dir_racing_builders_keep_the_first(tmp_path):
    target = tmp_path / "model"
    with staged_dir(target) as tmp:
        (tmp / "config.json").write_text("first")
        with staged_dir(target) as other:  # a second builder finishes first
            (other / "config.json").write_text("second")
    assert (target / "config.json").read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    with pytest.raises(RuntimeError), staged_dir(tmp_path / "broken") as tmp:
        (tmp / "half").write_text("x")
        raise RuntimeError("build failed")
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_staged_dir_replace_clears_a_stale_stage_and_replaces_the_target(tmp_path):
    target = tmp_path / "step_1"
    (tmp_path / "step_1.tmp").mkdir()  # left by a killed save
    (tmp_path / "step_1.tmp" / "junk").write_text("x")
    target.mkdir()
    (target / "old").write_text("x")
    with staged_dir(target, replace=True) as tmp:
        assert tmp.name == "step_1.tmp" and not any(tmp.iterdir())
        (tmp / "new").write_text("y")
        assert (target / "old").exists()
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_process_helpers():
    assert is_loopback("localhost") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("10.0.0.1") and not is_loopback("example.com")
    port = free_port()
    assert port_free("127.0.0.1", port)
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert not port_free("127.0.0.1", port)


def test_die_with_parent_runs_in_a_child():
    r = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True,
                       preexec_fn=die_with_parent, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok"
