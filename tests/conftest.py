"""Shared fixtures. Tests run on CPU with tiny models; keep torch to few threads."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture()
def fresh_plugins(monkeypatch):
    """Forget the process-wide plugin state before and after a test."""
    from swarmkit import plugins

    plugins.reset()
    yield plugins
    plugins.reset()
