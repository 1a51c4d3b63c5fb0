"""The light install: ``pip install swarmkit`` is the client SDK (httpx only).

- the installed metadata: nothing heavy outside an extra; the ``server``
  extra holds it, ``test`` pulls ``server`` and ``dev`` pulls ``test``;
- a child process in which every heavy module is blocked (a
  ``sitecustomize`` meta-path finder refuses them, as if they were not
  installed) imports ``swarmkit.client`` and runs episodes against a real
  server with the tiny model started by this process;
- ``python -m swarmkit`` in such a process exits with a message naming the
  extra instead of an ImportError traceback.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "light-client-test-admin-token"
#: what a laptop running agents does not have (the server extra and what it pulls in)
HEAVY = ("torch", "transformers", "tokenizers", "numpy", "starlette", "uvicorn", "hydra", "omegaconf", "pluggy",
         "peft", "safetensors", "rich", "gguf")
HEAVY_DISTS = {"torch", "transformers", "peft", "safetensors", "starlette", "uvicorn", "hydra-core", "omegaconf",
               "pluggy", "rich", "gguf", "numpy"}
EXTRA_HINT = "pip install 'swarmkit[server]'"

BLOCKER = f"""
import sys

BLOCKED = {set(HEAVY)!r}


class _LightInstall:
    \"\"\"Refuse the heavy modules, as if only swarmkit and httpx were installed.\"\"\"

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the light-install test)", name=name)
        return None


