"""The public kit for plugin authors (and swarmkit's own tests).

- :mod:`.conformance`: the backend conformance suite (:class:`BackendConformance`,
  :data:`CONFORMANCE_CHECKS`) every inference backend must pass, and
  :func:`build_test_model` (the built-in tiny model with larger random weights).
- :mod:`.scripted`: :class:`ScriptedBackend`, a zero-compute backend that answers
  from a script, for testing clients, the proxy and the cycle without a model.
"""

from swarmkit.testing.conformance import (
    CONFORMANCE_CHECKS,
    PROMPTS,
    BackendConformance,
    BackendHarness,
    build_test_model,
)
from swarmkit.testing.scripted import ScriptedBackend

__all__ = ["CONFORMANCE_CHECKS", "PROMPTS", "BackendConformance", "BackendHarness", "ScriptedBackend",
           "build_test_model"]
