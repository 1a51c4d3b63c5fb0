"""``python -m swarmkit new-task NAME``: the scaffold is refused where it should be, lint-clean, its
agent's tool path runs, and the generated client trains the tiny model (held-out reward rises)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarmkit.apps.new_task import FILES, main, write_task
from swarmkit.procs import free_port

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "new-task-admin-token-" + "x" * 16


def test_names_and_folders_are_checked(tmp_path, capsys):
    for bad, why in [("1game", "not a valid"), ("my-game", "not a valid"), ("class", "keyword"),
                     ("json", "already importable"), ("swarmkit", "already importable")]:
        assert main([bad, "--dir", str(tmp_path)]) == 2
        assert why in capsys.readouterr().err, bad
    assert main(["scaffold_names", "--dir", str(tmp_path)]) == 0
    assert "python -m scaffold_names.client" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "scaffold_names").iterdir()) == sorted(FILES)
    assert main(["scaffold_names", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert "trains on the tiny model" in subprocess.run(
        [sys.executable, "-m", "swarmkit", "new-task", "--help"], capture_output=True, text=True).stdout


def test_the_generated_package_is_lint_clean_and_names_itself(tmp_path):
    pkg = write_task("scaffold_lint", tmp_path)
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                          str(pkg)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    readme = (pkg / "README.md").read_text()
    assert "python -m scaffold_lint.client --url http://127.0.0.1:8000" in readme
    assert "__NAME__" not in "".join((pkg / f).read_text() for f in FILES)


@pytest.fixture()
def scripted_server(tmp_path):
    """A server whose model (scripted, the tiny model's template) first calls the tool, then answers
    with the tool's result in mind."""
    from swarmkit.apps.wiring import build_server
    from swarmkit.client import SwarmClient
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.models import build_tiny_tokenizer
    from swarmkit.plugins import get_registry
    from swarmkit.server.run import run_in_thread
    from swarmkit.testing.scripted import ScriptedBackend

    tok = build_tiny_tokenizer()

    def script(ids):
        prompt = tok.decode(ids)
        if "The letter is" in prompt:
            return "eee"
        return '<tool_call>{"name": "letter_hint", "arguments": {"word": "apple"}}</tool_call>'

    backend = ScriptedBackend(tok, replies=script)
    config = validate_config(compose(["model=tiny"]), get_registry())
    srv, app = build_server({"server": {"host": "127.0.0.1", "port": 0, "admin_token": TOKEN,
                                        "run_dir": str(tmp_path / "run")}},
                            train=False, config=config, backend_factory=lambda cfg: backend)
    handle = run_in_thread(srv, app)
    client = SwarmClient(handle.url, token=TOKEN, retry_for=10)
    try:
        client.start()
        client.wait_for_state("ROLLING", timeout=30)
        yield client, backend, tok
    finally:
        client.close()
        handle.stop()


def test_the_agent_offers_the_tool_runs_its_calls_and_the_turns_merge(tmp_path, scripted_server, monkeypatch):
    pytest.importorskip("openai")
    client, backend, tok = scripted_server
    write_task("scaffold_tool", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    agent = importlib.import_module("scaffold_tool.agent")
    task = importlib.import_module("scaffold_tool.task")
    item = task.make_items("eval", 1)[0]
    with client.episode(task_id=item.item_id) as ep:
        result = agent.run_agent(ep.base_url, ep.api_key, item, max_tokens=64)  # room for the call
        ep.report(task.reward(item, result.answer, result.tool_calls))
        timelines = ep.timelines(as_objects=True)
    assert (result.answer, result.tool_calls, result.valid_tool_calls, result.turns) == ("eee", 1, 1, 2)
    assert "letter_hint" in tok.decode(backend.prompts[0])  # the tool was offered
    assert "The letter is 'e'." in tok.decode(backend.prompts[1])  # and its result sent back
    assert task.reward(item, result.answer) == 1.0
    from swarmkit.timelines.merging import merge_timelines

    assert len(timelines) == 2 and len(merge_timelines(timelines)) == 1  # one training sample


def test_the_generated_client_trains_the_tiny_model(tmp_path):
    """The README's commands: a bare server, the generated client; 10 steps raise held-out reward."""
    pytest.importorskip("openai")
    assert main(["scaffold_train", "--dir", str(tmp_path)]) == 0
    port = free_port()
    env = dict(os.environ, SWARMKIT_ADMIN_TOKEN=TOKEN, HF_HUB_OFFLINE="1", SWARMKIT_TORCH_THREADS="1")
    with open(tmp_path / "server.log", "wb") as log:
        server = subprocess.Popen([sys.executable, "-m", "swarmkit", "mode=server", f"server.port={port}",
                                   f"server.run_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                                  cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "scaffold_train.client", "--url", f"http://127.0.0.1:{port}",
                              "--steps", "10", "--summary", "summary.json"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    print(f"\nscaffold: eval {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} in {summary['steps']} steps, "
          f"{summary['episodes']} episodes, {time.monotonic() - started:.0f} s")
    assert summary["steps"] == 10 and summary["failures"] == 0, summary
    assert summary["eval_failures_before"] == summary["eval_failures_after"] == 0, summary  # a failure scores 0
    assert summary["answers_after"] and "most common answers:" in out.stdout, out.stdout
    assert summary["eval_after"] >= summary["eval_before"] + 0.2, summary
    rows = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("kind") == "train"] == list(range(1, 11))


def test_the_warm_start_sends_demonstrations_grouped_by_rollouts_per_task(tmp_path, monkeypatch):
    """``--demonstrations N``: N demonstrations (whole steps only), ``--group`` to a task id, so batching C2
    trains ``batch_size`` groups of different demonstrations per step; it waits for those steps."""
    import contextlib
    import threading

    pytest.importorskip("openai")
    write_task("scaffold_warm", tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    client_mod = importlib.import_module("scaffold_warm.client")
    task = importlib.import_module("scaffold_warm.task")
    sent: list[tuple[str, str, list]] = []
    lock = threading.Lock()

    class FakeClient:
        step = 3

        def status(self):
            with lock:
                self.step += len(sent) == 16  # the server trains once the demonstrations are in
                return {"global_step": self.step}

        @contextlib.contextmanager
        def episode(self, task_id, **kw):
            ep = type("Ep", (), {})()
            ep.demonstrate = lambda messages, tools=None: sent.append((task_id, messages, tools))
            ep.report = lambda reward: {"accepted": True}
            yield ep

    items = task.make_items("demo", 20)
    steps = client_mod.warm_start(FakeClient(), items, group=4, batch_size=2, concurrency=3, timeout=30)
    assert steps == 2 and len(sent) == 16  # 20 rounded down to whole steps of 4 x 2
    ids = sorted(t for t, _, _ in sent)
    assert ids == sorted(f"scaffold_warm-demo-{k}" for k in range(4) for _ in range(4))
    _, messages, tools = sent[0]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2]["tool_calls"][0]["function"]["name"] == "letter_hint"
    assert tools[0]["function"]["name"] == "letter_hint"
    assert task.reward(items[0], messages[-1]["content"]) == 1.0  # the demonstrated answer is the best one