sys.meta_path.insert(0, _LightInstall())
"""


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0].lower()


def _extra(req: str) -> str | None:
    m = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
    return m.group(1) if m else None


@pytest.fixture()
def light_env(tmp_path):
    """Environment of a child process in which the heavy modules cannot be imported."""
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p),
               HF_HUB_OFFLINE="1")
    env.pop("SWARMKIT_ADMIN_TOKEN", None)
    return env


# ---------------------------------------------------------------------- (a) metadata
def test_the_base_install_requires_only_httpx():
    reqs = importlib.metadata.requires("swarmkit") or []
    hint = "stale metadata? reinstall: pip install --no-deps -e ."
    base = sorted({_name(r) for r in reqs if _extra(r) is None})
    assert base == ["httpx"], f"base requirements {base}; {hint}"
    heavy_outside = [r for r in reqs if _name(r) in HEAVY_DISTS and _extra(r) is None]
    assert not heavy_outside, hint
    server = {_name(r) for r in reqs if _extra(r) == "server"}
    assert {"torch", "transformers", "starlette", "uvicorn", "hydra-core", "omegaconf", "pluggy"} <= server, hint
    test = [r for r in reqs if _extra(r) == "test"]
    assert any(_name(r) == "swarmkit" and "server" in r.split(";")[0] for r in test), \
        f"test must pull swarmkit[server]; {hint}"
    dev = [r for r in reqs if _extra(r) == "dev"]
    assert any(_name(r) == "swarmkit" and "test" in r.split(";")[0] for r in dev), \
        f"dev must pull swarmkit[test] (README's install is .[dev]); {hint}"
    assert {_name(r) for r in reqs if _extra(r) == "client"} == {"httpx"}


def test_pyproject_matches_the_installed_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [_name(r) for r in project["dependencies"]] == ["httpx"]
    extras = project["optional-dependencies"]
    for heavy in ("vllm", "deepspeed", "sglang"):
        assert "swarmkit[server]" in extras[heavy], f"extra {heavy!r} is a server plugin: it needs swarmkit[server]"
    installed = {_name(r) for r in importlib.metadata.requires("swarmkit") or [] if _extra(r) == "server"}
    assert installed == {_name(r) for r in extras["server"]}, "reinstall: pip install --no-deps -e ."


# ---------------------------------------------------------------------- (b) a client with heavy imports blocked
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("torch")
    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    cfg = validate_config(compose(["model=tiny", "backend=hf", "backend.device=cpu", "backend.batch_wait_s=0.01"]),
                          get_registry())
    h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path_factory.mktemp("light-run"))}},
                            config=cfg, train=False)
    with SwarmClient(h.url, token=TOKEN) as c:
        c.start()
        c.wait_for_state("ROLLING", timeout=60)
    yield h
    h.stop()


CHILD = textwrap.dedent("""
    import asyncio, json, sys

    for heavy in ("torch", "numpy", "starlette", "omegaconf"):
        try:
            __import__(heavy)
        except ModuleNotFoundError:
            pass
        else:
            sys.exit(f"the blocker let {heavy} through")

    import httpx

    from swarmkit.client import AsyncSwarmClient, SwarmClient
    from swarmkit.client.judge import Judge  # the judge helper is part of the light install

    url = sys.argv[1]
    chat = {"model": "swarm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    out = {}
    with SwarmClient(url, retry_for=10) as client:
        out["health"] = client.health()["state"]
        with client.episode(task_id="light") as ep:
            r = httpx.post(ep.base_url + "/chat/completions", json=chat,
                           headers={"Authorization": "Bearer " + ep.api_key}, timeout=30)
            r.raise_for_status()
            out["tokens"] = r.json()["usage"]["completion_tokens"]
            out["sync"] = ep.report(1.0)
        out["timeline_tokens"] = len(ep.timelines()[0]["blocks"][-1]["token_ids"])

        from swarmkit.envs import run_env_episode  # the environment loop is light too

        class OneTurn:
            def reset(self, *, seed=None, options=None):
                return "hi", {}

            def step(self, action):
                return "", 1.0, True, False, {}

        out["env"] = run_env_episode(client, OneTurn(), task_id="light-env", sampling={"max_tokens": 4}).report

    async def run_async():
        async with AsyncSwarmClient(url, retry_for=10) as client:
            async with client.episode(task_id="light-async") as ep:
                async with httpx.AsyncClient(timeout=30) as http:
                    r = await http.post(ep.base_url + "/chat/completions", json=chat,
                                        headers={"Authorization": "Bearer " + ep.api_key})
                    r.raise_for_status()
                return await ep.report(0.5)

    out["async"] = asyncio.run(run_async())
    out["judge"] = Judge(url + "/v1").stats["calls"]
    out["loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "swarmkit")
    print(json.dumps(out))
""")


def test_a_client_without_the_heavy_packages_runs_episodes(server, light_env):
    r = subprocess.run([sys.executable, "-c", CHILD, server.url], env=light_env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["health"] == "ROLLING"
    assert out["sync"]["accepted"] is True and out["sync"]["reward"] == 1.0
    assert out["tokens"] >= 1 and out["timeline_tokens"] == out["tokens"]
    assert out["env"]["accepted"] is True and out["env"]["reward"] == 1.0
    assert out["async"]["accepted"] is True and out["async"]["reward"] == 0.5
    # besides its own packages (the SDK, the environment loop), only pure standard-library core modules
    # (swarmkit.runfiles: the client key file)
    loaded = [m for m in out["loaded"] if not m.startswith(("swarmkit.client", "swarmkit.envs"))
              and m not in ("swarmkit", "swarmkit.runfiles")]
    assert not loaded, f"the client loaded server-side modules: {loaded}"
    # the parent's server has both episodes, finished with their rewards
    for res in (out["sync"], out["async"]):
        ep = server.swarm.episodes.get(res["episode_id"])
        assert ep.status == "finished" and ep.reward == res["reward"] and ep.task_id.startswith("light")


# ---------------------------------------------------------------------- (c) the server side says which extra
@pytest.mark.parametrize("argv", [["-m", "swarmkit"], ["-m", "swarmkit", "mode=plan"], ["-m", "swarmkit.plugins"]])
def test_the_command_line_names_the_server_extra(light_env, argv):
    r = subprocess.run([sys.executable, *argv], env=light_env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert EXTRA_HINT in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_the_swarmkit_script_names_the_server_extra(light_env):
    script = Path(sys.executable).parent / "swarmkit"
    if not script.exists():
        pytest.skip("no swarmkit console script next to this interpreter")
    r = subprocess.run([str(script), "mode=plan"], env=light_env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and EXTRA_HINT in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---------------------------------------------------------------------- (d) issue 36: what the light install runs
def test_help_on_the_light_install_lists_the_modes_commands_and_extras(light_env):
    r = subprocess.run([sys.executable, "-m", "swarmkit", "--help"], env=light_env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("mode=server", "mode=client", "mode=plan", "status [RUN_DIR]", "monitor RUN_DIR", "skills",
                 "new-task", "research", "join", EXTRA_HINT, "swarmkit[research]", "the base install"):
        assert line in r.stdout, (line, r.stdout)


def test_every_command_is_in_the_help():
    from swarmkit.apps.cli import SUBCOMMANDS
    from swarmkit.apps.usage import USAGE

    assert all(f"\n  {name} " in USAGE for name in SUBCOMMANDS), USAGE


def test_status_of_a_run_folder_on_the_light_install(server, light_env, tmp_path):
    """``python -m swarmkit status RUN_DIR`` as README writes it: the URL from RUN_DIR/server.json, the token
    from RUN_DIR/admin_token (it needed --token or $SWARMKIT_ADMIN_TOKEN, and the server on port 8000)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "server.json").write_text(json.dumps({"url": server.url}))
    (run_dir / "admin_token").write_text(TOKEN + "\n")
    status = [sys.executable, "-m", "swarmkit", "status"]
    r = subprocess.run([*status, str(run_dir)], env=light_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ROLLING"), r.stdout + r.stderr
    r = subprocess.run([*status, "--url", server.url, "--token-file", str(run_dir / "admin_token"), "--json"],
                       env=light_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "ROLLING", r.stdout + r.stderr
    r = subprocess.run([*status, "--token", str(run_dir / "admin_token")], env=light_env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--token takes the token itself" in r.stderr, r.stderr
    r = subprocess.run(status, env=light_env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "status RUN_DIR" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_the_monitor_and_a_server_do_not_share_a_default_port():
    from swarmkit.apps.monitor import MONITOR_PORT, SERVER_PORT
    from swarmkit.config.schema import ServerConfig

    assert SERVER_PORT == ServerConfig().port and MONITOR_PORT != SERVER_PORT
    docs = (ROOT / "README.md").read_text() + (ROOT / "docs" / "dashboard.md").read_text()
    assert "8765" not in docs and f":{MONITOR_PORT}/dashboard" in docs


def test_status_of_a_server_that_is_gone_is_one_error_line(tmp_path, capsys):
    """A run folder whose server stopped, a wrong --url: one ``error:`` line (it was a ServerUnavailable
    traceback: status caught swarmkit's own errors, not the SDK's), exit 1."""
    import socket

    from swarmkit.apps.monitor import status_main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "server.json").write_text(json.dumps({"url": f"http://127.0.0.1:{port}"}))
    (run_dir / "admin_token").write_text(TOKEN + "\n")
    assert status_main([str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "is the server running?" in err and f"monitor {run_dir}" in err


def test_status_says_training_finished_once():
    from swarmkit.apps.monitor import status_text

    text = status_text({"state": "ROLLING", "training_finished": "training finished: trainer.total_steps=3 reached",
                        "last_error": "boom"})
    assert "training finished: trainer.total_steps=3 reached" in text and "training finished: training" not in text
    assert "last error: boom" in text


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    """Ctrl-C stops a server, a monitor or a main job (each shuts down in its own handlers; uvicorn then
    re-raises KeyboardInterrupt): ``interrupted`` and 130, not a traceback."""
    import swarmkit.__main__ as entry

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "_main", interrupted)
    with pytest.raises(SystemExit) as info:
        entry.main(["mode=server"])
    assert info.value.code == 130 and capsys.readouterr().err == "interrupted\n"
