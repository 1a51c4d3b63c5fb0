"""Shared fixtures. Tests run on CPU with tiny models; keep torch to few threads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the SDK keeps the keys that hold client ids here, not in the user's ~/.cache (child processes inherit it);
# a folder this session made is removed at its end (pytest_unconfigure)
if "SWARMKIT_CLIENT_KEYS" not in os.environ:
    os.environ["SWARMKIT_CLIENT_KEYS"] = _KEYS_MADE = __import__("tempfile").mkdtemp(prefix="swarmkit-client-keys-")
else:
    _KEYS_MADE = ""

import time  # noqa: E402

import pytest  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from swarmkit.server.app import create_app  # noqa: E402
from swarmkit.swarm.server import MemoryCycle, SwarmServer  # noqa: E402
from swarmkit.testing.scripted import ScriptedBackend  # noqa: E402

#: the conversation Harness.chat sends by default
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture()
def fresh_plugins(monkeypatch):
    """Forget the process-wide plugin state before and after a test."""
    from swarmkit import plugins

    plugins.reset()
    yield plugins
    plugins.reset()


# --------------------------------------------------------------------------- in-process server
@pytest.fixture(scope="session")
def train_cfg():
    from swarmkit.config.compose import compose
    from swarmkit.config.validate import validate_config
    from swarmkit.plugins import get_registry

    return validate_config(compose(["model=tiny"]), get_registry())


@pytest.fixture(scope="session")
def serve_tiny_hf(train_cfg):
    """A context manager ``serve(run_dir, token, **server_keys)``: a real server (uvicorn on 127.0.0.1) running
    the hf engine on the tiny model on the CPU, no training step, started and ROLLING; yields ``(handle,
    SwarmClient)`` and stops the server on exit."""
    import contextlib

    from omegaconf import OmegaConf

    from swarmkit.apps.serve import start_server_thread
    from swarmkit.client import SwarmClient

    @contextlib.contextmanager
    def serve(run_dir, token, **server_keys):
        cfg = OmegaConf.create(OmegaConf.to_container(train_cfg, resolve=True))
        cfg.backend.device = "cpu"
        cfg.trainer.total_steps = 0
        cfg.logger = []
        for key, value in server_keys.items():  # the training config's server limits apply at boot
            cfg.server[key] = value
        h = start_server_thread({"server": {"host": "127.0.0.1", "port": 0, "admin_token": token,
                                            "run_dir": str(run_dir), **server_keys}}, config=cfg)
        try:
            with SwarmClient(h.url, token=token) as c:
                c.start()
                c.wait_for_state("ROLLING", timeout=120)
                yield h, c
        finally:
            h.stop()
    return serve


@pytest.fixture(scope="session")
def tokenizer():
    from swarmkit.models import build_tiny_tokenizer

    return build_tiny_tokenizer()


class Harness:
    """An in-process server (Starlette TestClient) on a scripted backend, with request helpers."""

    def __init__(self, tc: TestClient, srv: SwarmServer, backend: ScriptedBackend, accepted: list):
        self.tc, self.srv, self.backend, self.accepted = tc, srv, backend, accepted
        self.admin = {"Authorization": f"Bearer {srv.admin_token}"}

    def call(self, fn, *args):
        """Run ``fn`` in the server's event loop thread."""
        return self.tc.portal.call(fn, *args)

    def register(self, **body):
        body.setdefault("task_id", "t1")
        r = self.tc.post("/api/v1/episodes", json=body)
        assert r.status_code == 201, r.text
        return r.json()

    def chat(self, key, **body):
        body.setdefault("messages", MSGS)
        body.setdefault("model", "any")
        return self.tc.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})

    def report(self, ep, reward, key=None):
        return self.tc.post(f"/api/v1/episodes/{ep['episode_id']}/report", json={"reward": reward},
                            headers={"Authorization": f"Bearer {key or ep['api_key']}"})


@pytest.fixture()
def make(train_cfg, tokenizer, tmp_path):
    made = []

    def factory(replies=("Hello there.",), start=True, accept_hook=None, config=train_cfg, **server_cfg):
        backend = ScriptedBackend(tokenizer, replies=replies)
        accepted: list = []
        hook = None if accept_hook is False else accept_hook or accepted.append
        scfg = {"run_dir": str(tmp_path), "admin_token": "admin-secret-token", **server_cfg}
        srv = SwarmServer(scfg, config=config, backend_factory=lambda cfg: backend, cycle=MemoryCycle(hook))
        srv.reaper_interval_s = 0.05
        tc = TestClient(create_app(srv), base_url="http://127.0.0.1:8000")
        tc.__enter__()
        made.append(tc)
        h = Harness(tc, srv, backend, accepted)
        if start:
            r = tc.post("/api/v1/admin/start", headers=h.admin)
            assert r.status_code == 202, r.text
            for _ in range(200):
                if srv.state.state == "ROLLING":
                    break
                time.sleep(0.01)
            assert srv.state.state == "ROLLING", srv.state.last_error
        return h

    yield factory
    for tc in made:
        tc.__exit__(None, None, None)


def interruptible() -> None:
    """``preexec_fn`` for a child a test stops with SIGINT (Ctrl-C): SIGINT's default action in it. A
    process started in the background of a non-interactive shell (``cmd &``, as a CI runner may start
    the test run) inherits SIGINT *ignored*, and Python keeps it ignored: the child would never see the
    Ctrl-C the test sends, and a server would end its graceful shutdown with exit 0 instead of 130."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def pytest_unconfigure(config):
    """Remove the client-key folder this session made (one per test run otherwise piles up in /tmp)."""
    if _KEYS_MADE:
        import shutil

        shutil.rmtree(_KEYS_MADE, ignore_errors=True)
