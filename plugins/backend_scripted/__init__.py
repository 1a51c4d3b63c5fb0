"""Inference backend ``scripted``: answers from a script file, no model (testing an agent's plumbing)."""

from swarmkit import hookimpl
from swarmkit_plugins.backend_scripted.schema import ScriptedBackendConfig


@hookimpl
def register_backends(register):
    register(
        "scripted",
        "swarmkit_plugins.backend_scripted.engine:ScriptFileBackend",
        schema=ScriptedBackendConfig,
        requires=("transformers", "yaml"),
        description="replies from a script file (backend.script=PATH), no model; training steps change no weights",
    )
