"""Shared by the GPU benchmarks (not a benchmark itself): make the checkout importable and name the model shapes.

On the GPU machine the repository may run without being pip-installed: the checkout goes on ``sys.path``
and ``swarmkit_plugins`` is mapped onto ``plugins/``. Import it first: ``from _repo import ROOT``.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
try:  # the repo not pip-installed (the GPU machine): map swarmkit_plugins onto plugins/
    import swarmkit_plugins  # noqa: F401
except ImportError:
    _pkg = types.ModuleType("swarmkit_plugins")
    _pkg.__path__ = [str(ROOT / "plugins")]
    sys.modules["swarmkit_plugins"] = _pkg

#: the Qwen2.5-0.5B trunk (its vocabulary is the caller's: the real one, or the tiny tokenizer's)
QWEN_05B: dict[str, Any] = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, intermediate_size=4864)
